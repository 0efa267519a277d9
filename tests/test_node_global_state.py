"""Every node leaves the process as it found it and its inputs as it got them.

Guards the promise "never mutate an input or a process global" at the level users see it, one node call at a time on
tiny models:
- torch's global random generator (CPU, and CUDA where present) is where it was: ComfyUI users rely on seeds, and a
  node that draws from (or re-seeds) the global generator changes what every later node that draws from it gets
  (the ESRGAN Upscale node did, through PyTorch's random init of the network it built);
- the inputs (LATENT dicts, IMAGE tensors, CONDITIONING lists, the LEAN_MODEL engine) are equal, value for value,
  before and after;
- every process-wide setting of ``tests/kit/process_state.py`` is as it was: torch's numeric and kernel switches
  (TF32 through both of PyTorch's APIs, reduced-precision reductions, SDPA backends, cuDNN benchmark/deterministic,
  deterministic algorithms, default dtype, autocast, grad/inference mode, threads), dynamo's and inductor's config,
  the environment, sys.path, the working folder, signal handlers, other loggers and warnings filters. On a GPU the
  nodes run again on CUDA (CUDA graphs, the untiled decode's TF32 attention scope, pinned upscale staging), where
  those paths differ; ``conftest.py`` checks the same settings after every other test.
Importing the pack (ComfyUI reads ``NODE_CLASS_MAPPINGS`` right after) changes none of them either: checked in a
fresh interpreter, as ComfyUI's would be.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from leandiffusion.nodes import NODE_CLASS_MAPPINGS as NODES
from leandiffusion.tests.kit import process_state, tiny_components, tiny_engine
from leandiffusion.tests.lora import lorafiles as lf
from leandiffusion.tests.upscale import helpers as H

STEP = dict(steps=2, cfg=7.5, width=64, height=64, timestep_spacing="leading")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    (root / "upscale_models").mkdir()
    save_file(H.random_compact(num_conv=2), str(root / "upscale_models" / "compact.safetensors"))
    torch.save(H.random_rrdb(), root / "upscale_models" / "rrdb.pth")
    (root / "loras").mkdir()
    unet = tiny_components("sd1")["unet"]
    lf.write(lf.kohya_state_dict({"unet": unet}, {"unet": lf.ATTN_FF}), root / "loras" / "style.safetensors")
    return root


@pytest.fixture(autouse=True)
def _models_env(models_dir, monkeypatch):
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(models_dir))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module", params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(scope="module")
def engine(device):
    return tiny_engine("sd1", device=device)


def _acceleration(device: str) -> str:
    return "cuda_graph" if device == "cuda" else "none"


def _generators() -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available():
        states += torch.cuda.get_rng_state_all()
    return states


def _snapshot(value):
    """A deep copy of tensors, dicts, lists and tuples (engines and other objects: by identity)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    return value


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b


def _engine_state(engine) -> tuple:
    weights = {f"{name}.{k}": v.detach().clone() for name in ("unet", "vae", "text_encoder")
               for k, v in getattr(engine.parts, name).state_dict().items()}
    return engine.adapters, weights


def _call(node_id: str, method: str, **inputs):
    """Run one node with a re-seeded global generator; assert it, the process-wide settings and the inputs are
    unchanged."""
    before_inputs = _snapshot(inputs)
    engine = inputs.get("lean_model")
    before_engine = _engine_state(engine) if engine is not None else None
    torch.manual_seed(1234)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(1234)
    before = _generators()
    settings = process_state.snapshot()
    out = getattr(NODES[node_id](), method)(**inputs)
    changed = process_state.changes(settings, process_state.snapshot())
    after = _generators()
    assert all(torch.equal(x, y) for x, y in zip(before, after)), f"{node_id} moved torch's global generator"
    assert not changed, f"{node_id} changed process-wide settings (before, after): {changed}"
    assert _same(before_inputs, inputs), f"{node_id} changed one of its inputs"
    if engine is not None:
        adapters, weights = _engine_state(engine)
        assert adapters == before_engine[0], f"{node_id} changed the input engine's adapters"
        assert _same(weights, before_engine[1]), f"{node_id} changed the input engine's weights"
    return out


def test_loader():
    (engine, plan) = _call("LeanModelLoader", "load", model="tiny-random (test)", vram_policy="full",
                           vram_budget_gb=4.0, weight_dtype="auto", vae_dtype="auto")
    assert engine.parts.family == "sd1" and isinstance(plan, str) and plan


def test_split_loader(models_dir):
    from leandiffusion.memory.tiny_zimage import build_tiny_zimage, save_zimage_folder
    from leandiffusion.tests.kit import zimage_split

    components = zimage_split.bf16_grid(build_tiny_zimage(seed=0))
    save_zimage_folder(components, models_dir / "diffusers" / "tiny-zimage")  # the tokenizer's source
    names = zimage_split.write_split_files(components, models_dir, "tiny", dtype="fp8_scaled", comfy=True)
    (engine, plan) = _call("LeanSplitModelLoader", "load", **names, vram_policy="full", vram_budget_gb=4.0,
                           weight_dtype="auto", vae_dtype="auto")
    assert engine.parts.family == "zimage" and isinstance(plan, str) and plan


@pytest.mark.parametrize("mode", ["unmerged", "merged"])
def test_lora_then_sampler(engine, device, mode):
    (view,) = _call("LeanLoraInjector", "inject", lean_model=engine, lora_name="style.safetensors", strength=0.8,
                    strength_text_encoder=1.0, target_blocks="", mode=mode)
    assert len(view.adapters) == 1
    (latent,) = _call("LeanFusedDDIMSampler", "run", lean_model=view, positive="a cat", negative="", seed=3, eta=0.0,
                      batch_size=1, cfg_mode="batched", acceleration=_acceleration(device), **STEP)
    assert latent["samples"].shape == (1, 4, 8, 8) and torch.isfinite(latent["samples"]).all()


def test_sampler_with_noise_img2img_and_conditioning(engine, device):
    latent = {"samples": torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)), "batch_index": [0, 1]}
    gen = torch.Generator().manual_seed(1)
    cond = [[torch.randn(1, 77, 64, generator=gen), {"pooled_output": torch.randn(1, 64, generator=gen)}]]
    uncond = [[torch.randn(1, 77, 64, generator=gen), {"pooled_output": torch.randn(1, 64, generator=gen)}]]
    (out,) = _call("LeanFusedDDIMSampler", "run", lean_model=engine, positive="", negative="", seed=3, eta=1.0,
                   batch_size=2, cfg_mode="sequential", latent_image=latent, denoise=0.5, positive_cond=cond,
                   negative_cond=uncond, acceleration=_acceleration(device), **STEP)
    assert out["samples"].shape == (2, 4, 8, 8) and not torch.equal(out["samples"], latent["samples"])


def test_stream_sampler(engine, device):
    images, latents = _call("LeanStreamSampler", "run", lean_model=engine, prompts="a cat\na dog", negative="",
                            seed=5, images_per_prompt=1, max_batch=0, decode_tile_size=0,
                            acceleration=_acceleration(device), **STEP)
    assert images.shape == (2, 64, 64, 3) and latents["samples"].shape == (2, 4, 8, 8)


@pytest.mark.parametrize("seam_mode,tile", [("exact", 0), ("blend", 128)])
def test_vae_decode_and_encode(engine, seam_mode, tile):
    latent = {"samples": torch.randn(1, 4, 24, 20, generator=torch.Generator().manual_seed(2))}
    (image,) = _call("LeanTiledVAEDecode", "decode", samples=latent, tile_size=tile, overlap=16, seam_mode=seam_mode,
                     lean_model=engine)
    assert image.shape == (1, 192, 160, 3)
    (encoded,) = _call("LeanTiledVAEEncode", "encode", pixels=image, tile_size=tile, overlap=16, seam_mode=seam_mode,
                       lean_model=engine)
    assert encoded["samples"].shape == (1, 4, 24, 20)


@pytest.mark.parametrize("upscale_device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("model_name", ["compact.safetensors", "rrdb.pth"])
def test_upscale(model_name, upscale_device):
    image = torch.rand(1, 12, 16, 3, generator=torch.Generator().manual_seed(4))
    (out,) = _call("LeanESRGANUpscale", "upscale", image=image, model_name=model_name, output_scale=0.0,
                   device=upscale_device,
                   tile_size=0, tile_overlap=32, precision="auto")
    assert out.shape == (1, 48, 64, 3)  # both test nets upscale x4


_IMPORT_AUDIT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("process_state", sys.argv[1])
state = importlib.util.module_from_spec(spec)
sys.modules["process_state"] = state
spec.loader.exec_module(state)  # by path: importing it as leandiffusion.tests.kit would import the pack first
try:  # Triton's own import side effects are Triton's (3.0 imports pkg_resources, which adds a warnings filter)
    import triton
except ImportError:
    pass
before = state.snapshot()
import leandiffusion
nodes = leandiffusion.NODE_CLASS_MAPPINGS
changed = state.changes(before, state.snapshot())
print(json.dumps({"nodes": len(nodes), "changed": {k: [repr(v) for v in pair] for k, pair in changed.items()}}))
"""


def test_importing_the_pack_changes_no_process_wide_setting():
    """ComfyUI imports the pack's ``__init__`` and reads ``NODE_CLASS_MAPPINGS`` into its own process, after torch:
    nothing of ``tests/kit/process_state.py`` may differ afterwards (a fresh interpreter, so the import really runs;
    torch, which ComfyUI has imported by then, is imported by the snapshot module itself). Checked to fail when the
    registry sets ``cudnn.benchmark``, an environment variable or a root handler at import."""
    kit_file = Path(process_state.__file__)
    # a minimal environment: this process has imported the pack, so a variable its import sets would be inherited
    env = {k: os.environ[k] for k in ("PATH", "HOME", "PYTHONPATH", "TMPDIR", "LANG") if k in os.environ}
    proc = subprocess.run([sys.executable, "-c", _IMPORT_AUDIT, str(kit_file)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["nodes"] == len(NODES)
    assert report["changed"] == {}
