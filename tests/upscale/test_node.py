"""LeanESRGANUpscale node: its input names, menu listing from the upscale_models folder, and plumbing
equal to calling the package directly."""
import pytest
import torch
from safetensors.torch import save_file

from leandiffusion.nodes.upscale import LeanESRGANUpscale
from leandiffusion.tests.upscale import helpers as H
from leandiffusion.upscale.loader import build_upscaler
from leandiffusion.upscale.runner import upscale_images


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    (tmp_path / "upscale_models" / "sub").mkdir(parents=True)
    save_file(H.random_compact(num_conv=2), str(tmp_path / "upscale_models" / "sub" / "tiny.safetensors"))
    torch.save(H.random_rrdb(), tmp_path / "upscale_models" / "rrdb.pth")
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(tmp_path))
    return tmp_path


def test_inputs_are_the_contract(models_dir):
    spec = LeanESRGANUpscale.INPUT_TYPES()["required"]
    assert list(spec) == ["image", "model_name", "output_scale", "device", "tile_size", "tile_overlap", "precision"]
    assert spec["image"][0] == "IMAGE" and LeanESRGANUpscale.RETURN_TYPES == ("IMAGE",)
    assert spec["model_name"][0] == ["rrdb.pth", "sub/tiny.safetensors"]
    assert spec["device"][0] == ["auto", "gpu", "cpu"] and spec["precision"][0] == ["auto", "fp16", "bf16", "fp32"]
    assert spec["output_scale"][1]["default"] == 0.0 and spec["tile_size"][1]["default"] == 0
    assert spec["tile_overlap"][1]["default"] == 32 and spec["tile_overlap"][1]["max"] == 256
    assert LeanESRGANUpscale.CATEGORY == "LeanDiffusion/upscale"


@pytest.mark.parametrize("name", ["sub/tiny.safetensors", "rrdb.pth"])
def test_node_runs(models_dir, name):
    img = torch.rand(2, 12, 16, 3)
    (out,) = LeanESRGANUpscale().upscale(img, name, 2.0, "cpu", 0, 32, "fp32")
    assert out.shape == (2, 24, 32, 3)
    sd = H.random_compact(num_conv=2) if name.endswith("safetensors") else H.random_rrdb()
    ref = upscale_images(build_upscaler(sd), img, output_scale=2.0, device="cpu", quiet=True)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)


def test_node_refuses_escapes(models_dir):
    with pytest.raises(ValueError, match="outside"):
        LeanESRGANUpscale().upscale(torch.rand(1, 8, 8, 3), "../x.pth", 0.0, "cpu", 0, 32, "auto")


def test_ranges_and_defaults_are_the_documented_ones(models_dir):
    """docs/upscale.md: output_scale 0 or 0.25-16, tile_size 0 or 32-2048, tile_overlap 0-256, device and precision
    `auto` by default (the two upper limits and the device default are checked nowhere else)."""
    spec = LeanESRGANUpscale.INPUT_TYPES()["required"]
    assert (spec["output_scale"][1]["min"], spec["output_scale"][1]["max"]) == (0.0, 16.0)
    assert (spec["tile_size"][1]["min"], spec["tile_size"][1]["max"]) == (0, 2048)
    assert spec["tile_overlap"][1]["min"] == 0
    assert (spec["device"][1]["default"], spec["precision"][1]["default"]) == ("auto", "auto")


def test_every_widget_reaches_the_runner_as_itself(models_dir, monkeypatch):
    """Every widget value reaches the runner unchanged: a node passing precision='auto' whatever was chosen would
    pass the other tests (on the CPU 'auto' is fp32, the precision the node test asks for)."""
    import leandiffusion.nodes.upscale as node_module

    seen = {}
    monkeypatch.setattr(node_module, "upscale_images", lambda upscaler, image, **kw: seen.update(kw, image=image))
    image = torch.rand(1, 12, 16, 3)
    LeanESRGANUpscale().upscale(image, "rrdb.pth", 1.5, "cpu", 64, 8, "bf16")
    assert seen == dict(image=image, output_scale=1.5, device="cpu", tile_size=64, tile_overlap=8, precision="bf16")
