"""Tiny model files the integration tests put into the test ComfyUI's model folders, and the input images the
shipped workflows' LoadImage nodes name."""
from pathlib import Path

ZIMAGE_TAG = "tiny_zimage"
# the split loader's inputs for the files ``write_tiny_zimage_files`` writes
TINY_ZIMAGE_FILES = {"diffusion_model": f"{ZIMAGE_TAG}_diffusion_model.safetensors",
                     "text_encoder": f"{ZIMAGE_TAG}_text_encoder.safetensors",
                     "vae": f"{ZIMAGE_TAG}_vae.safetensors"}


def write_tiny_model_files(models_dir: Path, lora_name: str, upscaler_name: str) -> None:
    """A kohya LoRA for the tiny SD1 model (UNet attention + text encoder) in ``loras/lora_name`` and a tiny compact
    x4 upscaler in ``upscale_models/upscaler_name``."""
    from safetensors.torch import save_file

    from leandiffusion.tests.kit import tiny_components
    from leandiffusion.tests.lora import lorafiles
    from leandiffusion.tests.upscale.helpers import random_compact

    c = tiny_components("sd1")
    lora = lorafiles.kohya_state_dict({"unet": c["unet"], "text_encoder": c["text_encoder"]},
                                      {"unet": lorafiles.ATTN_FF, "text_encoder": lorafiles.TE_LINEARS})
    lorafiles.write(lora, models_dir / "loras" / lora_name)
    save_file(random_compact(), str(models_dir / "upscale_models" / upscaler_name))


def write_tiny_zimage_files(models_dir: Path) -> dict:
    """The tiny Z-Image as split files in ComfyUI's layout (bf16, Comfy-Org's ``model.diffusion_model.`` prefix)
    and as ``diffusers/tiny-zimage`` (the split loader takes its tokenizer from a Z-Image diffusers folder before
    ComfyUI's own Qwen files, whose full vocabulary the tiny text encoder lacks). Returns the loader's inputs."""
    from leandiffusion.memory.tiny_zimage import build_tiny_zimage, save_zimage_folder
    from leandiffusion.tests.kit.zimage_split import write_split_files

    components = build_tiny_zimage(seed=0)
    names = write_split_files(components, Path(models_dir), ZIMAGE_TAG, dtype="bf16", comfy=True)
    assert names == TINY_ZIMAGE_FILES, names
    save_zimage_folder(components, Path(models_dir) / "diffusers" / "tiny-zimage")
    return names


def write_input_images(prompt: dict, input_dir: Path) -> None:
    """A 64x64 RGB picture in ``input_dir`` under each file name a LoadImage node of the API ``prompt`` names."""
    from PIL import Image

    for node in prompt.values():
        if node["class_type"] == "LoadImage" and isinstance(node["inputs"].get("image"), str):
            target = input_dir / node["inputs"]["image"]
            target.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (64, 64), (200, 120, 40)).save(target)
