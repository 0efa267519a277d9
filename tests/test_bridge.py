"""Guards the bridge's promises: no ComfyUI import, model names confined to their folder, plain fallbacks."""
import subprocess
import sys

import pytest

from leandiffusion import bridge


def test_import_pack_does_not_import_comfy():
    code = "import leandiffusion, sys; bad=[m for m in ('comfy','folder_paths','server','nodes') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    (tmp_path / "checkpoints" / "sub").mkdir(parents=True)
    (tmp_path / "checkpoints" / "a.safetensors").write_bytes(b"x")
    (tmp_path / "checkpoints" / "sub" / "b.safetensors").write_bytes(b"x")
    (tmp_path / "checkpoints" / "notes.txt").write_text("x")
    (tmp_path / "secret.safetensors").write_bytes(b"x")
    monkeypatch.setenv(bridge.MODELS_ENV, str(tmp_path))
    return tmp_path


def test_list_models_filters_extension(models_dir):
    assert bridge.list_models("checkpoints") == ["a.safetensors", "sub/b.safetensors"]


def test_resolve_inside_folder(models_dir):
    assert bridge.resolve_model("checkpoints", "sub/b.safetensors") == (models_dir / "checkpoints/sub/b.safetensors").resolve()


@pytest.mark.parametrize("name", ["../secret.safetensors", "sub/../../secret.safetensors"])
def test_resolve_refuses_parent_escape(models_dir, name):
    with pytest.raises(ValueError, match="outside"):
        bridge.resolve_model("checkpoints", name, input_name="model")


def test_resolve_refuses_absolute_path(models_dir):
    with pytest.raises(ValueError, match="outside"):
        bridge.resolve_model("checkpoints", str(models_dir / "secret.safetensors"))


@pytest.fixture
def linked_models(models_dir, tmp_path_factory):
    """Model folders as users link them (ComfyUI follows links: ``folder_paths`` walks with ``followlinks=True``
    and ``get_full_path`` joins without resolving): a checkpoint file linked from elsewhere, a linked sub-folder
    of checkpoints, a linked diffusers folder (e.g. a Hugging Face cache snapshot) and a link cycle."""
    shared = tmp_path_factory.mktemp("shared")
    (shared / "big.safetensors").write_bytes(b"x")
    (shared / "lib" / "deep").mkdir(parents=True)
    (shared / "lib" / "c.safetensors").write_bytes(b"x")
    (shared / "lib" / "deep" / "d.safetensors").write_bytes(b"x")
    (shared / "snapshot").mkdir()
    (shared / "snapshot" / "model_index.json").write_text("{}")
    ckpt = models_dir / "checkpoints"
    (ckpt / "big.safetensors").symlink_to(shared / "big.safetensors")
    (ckpt / "shared").symlink_to(shared / "lib", target_is_directory=True)
    (ckpt / "sub" / "loop").symlink_to(ckpt, target_is_directory=True)  # a cycle must not hang the listing
    (ckpt / "dangling.safetensors").symlink_to(shared / "gone.safetensors")
    (models_dir / "diffusers").mkdir()
    (models_dir / "diffusers" / "sdxl").symlink_to(shared / "snapshot", target_is_directory=True)
    return models_dir, shared


def test_list_models_follows_links_like_comfyui(linked_models):
    # bug: files under a linked sub-folder were missing from the menus (pathlib's rglob does not enter links)
    assert bridge.list_models("checkpoints") == ["a.safetensors", "big.safetensors", "shared/c.safetensors",
                                                 "shared/deep/d.safetensors", "sub/b.safetensors"]
    assert bridge.list_models("diffusers", marker="model_index.json") == ["sdxl"]


@pytest.mark.parametrize("folder,name,target", [
    ("checkpoints", "big.safetensors", "big.safetensors"),
    ("checkpoints", "shared/deep/d.safetensors", "lib/deep/d.safetensors"),
    ("diffusers", "sdxl", "snapshot"),
])
def test_resolve_follows_links_the_menu_lists(linked_models, folder, name, target):
    # bug: a linked model was listed in the node's menu, then refused as "not found" when the node ran
    _, shared = linked_models
    assert bridge.resolve_model(folder, name, "model") == (shared / target).resolve()


def test_resolve_still_refuses_name_escapes_with_links_present(linked_models):
    # following links the user placed never lets a *name* leave the folder
    with pytest.raises(ValueError, match="outside"):
        bridge.resolve_model("checkpoints", "shared/../../secret.safetensors", "model")
    with pytest.raises(ValueError, match="dangling.safetensors.*not found"):
        bridge.resolve_model("checkpoints", "dangling.safetensors", "model")


@pytest.mark.parametrize("name", ["C:x.safetensors", "c:/x.safetensors", "\\x.safetensors",
                                  "\\\\server\\share\\x.safetensors", "sub\\..\\..\\secret.safetensors",
                                  "//server/share/x.safetensors"])
def test_resolve_refuses_windows_escapes_on_every_os(models_dir, name):
    """A model name comes from outside (a saved workflow, an API prompt) and may reach a Windows ComfyUI: a drive
    (``C:x``), a drive's root (``\\x``), a share or a backslash ``..`` leaves the folder there, though POSIX reads each
    as a plain name. Files so named exist here, so a POSIX-only check would resolve them instead of refusing."""
    for literal in ("C:x.safetensors", "\\x.safetensors"):
        (models_dir / "checkpoints" / literal).write_bytes(b"x")
    with pytest.raises(ValueError, match=r"^model='.+' points outside the 'checkpoints' model folder; give a name "
                                         r"relative to that folder"):
        bridge.resolve_model("checkpoints", name, "model")


@pytest.mark.parametrize("name", ["x" * 5000 + ".safetensors", "a/" * 600 + "b.safetensors",
                                  "\u00e9" * 128 + ".safetensors"])
def test_resolve_refuses_over_long_names_naming_the_input(models_dir, name):
    """A name longer than a file system allows (a 5000-character part, 1200 characters of short parts, a part of 128
    two-byte characters: 256 bytes) is one ``ValueError`` naming the input, not the OS's bare ``OSError: File name too
    long``; the message shows the start of the name and its length, not all of it."""
    with pytest.raises(ValueError, match=r"^model='.+ is longer than a model file name can be \(at most 255 bytes a "
                                         r"path part, 1024 characters in all\); pick a name from the node's menu$") as err:
        bridge.resolve_model("checkpoints", name, "model")
    assert len(str(err.value)) < 300
    assert bridge.model_fingerprint("checkpoints", name) == name  # IS_CHANGED never raises


def test_resolve_missing_names_folder(models_dir):
    with pytest.raises(ValueError, match="missing.safetensors.*checkpoints"):
        bridge.resolve_model("checkpoints", "missing.safetensors")


@pytest.mark.parametrize("name", ["", "   ", None])
def test_resolve_refuses_an_empty_name(models_dir, name):
    """An empty or missing model name is refused naming the input and the folder."""
    with pytest.raises(ValueError, match=rf"lora_name: expected a model name from the 'loras' folder, got {name!r}"):
        bridge.resolve_model("loras", name, "lora_name")


def test_resolve_without_a_models_folder_says_how_to_configure_one(monkeypatch):
    """Outside ComfyUI without LEANDIFFUSION_MODELS."""
    monkeypatch.delenv(bridge.MODELS_ENV, raising=False)
    with pytest.raises(ValueError, match=r"model='m.safetensors': no 'checkpoints' model folder is configured; inside "
                                         r"ComfyUI put the file in models/checkpoints/, outside ComfyUI set "
                                         r"LEANDIFFUSION_MODELS to a folder that has a 'checkpoints' sub-folder"):
        bridge.resolve_model("checkpoints", "m.safetensors", "model")


def test_plain_fallbacks_outside_comfyui():
    bridge.check_interrupted()  # no-op
    with bridge.ProgressBar(3, quiet=True) as bar:
        bar.update(3)
    assert bridge.comfy_tokenizer_dir() is None


def test_progress_bar_set_moves_comfyuis_bar_to_a_new_total(monkeypatch):
    """``set`` (an upscale that re-plans its tiles after an out-of-memory error) reaches ComfyUI's bar as one
    ``update_absolute(value, total)``, so the editor shows the new total; the tqdm bar outside ComfyUI follows too."""
    import sys
    import types

    calls = []

    class ComfyBar:
        def __init__(self, total):
            calls.append(("init", total))

        def update(self, n):
            calls.append(("update", n))

        def update_absolute(self, value, total=None):
            calls.append(("absolute", value, total))

    utils = types.ModuleType("comfy.utils")
    utils.ProgressBar = ComfyBar
    comfy = types.ModuleType("comfy")
    comfy.utils = utils
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.utils", utils)
    with bridge.ProgressBar(3, quiet=True) as bar:
        bar.update(1)
        bar.set(1, 12)
        bar.update(1)
    assert calls == [("init", 3), ("update", 1), ("absolute", 1, 12), ("update", 1)] and bar.total == 12
    monkeypatch.delitem(sys.modules, "comfy")
    with bridge.ProgressBar(3, quiet=False) as plain:  # tqdm (it counts nothing here: no terminal)
        plain.update(2)
        plain.set(1, 12)
        assert plain._tqdm.total == 12 and plain.total == 12


class _FakeModelManagement:
    def __init__(self, device):
        self.device = device

    def get_torch_device(self):
        return self.device

    def throw_exception_if_processing_interrupted(self):
        pass

    def free_memory(self, *args, **kwargs):
        pass

    def soft_empty_cache(self):
        pass


@pytest.mark.parametrize("comfy_device,cuda,want,warns", [
    ("cpu", True, "cpu", False),     # ComfyUI started with --cpu on a GPU machine: the pack stays on the CPU
    ("mps", False, "cpu", True),     # Apple silicon: not supported, CPU with a warning
    ("xpu", True, "cpu", True),
])
def test_default_device_follows_comfyuis_device(monkeypatch, caplog, comfy_device, cuda, want, warns):
    import logging

    import torch

    fake = _FakeModelManagement(torch.device(comfy_device))
    monkeypatch.setattr(bridge, "_comfy_module", lambda name: fake if name == "comfy.model_management" else None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    with caplog.at_level(logging.WARNING, logger="leandiffusion.bridge"):
        assert bridge.default_device() == torch.device(want)
    assert any("CUDA) or the CPU" in r.getMessage() for r in caplog.records) == warns


def test_loader_and_upscaler_follow_comfyuis_cpu_mode(monkeypatch):
    """With ComfyUI on the CPU the loader's engine and the upscaler's ``auto`` device are the CPU, even where torch
    sees a GPU (they used to pick CUDA whenever it was available)."""
    import torch

    from leandiffusion.memory.load import load_engine
    from leandiffusion.upscale.options import choose_device

    fake = _FakeModelManagement(torch.device("cpu"))
    monkeypatch.setattr(bridge, "_comfy_module", lambda name: fake if name == "comfy.model_management" else None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine; nothing may touch it
    monkeypatch.setattr(torch.cuda, "current_device", lambda: (_ for _ in ()).throw(AssertionError("touched CUDA")))
    assert choose_device("auto", upscaler=None) == torch.device("cpu")
    engine = load_engine("tiny-random (test)", "full", 4.0, "auto", "auto")
    assert engine.device == torch.device("cpu")


# ------------------------------------------------------------------ ComfyUI hooks, each call recorded
class _RecordingModelManagement(_FakeModelManagement):
    """ComfyUI's model_management as the bridge calls it: every call recorded."""

    def __init__(self, device="cpu", interrupted=False, free_fails=False):
        super().__init__(device)
        self.calls, self.interrupted, self.free_fails = [], interrupted, free_fails

    def throw_exception_if_processing_interrupted(self):
        self.calls.append("interrupt check")
        if self.interrupted:
            raise bridge.Interrupted("cancelled in ComfyUI")

    def free_memory(self, *args, **kwargs):
        self.calls.append(("free_memory", args, kwargs))
        if self.free_fails:
            raise AttributeError("an internal that moved between ComfyUI versions")

    def soft_empty_cache(self):
        self.calls.append("soft_empty_cache")

    def load_models_gpu(self, models, **kwargs):
        self.calls.append(("load_models_gpu", models, kwargs))


def _inside_comfy(monkeypatch, mm):
    monkeypatch.setattr(bridge, "_comfy_module", lambda name: mm if name == "comfy.model_management" else None)


def test_cancel_in_comfyui_reaches_every_interruption_check(monkeypatch):
    """Inside ComfyUI, ``check_interrupted`` is ComfyUI's own check, so Cancel stops the pack's loops (the test hook
    alone was exercised: dropping ComfyUI's check passed every CPU test)."""
    mm = _RecordingModelManagement()
    _inside_comfy(monkeypatch, mm)
    bridge.check_interrupted()
    assert mm.calls == ["interrupt check"]
    mm.interrupted = True
    with pytest.raises(bridge.Interrupted, match="cancelled in ComfyUI"):
        bridge.check_interrupted()


def test_memory_hooks_reach_comfyuis_manager(monkeypatch, caplog):
    """``free_comfy_memory`` asks for the bytes on the device and only logs a failure of ComfyUI's internals (best
    effort); ``soft_empty_cache`` is ComfyUI's; ``load_comfy_model`` passes the memory the caller needs."""
    import logging

    mm = _RecordingModelManagement()
    _inside_comfy(monkeypatch, mm)
    bridge.free_comfy_memory(1234.0, "cuda:0")
    bridge.soft_empty_cache()
    patcher = object()
    bridge.load_comfy_model(patcher, memory_required=5678.9)
    assert mm.calls == [("free_memory", (1234, "cuda:0"), {}), "soft_empty_cache",
                        ("load_models_gpu", [patcher], {"memory_required": 5678})]
    mm.free_fails = True
    with caplog.at_level(logging.WARNING, logger="leandiffusion.bridge"):
        bridge.free_comfy_memory(10, "cuda:0")  # does not raise
    assert any("ComfyUI could not free 10 bytes on cuda:0: an internal that moved" in r.getMessage()
               for r in caplog.records)


def test_comfyuis_cuda_device_index_is_kept(monkeypatch):
    """ComfyUI started with ``--cuda-device``-style selection of ``cuda:1``: the pack uses that GPU, not the current
    one."""
    import torch

    _inside_comfy(monkeypatch, _RecordingModelManagement(torch.device("cuda", 1)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert bridge.default_device() == torch.device("cuda", 1)
    _inside_comfy(monkeypatch, _RecordingModelManagement(torch.device("cuda")))
    assert bridge.default_device() == torch.device("cuda", 0)  # no index: the current device


def test_tokenizer_dir_only_when_comfyuis_vocab_is_there(monkeypatch, tmp_path):
    mm = _RecordingModelManagement()
    mm.__file__ = str(tmp_path / "comfy" / "model_management.py")
    _inside_comfy(monkeypatch, mm)
    (tmp_path / "comfy" / "sd1_tokenizer").mkdir(parents=True)
    assert bridge.comfy_tokenizer_dir() is None  # the folder without its vocab.json
    (tmp_path / "comfy" / "sd1_tokenizer" / "vocab.json").write_text("{}")
    assert bridge.comfy_tokenizer_dir() == (tmp_path / "comfy" / "sd1_tokenizer").resolve()


def test_a_folder_comfyui_does_not_know_is_an_unconfigured_folder(monkeypatch, tmp_path):
    """Inside ComfyUI, ``folder_paths.get_folder_paths`` raises ``KeyError`` for a folder name it has no entry for
    (an old ComfyUI without ``upscale_models``, say): the menu is empty and a name gets the "no folder configured"
    error, not a bare KeyError."""
    import types

    fp = types.ModuleType("folder_paths")

    def get_folder_paths(folder):
        raise KeyError(folder)

    fp.get_folder_paths = get_folder_paths
    monkeypatch.setitem(sys.modules, "folder_paths", fp)
    assert bridge.list_models("upscale_models") == []
    with pytest.raises(ValueError, match=r"no 'upscale_models' model folder is configured"):
        bridge.resolve_model("upscale_models", "x4.pth")


def test_a_model_index_at_the_top_of_the_diffusers_folder_is_not_a_model(models_dir):
    """Diffusers models are sub-folders holding ``model_index.json``; one lying in the folder itself is not listed
    (it would be the model '.')."""
    (models_dir / "diffusers" / "m").mkdir(parents=True)
    (models_dir / "diffusers" / "model_index.json").write_text("{}")
    (models_dir / "diffusers" / "m" / "model_index.json").write_text("{}")
    assert bridge.list_models("diffusers", marker="model_index.json") == ["m"]


def test_an_importable_but_unloaded_comfyui_is_left_alone(monkeypatch, tmp_path):
    """A process that could import ComfyUI (its folder on ``sys.path``) but has not loaded it stays plain: the bridge
    looks ComfyUI up in ``sys.modules`` and never imports it itself."""
    (tmp_path / "comfy").mkdir()
    (tmp_path / "comfy" / "__init__.py").write_text("")
    (tmp_path / "comfy" / "utils.py").write_text("raise AssertionError('the bridge imported comfy.utils')\n")
    (tmp_path / "comfy" / "model_management.py").write_text("raise AssertionError('imported model_management')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("comfy", "comfy.utils", "comfy.model_management"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with bridge.ProgressBar(2, quiet=True) as bar:
        bar.update(1)
    bridge.check_interrupted()
    assert "comfy" not in sys.modules and "comfy.utils" not in sys.modules


def test_fingerprint_tells_apart_files_that_differ_only_in_inode(models_dir, monkeypatch):
    """A replacement that lands within one tick of the kernel's coarse clock keeps ctime as well as size and mtime; only
    the inode then tells the files apart (any real replacement in a test also changes ctime, so only a faked stat sees a
    digest without the inode). The stat is faked here."""
    import os
    from pathlib import Path

    real_stat = Path.stat
    inode = [111]

    def stat(self, *args, **kwargs):
        st = real_stat(self, *args, **kwargs)
        if self.name != "a.safetensors":
            return st
        fields = list(st)
        fields[1] = inode[0]  # st_ino; st_mtime_ns / st_ctime_ns / st_size come from the same real file
        return os.stat_result(fields, {"st_mtime_ns": st.st_mtime_ns, "st_ctime_ns": st.st_ctime_ns})

    monkeypatch.setattr(Path, "stat", stat)
    first = bridge.model_fingerprint("checkpoints", "a.safetensors")
    assert bridge.model_fingerprint("checkpoints", "a.safetensors") == first
    inode[0] = 222
    assert bridge.model_fingerprint("checkpoints", "a.safetensors") != first


def test_qwen_tokenizer_dir_is_comfyuis_qwen25_folder(monkeypatch, tmp_path):
    """Split Z-Image files carry no tokenizer; inside ComfyUI its bundled Qwen files serve (Qwen3 shares Qwen2.5's
    vocabulary). Outside ComfyUI, or without the files, there is none."""
    assert bridge.comfy_qwen_tokenizer_dir() is None
    mm = _RecordingModelManagement()
    mm.__file__ = str(tmp_path / "comfy" / "model_management.py")
    _inside_comfy(monkeypatch, mm)
    folder = tmp_path / "comfy" / "text_encoders" / "qwen25_tokenizer"
    folder.mkdir(parents=True)
    assert bridge.comfy_qwen_tokenizer_dir() is None
    (folder / "vocab.json").write_text("{}")
    assert bridge.comfy_qwen_tokenizer_dir() == folder.resolve()


def test_split_folders_include_their_older_names(tmp_path, monkeypatch):
    """ComfyUI lists ``diffusion_models`` with ``unet`` and ``text_encoders`` with ``clip`` (``map_legacy``); outside
    ComfyUI both sub-folders of ``LEANDIFFUSION_MODELS`` count too, and a name resolves in either."""
    import types

    for folder in ("diffusion_models", "unet", "text_encoders", "clip"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / f"{folder}.safetensors").write_bytes(b"x")
    monkeypatch.setenv(bridge.MODELS_ENV, str(tmp_path))
    assert bridge.list_models("diffusion_models") == ["diffusion_models.safetensors", "unet.safetensors"]
    assert bridge.list_models("text_encoders") == ["clip.safetensors", "text_encoders.safetensors"]
    assert bridge.resolve_model("text_encoders", "clip.safetensors") == (tmp_path / "clip" / "clip.safetensors").resolve()
    fp = types.ModuleType("folder_paths")  # ComfyUI answers both names with the same two folders
    both = [str(tmp_path / "unet"), str(tmp_path / "diffusion_models")]
    fp.get_folder_paths = lambda name: {"unet": both, "diffusion_models": both}[name]
    monkeypatch.setitem(sys.modules, "folder_paths", fp)
    assert bridge._folder_roots("diffusion_models") == [tmp_path / "unet", tmp_path / "diffusion_models"]
    assert bridge.list_models("diffusion_models") == ["diffusion_models.safetensors", "unet.safetensors"]


def test_input_directory_is_comfyuis_inside_comfyui_else_the_variable(monkeypatch, tmp_path):
    """The Stream Edit Sampler's ``folder`` resolves inside Load Image's folder: ComfyUI's, or outside ComfyUI
    ``$LEANDIFFUSION_INPUT`` (``None`` when unset, so the node can say what to set)."""
    import types

    monkeypatch.delenv("LEANDIFFUSION_INPUT", raising=False)
    monkeypatch.delitem(sys.modules, "folder_paths", raising=False)
    assert bridge.input_directory() is None
    monkeypatch.setenv("LEANDIFFUSION_INPUT", str(tmp_path / "outside"))
    assert bridge.input_directory() == tmp_path / "outside"
    fp = types.ModuleType("folder_paths")
    fp.get_input_directory = lambda: str(tmp_path / "comfy_input")
    monkeypatch.setitem(sys.modules, "folder_paths", fp)
    assert bridge.input_directory() == tmp_path / "comfy_input"
