"""Memory Pool Loader error paths: clear errors before heavy work, nothing wedged after a failure mid-run.

Guards:
- a bad ``vram_policy`` / ``vram_budget_gb`` is refused before the checkpoint is read (a typo must not cost a
  multi-GB read and conversion);
- a ``KeyboardInterrupt`` inside a streamed UNet block (torch runs ``always_call`` hooks only for ``Exception``)
  must not leave the block streamer 'active' (every later forward refused as a "re-entrant call"): the next
  forward runs and gives the same output;
- a diffusers folder with a truncated or garbled file gives one ``ValueError`` naming ``model``, the sub-folder
  and the fix, not a bare ``SafetensorError`` / ``JSONDecodeError`` from the libraries.
"""
import shutil
from types import SimpleNamespace

import pytest
import torch

from leandiffusion.memory import load as load_mod
from leandiffusion.memory.load import build_engine
from leandiffusion.memory.plan import GiB, module_bytes
from leandiffusion.memory.policies import stream_working_minimum_gb
from leandiffusion.nodes.loader import LeanModelLoader
from leandiffusion.tests.kit import save_diffusers_folder, tiny_components, tiny_parts


@pytest.mark.parametrize("policy,budget,match", [
    ("turbo", 4.0, "vram_policy='turbo'"),
    ("full", 0.0, "vram_budget_gb=0.0"),
    ("stream", float("nan"), "vram_budget_gb=nan"),
    ("stream", "4 GB", "vram_budget_gb='4 GB'"),
])
def test_bad_policy_inputs_are_refused_before_the_checkpoint_is_read(monkeypatch, policy, budget, match):
    read = []
    monkeypatch.setattr(load_mod, "load_components", lambda choice: read.append(choice) or {})
    with pytest.raises(ValueError, match=match):
        LeanModelLoader().load("tiny-random (test)", policy, budget, "auto", "auto")
    assert read == [], "the checkpoint was read before the inputs were checked"


@pytest.mark.parametrize("choice", ["", None])
def test_an_empty_model_choice_is_named(choice):
    """An API prompt can carry any value: an empty model choice is named in the error."""
    with pytest.raises(ValueError, match=rf"model={choice!r}: expected a name from the node's model list"):
        LeanModelLoader().load(choice, "full", 4.0, "auto", "auto")


def _stream_engine():
    parts = tiny_parts("sd1")
    budget = stream_working_minimum_gb(parts, "cpu") + 0.3 * module_bytes(parts.unet, torch.float32) / GiB
    engine = build_engine(parts, "stream", budget, device="cpu")
    assert engine.placement.streamer.schedule.streamed, "the test needs blocks that really stream"
    return engine


def _unet_call(engine):
    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 77, 64, generator=g)
    with engine.session("unet"), torch.no_grad():
        return engine.unet(x, torch.tensor(500), ctx)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_interrupt_inside_a_streamed_block_leaves_the_engine_usable(exc):
    engine = _stream_engine()
    ref = _unet_call(engine)
    streamer = engine.placement.streamer
    order = streamer.schedule.order
    block = dict(engine.parts.unet.named_modules())[order[streamer.schedule.streamed[-1]].name]

    def interrupted(*args, **kwargs):
        raise exc()

    block.forward = interrupted
    try:
        with pytest.raises(exc):
            _unet_call(engine)
    finally:
        del block.forward
    assert not streamer._active and streamer._depth == 0
    assert torch.equal(_unet_call(engine), ref)  # raised "entered twice without finishing" before the fix


@pytest.fixture()
def folders(tmp_path, monkeypatch):
    base = save_diffusers_folder(tiny_components("sd1"), tmp_path / "diffusers" / "good")
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(tmp_path))

    def variant(name, damage):
        folder = tmp_path / "diffusers" / name
        shutil.copytree(base, folder)
        damage(folder)
    return variant


def _truncate(folder, sub):
    for f in (folder / sub).glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:500])


@pytest.mark.parametrize("name,damage,match", [
    ("cut_te", lambda f: _truncate(f, "text_encoder"), r"model='cut_te': the 'text_encoder' sub-folder could not be "
                                                        r"loaded \(.*header.*\); re-download or re-save the folder"),
    ("cut_unet", lambda f: _truncate(f, "unet"), r"model='cut_unet': the 'unet' sub-folder could not be loaded"),
    ("bad_index", lambda f: (f / "model_index.json").write_text("{"),
     r"model='bad_index': its model_index.json is not readable JSON .*re-download"),
    ("bad_scheduler", lambda f: (f / "scheduler" / "scheduler_config.json").write_text("[1,"),
     r"model='bad_scheduler': scheduler/scheduler_config.json is not readable JSON"),
])
def test_damaged_diffusers_folder_is_one_named_error(folders, name, damage, match):
    folders(name, damage)
    with pytest.raises(ValueError, match=match):
        LeanModelLoader().load(name, "full", 4.0, "auto", "auto")


def test_an_onload_cut_short_is_undone_in_full_by_offload(monkeypatch):
    """Ctrl-C between two parameters of ``ModuleSwap.onload`` leaves every parameter on its host view and the swap
    off the device, so the next onload moves them all. A stand-in device whose flat copy is a fresh CPU tensor
    plays the GPU (same code path)."""
    from leandiffusion.memory import hostmem

    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    swap = hostmem.ModuleSwap(module, torch.float32, torch.device("cpu"))
    host_ptrs = [p.data_ptr() for p in module.parameters()]
    stand_in = SimpleNamespace(type="gpu-stand-in")
    real_empty, real_views = torch.empty, swap.layout.views
    monkeypatch.setattr(swap, "device", stand_in)
    monkeypatch.setattr(hostmem.torch, "empty", lambda *a, device=None, **k: real_empty(*a, **k))

    def views_then_interrupt(flat):
        yield real_views(flat)[0]
        raise KeyboardInterrupt

    monkeypatch.setattr(swap, "layout", SimpleNamespace(nbytes=swap.layout.nbytes, views=views_then_interrupt))
    with pytest.raises(KeyboardInterrupt):
        swap.onload()
    assert [p.data_ptr() for p in module.parameters()] == host_ptrs  # nothing left half-moved
    assert not swap.on_device
    monkeypatch.setattr(swap, "layout", SimpleNamespace(nbytes=swap.layout.nbytes, views=real_views))
    swap.onload()  # the next visit moves every parameter
    assert swap.on_device and not {p.data_ptr() for p in module.parameters()} & set(host_ptrs)
    swap.offload()
    assert [p.data_ptr() for p in module.parameters()] == host_ptrs
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]), key


# Two failure paths of the block streamer.
def test_a_streamed_block_called_outside_the_unet_is_refused_and_the_model_stays_usable():
    """A block run on its own (another node pack's hook, a user's script) would compute with whatever weights the
    staging ring holds; it is refused by name, and the next whole-UNet call still gives the reference output."""
    engine = _stream_engine()
    ref = _unet_call(engine)
    streamer = engine.placement.streamer
    name = streamer.schedule.order[streamer.schedule.streamed[0]].name
    block = dict(engine.parts.unet.named_modules())[name]
    with engine.session("unet"), torch.no_grad():
        with pytest.raises(RuntimeError, match=rf"UNet block {name} ran outside a UNet forward; streamed blocks can "
                                               r"only run inside the whole UNet"):
            block(torch.zeros(1))
    assert torch.equal(_unet_call(engine), ref)


def test_a_unet_call_refused_before_the_streamer_began_leaves_it_usable():
    """Another pre-hook on the UNet (placed before the streamer's) refuses a call: the streamer's end hook still
    runs (always_call) and must find nothing to close, so the next call runs normally."""
    engine = _stream_engine()
    ref = _unet_call(engine)

    def refuse(module, args, kwargs):
        raise ValueError("refused by another hook")

    handle = engine.parts.unet.register_forward_pre_hook(refuse, prepend=True, with_kwargs=True)
    try:
        with pytest.raises(ValueError, match="refused by another hook"):
            _unet_call(engine)
    finally:
        handle.remove()
    streamer = engine.placement.streamer
    assert not streamer._active and streamer._depth == 0
    assert torch.equal(_unet_call(engine), ref)


def test_a_cuda_device_without_cuda_is_refused_by_name(monkeypatch):
    from leandiffusion.memory.policies import apply_vram_policy

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device='cuda': CUDA is not available in this process; use device='cpu'"):
        apply_vram_policy(tiny_parts("sd1"), "full", device="cuda")
