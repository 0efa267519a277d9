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


def test_resolve_refuses_symlink_escape(models_dir):
    (models_dir / "checkpoints" / "link.safetensors").symlink_to(models_dir / "secret.safetensors")
    with pytest.raises(ValueError, match="not found"):
        bridge.resolve_model("checkpoints", "link.safetensors")


def test_resolve_missing_names_folder(models_dir):
    with pytest.raises(ValueError, match="missing.safetensors.*checkpoints"):
        bridge.resolve_model("checkpoints", "missing.safetensors")


def test_plain_fallbacks_outside_comfyui():
    bridge.check_interrupted()  # no-op
    with bridge.ProgressBar(3, quiet=True) as bar:
        bar.update(3)
    assert bridge.comfy_tokenizer_dir() is None
