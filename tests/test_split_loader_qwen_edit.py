"""Memory Pool Loader (split files) with a Qwen2.5-VL file that carries its vision tower (``visual.*``, as ComfyUI's
``qwen_2.5_vl_7b.safetensors``): the text stage keeps the whole Qwen2.5-VL and an image processor built in code, so
the Fused Edit Sampler runs the split files and gives the LATENT of the Qwen-Image-Edit diffusers folder they were
written from. The in-code image processor equals the folder's ``processor/`` one on the same pictures.

References are independent of the loader: the folder loaded by ``from_pretrained`` (tests/sampling/qwen checks it
against diffusers' pipeline) and the split files written by the kit's hand-written inverse layouts."""
import pytest
import torch

from leandiffusion import bridge
from leandiffusion.memory.load import load_engine
from leandiffusion.memory.split_files import load_split_engine
from leandiffusion.memory.tiny_qwen_image import build_tiny_qwen_image, save_qwen_image_edit_folder
from leandiffusion.sampling.qwen.edit import EditSettings, sample_qwen_edit
from leandiffusion.tests.kit import qwen_image_split as kit
from leandiffusion.tests.kit.qwen_edit import image_batch, pictures


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    components = kit.qwen_grid(build_tiny_qwen_image(seed=4), "bf16")
    save_qwen_image_edit_folder(components, root / "diffusers" / "tiny-qwen-edit")
    return root, kit.write_split_files(components, root, "edit", dtype="bf16")


@pytest.fixture
def engines(library, monkeypatch):
    monkeypatch.setenv(bridge.MODELS_ENV, str(library[0]))
    monkeypatch.setattr(bridge, "comfy_qwen_tokenizer_dir", lambda: None)
    names = library[1]
    split = load_split_engine(names["diffusion_model"], names["text_encoder"], names["vae"], "full", device="cpu")
    return load_engine("tiny-qwen-edit", "full", device="cpu"), split


def test_the_split_files_edit_as_the_folder(engines):
    folder, split = engines
    assert split.family == "qwen_image"  # the DiT's tensors are Qwen-Image's: the vision tower makes it an editor
    assert split.parts.text_encoder.visual is not None
    image, image2 = image_batch(7, 1, 80, 96), image_batch(8, 1, 96, 64)
    settings = EditSettings("put Picture 2 on Picture 1", "blurry", seed=5, steps=2, true_cfg=4.0, megapixels=0.0625)
    ref = sample_qwen_edit(folder, settings, image, image2)["samples"]
    out = sample_qwen_edit(split, settings, image, image2)["samples"]
    assert out.shape == ref.shape and (out - ref).abs().max().item() <= 1e-4
    assert ref.abs().max().item() > 1.0


def test_the_in_code_image_processor_equals_the_folders(engines):
    folder, split = engines
    images = pictures(image_batch(9, 2, 100, 150))
    a = folder.parts.image_processor(images=images, return_tensors="pt")
    b = split.parts.image_processor(images=images, return_tensors="pt")
    assert torch.equal(a["image_grid_thw"], b["image_grid_thw"])
    assert torch.equal(a["pixel_values"], b["pixel_values"])
    assert folder.parts.image_processor.to_dict() == split.parts.image_processor.to_dict()
