"""Loaded weights never alias a file on disk.

Guards the promise that a model the loader returns keeps its weights when its files change: safetensors and
``from_pretrained`` map the files, and a weight that needs no dtype cast (a CPU run in the file's dtype) stayed a
view of the mapping, so a checkpoint overwritten in place changed the loaded model silently, and one cut short killed
the process with SIGBUS at the next read of a weight. Each check overwrites every weight file of a loaded model in
place with other bytes of the same size (what ``cp`` over an existing file does), then truncates it, and compares
every parameter and buffer with what was loaded, through the loader node's own path (``load_engine`` on the CPU, the
file's dtype). It runs in a subprocess, so a SIGBUS fails the test instead of killing pytest.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from leandiffusion.memory import load as load_mod
from leandiffusion.torchfile import own_file_backed

_SCRIPT = textwrap.dedent('''
    import os, sys
    from pathlib import Path

    import torch

    from leandiffusion.memory.load import load_engine
    from leandiffusion.tests.kit import save_diffusers_folder, save_ldm_checkpoint, tiny_components

    kind, root = sys.argv[1], Path(sys.argv[2])
    os.environ["LEANDIFFUSION_MODELS"] = str(root)
    family = "sdxl"  # two text encoders, a VAE and a UNet: every part a loader returns
    if kind == "single-file":
        files = [save_ldm_checkpoint(tiny_components(family), root / "checkpoints" / "tiny.safetensors")]
        choice = "tiny.safetensors"
    else:
        folder = save_diffusers_folder(tiny_components(family), root / "diffusers" / "tiny")
        files = sorted(folder.rglob("*.safetensors"))
        choice = "tiny"
    parts = load_engine(choice, vram_policy="auto", device="cpu").parts
    modules = {k: getattr(parts, k) for k in ("unet", "vae", "text_encoder", "text_encoder_2")}
    loaded = {f"{k}.{n}": t.clone() for k, m in modules.items() for n, t in m.state_dict().items()}
    assert loaded and all(t.dtype == torch.float32 for t in loaded.values())  # the file's dtype: no cast copied them

    def changed():
        now = {f"{k}.{n}": t for k, m in modules.items() for n, t in m.state_dict().items()}
        return [n for n, t in loaded.items() if not torch.equal(now[n], t)]

    for path in files:
        with open(path, "r+b") as f:  # same inode, same size, other bytes (0xff: NaN in every float)
            f.write(b"\\xff" * path.stat().st_size)
    print("changed by overwriting:", len(changed()), changed()[:3], flush=True)
    for path in files:
        os.truncate(path, 0)
    print("changed by truncating:", len(changed()), changed()[:3], flush=True)
''')


@pytest.mark.parametrize("kind", ["single-file", "diffusers folder"])
def test_loaded_weights_survive_their_files_being_overwritten_and_truncated(tmp_path, kind):
    result = subprocess.run([sys.executable, "-c", _SCRIPT, kind, str(tmp_path)], capture_output=True, text=True,
                            env=dict(os.environ), timeout=600)
    died = f" (killed by {signal.Signals(-result.returncode).name})" if result.returncode < 0 else ""
    assert result.returncode == 0, f"exit {result.returncode}{died}:\n{result.stdout}\n{result.stderr[-3000:]}"
    assert "changed by overwriting: 0 []" in result.stdout, result.stdout
    assert "changed by truncating: 0 []" in result.stdout, result.stdout


def test_the_tiny_model_owns_its_weights():
    """The built-in tiny model is built in memory: nothing of it is a file view (nothing for the copy to do)."""
    components, _ = load_mod.load_components(load_mod.TINY_CHOICE)
    for key in ("unet", "vae", "text_encoder"):
        assert own_file_backed(components[key]) == 0, key


def test_only_file_views_are_copied_and_tied_weights_stay_tied(tmp_path):
    """``own_file_backed`` copies what maps a file and nothing else: a weight torch allocated keeps its memory (no
    needless copy of a model already owned), a weight read by ``torch.load`` (memory torch did not allocate, but no
    file mapping) too where the process's mappings can be read, and one tensor shared by two modules stays shared."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    save_file({"w": torch.full((8, 8), 0.5)}, str(tmp_path / "w.safetensors"))
    torch.save({"w": torch.full((8, 8), 0.25)}, tmp_path / "w.pt")
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        mapped = f.get_tensor("w")
    shared = torch.nn.Linear(8, 8, bias=False)
    shared.weight = torch.nn.Parameter(mapped, requires_grad=False)
    model = torch.nn.ModuleDict({"a": shared, "b": torch.nn.Linear(8, 8), "c": torch.nn.Linear(8, 8, bias=False)})
    model["tied"] = torch.nn.Linear(8, 8, bias=False)
    model["tied"].weight = shared.weight
    model["c"].weight = torch.nn.Parameter(torch.load(tmp_path / "w.pt", weights_only=True)["w"])
    own_ptr, loaded_ptr = model["b"].weight.data_ptr(), model["c"].weight.data_ptr()
    assert own_file_backed(model) == 1  # the tied weight is one tensor, copied once
    assert model["tied"].weight is model["a"].weight and torch.equal(model["a"].weight, torch.full((8, 8), 0.5))
    assert model["a"].weight.data_ptr() != mapped.data_ptr() and model["a"].weight.untyped_storage().resizable()
    assert model["b"].weight.data_ptr() == own_ptr
    if os.path.exists("/proc/self/maps"):
        assert model["c"].weight.data_ptr() == loaded_ptr
    assert own_file_backed(model) == 0
