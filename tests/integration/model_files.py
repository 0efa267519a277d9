"""Tiny model files the integration tests put into the test ComfyUI's model folders, and the input images the
shipped workflows' LoadImage nodes name."""
from pathlib import Path


def write_tiny_model_files(models_dir: Path, lora_name: str, upscaler_name: str) -> None:
    """A kohya LoRA for the tiny SD1 model (UNet attention + text encoder) in ``loras/lora_name`` and a tiny compact
    x4 upscaler in ``upscale_models/upscaler_name`` (``tests/kit/tiny_model_files.py``)."""
    from leandiffusion.tests.kit.tiny_model_files import write_files

    write_files(models_dir, {"lora": f"loras/{lora_name}", "upscaler": f"upscale_models/{upscaler_name}"})


def write_input_images(prompt: dict, input_dir: Path) -> None:
    """A 64x64 RGB picture in ``input_dir`` under each file name a LoadImage node of the API ``prompt`` names."""
    from PIL import Image

    for node in prompt.values():
        if node["class_type"] == "LoadImage" and isinstance(node["inputs"].get("image"), str):
            target = input_dir / node["inputs"]["image"]
            target.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (64, 64), (200, 120, 40)).save(target)
