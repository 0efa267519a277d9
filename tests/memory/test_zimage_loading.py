"""Z-Image loads as the family ``zimage`` from a ZImagePipeline folder and from the tiny choice, and the VRAM
planner sizes its DiT blocks (guards: family detected from files, the denoiser in the ``unet`` slot, bf16 default)."""
import pytest
import torch

from leandiffusion.memory.engine import parts_from_components
from leandiffusion.memory.folders import load_diffusers_folder
from leandiffusion.memory.load import TINY_ZIMAGE_CHOICE, load_components, load_engine
from leandiffusion.memory.policies import default_dtype, default_working_shape
from leandiffusion.memory.tiny_zimage import build_tiny_zimage, save_zimage_folder
from leandiffusion.memory.units import trace_units


@pytest.fixture(scope="module")
def zimage_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zimage") / "tiny-zimage"
    return save_zimage_folder(build_tiny_zimage(seed=3), folder), build_tiny_zimage(seed=3)


def test_folder_loads_as_zimage_with_identical_weights(zimage_folder):
    folder, built = zimage_folder
    loaded = load_diffusers_folder(folder)
    assert loaded["family"] == "zimage"
    for part in ("transformer", "text_encoder", "vae"):
        want, got = built[part].state_dict(), loaded[part].state_dict()
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(want[key], got[key]), (part, key)
    assert loaded["scheduler_config"]["shift"] == 3.0
    assert loaded["tokenizer"]("a cat").input_ids == built["tokenizer"]("a cat").input_ids


def test_parts_hold_the_dit_in_the_denoiser_slot():
    parts = parts_from_components(build_tiny_zimage())
    assert parts.is_flow and parts.family == "zimage"
    assert parts.denoiser is parts.unet and hasattr(parts.unet, "noise_refiner")
    assert parts.latent_channels == 16
    assert parts.vae_shift_factor == pytest.approx(0.1159) and parts.vae_scaling_factor == pytest.approx(0.3611)


def test_defaults_bf16_on_cuda_and_native_working_shape():
    parts = parts_from_components(build_tiny_zimage())
    assert default_dtype("zimage", torch.device("cuda")) == torch.bfloat16
    assert default_dtype("sdxl", torch.device("cuda")) == torch.float16
    assert default_dtype("zimage", torch.device("cpu")) == torch.float32
    assert default_working_shape(parts) == (2, 128, 128)


def test_dit_units_are_every_block_in_execution_order():
    dit = build_tiny_zimage()["transformer"]
    units = trace_units(dit, (1, 16, 16), torch.float32)
    assert [u.name for u in units] == ["noise_refiner.0", "context_refiner.0", "layers.0", "layers.1"]
    block_bytes = sum(p.numel() * 4 for p in dit.layers[0].parameters())
    assert units[2].nbytes >= block_bytes
    assert units[2].flops > units[0].flops  # the main blocks see image and caption tokens


def test_tiny_choice_loads_a_fresh_copy_each_time():
    first, _ = load_components(TINY_ZIMAGE_CHOICE)
    second, name = load_components(TINY_ZIMAGE_CHOICE)
    assert name == "tiny-zimage" and first["transformer"] is not second["transformer"]
    engine = load_engine(TINY_ZIMAGE_CHOICE, device="cpu")
    assert engine.family == "zimage" and "zimage" in engine.plan
