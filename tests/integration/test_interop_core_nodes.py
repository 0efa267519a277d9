"""Pack nodes mixed with ComfyUI 0.3.64 core nodes in the real server (CPU), where core behaviour is the contract.

- An RGBA IMAGE (core ``JoinImageWithAlpha``) into Tiled VAE Encode: core ``VAEEncode`` encodes
  ``pixels[:, :, :, :3]``, so ours must give the latent of the RGB image (bug: it failed with "expected an IMAGE
  [B, H, W, 3]"). Compared against the same encode of the plain RGB image through ``SaveLatent``.
- A model folder linked into ``models/upscale_models`` (users link shared model folders): core
  ``UpscaleModelLoader`` lists its files, so the ESRGAN Upscale menu must list the same names and the node must load
  them (bug: the menu left them out, and a linked file that was listed was refused as "not found").
"""
import json
import uuid
from pathlib import Path

import pytest
from safetensors.torch import load_file

from leandiffusion.runner.cli import main
from leandiffusion.runner.client import ComfyClient
from leandiffusion.runner.errors import EXIT_OK

pytestmark = pytest.mark.comfyui


def _combo_options(info: dict, node: str, name: str) -> list:
    """A COMBO's choices in /object_info: V1 nodes list them first, V3 nodes as ["COMBO", {"options": [...]}]."""
    spec = info[node]["input"]["required"][name]
    return spec[1]["options"] if spec[0] == "COMBO" else spec[0]


def _run(comfyui, tmp_path, prompt: dict) -> None:
    path = tmp_path / f"workflow_{uuid.uuid4().hex[:6]}.api.json"
    path.write_text(json.dumps(prompt))
    code = main([str(path), "--server", comfyui.url, "--out", str(tmp_path / "out"), "-q", "--timeout", "600"])
    assert code == EXIT_OK, comfyui.log_text()[-4000:]


def test_rgba_image_from_core_encodes_as_its_rgb(comfyui, tmp_path):
    prefix = f"interop_rgba_{uuid.uuid4().hex[:8]}"
    tiling = {"tile_size": 0, "overlap": 64, "seam_mode": "exact"}
    prompt = {
        "1": {"class_type": "LeanModelLoader", "inputs": {"model": "tiny-random (test)", "vram_policy": "auto",
                                                          "vram_budget_gb": 4.0, "weight_dtype": "auto",
                                                          "vae_dtype": "auto"}},
        "2": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 1, "color": 3381759}},
        "3": {"class_type": "SolidMask", "inputs": {"value": 0.25, "width": 64, "height": 48}},
        "4": {"class_type": "JoinImageWithAlpha", "inputs": {"image": ["2", 0], "alpha": ["3", 0]}},
        "5": {"class_type": "LeanTiledVAEEncode", "inputs": {"pixels": ["4", 0], "lean_model": ["1", 0], **tiling}},
        "6": {"class_type": "LeanTiledVAEEncode", "inputs": {"pixels": ["2", 0], "lean_model": ["1", 0], **tiling}},
        "7": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": f"{prefix}/rgba"}},
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": f"{prefix}/rgb"}},
    }
    _run(comfyui, tmp_path, prompt)
    folder = Path(comfyui.tmp) / "output" / prefix

    def latent(name):
        files = sorted(folder.glob(f"{name}_*.latent"))
        assert len(files) == 1, f"expected one {name} latent in {folder}, found {files}"
        return load_file(str(files[0]))["latent_tensor"].float()

    rgba, rgb = latent("rgba"), latent("rgb")
    assert rgba.shape == rgb.shape == (1, 4, 6, 8)
    assert (rgba - rgb).abs().max().item() <= 1e-6


def test_linked_upscale_model_folder_is_listed_and_loads_like_core(comfyui, tmp_path_factory, tmp_path):
    from safetensors.torch import save_file

    from leandiffusion.tests.upscale.helpers import random_compact

    shared = tmp_path_factory.mktemp("shared_upscalers")
    save_file(random_compact(), str(shared / "compact_x4.safetensors"))
    link = comfyui.models_dir / "upscale_models" / f"linked_{uuid.uuid4().hex[:6]}"
    link.symlink_to(shared, target_is_directory=True)
    name = f"{link.name}/compact_x4.safetensors"

    info = ComfyClient(comfyui.url).object_info()
    core = _combo_options(info, "UpscaleModelLoader", "model_name")
    ours = _combo_options(info, "LeanESRGANUpscale", "model_name")
    assert name in core  # ComfyUI itself follows the link
    assert name in ours

    prompt = {
        "1": {"class_type": "EmptyImage", "inputs": {"width": 24, "height": 16, "batch_size": 1, "color": 8421504}},
        "2": {"class_type": "LeanESRGANUpscale", "inputs": {"image": ["1", 0], "model_name": name,
                                                            "output_scale": 0.0, "device": "cpu", "tile_size": 0,
                                                            "tile_overlap": 32, "precision": "auto"}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0],
                                                    "filename_prefix": f"interop_link_{link.name}"}},
    }
    _run(comfyui, tmp_path, prompt)
    assert len(list((tmp_path / "out").rglob("*.png"))) == 1
