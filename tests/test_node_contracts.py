"""Every pack node is a well-formed ComfyUI V1 node: category, description, tooltips on every input.

Guards GUIDE conventions 1 and 11 for all nodes at once, including ones added later.
"""
import math

import pytest

from leandiffusion import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

NODES = sorted(NODE_CLASS_MAPPINGS.items())


def test_mappings_consistent():
    assert set(NODE_DISPLAY_NAME_MAPPINGS) <= set(NODE_CLASS_MAPPINGS)


@pytest.mark.parametrize("node_id,cls", NODES, ids=[n for n, _ in NODES])
def test_node_declaration(node_id, cls):
    assert node_id in NODE_DISPLAY_NAME_MAPPINGS
    assert cls.CATEGORY.startswith("LeanDiffusion/")
    assert isinstance(cls.DESCRIPTION, str) and cls.DESCRIPTION
    assert callable(getattr(cls, cls.FUNCTION))
    assert len(cls.RETURN_TYPES) == len(getattr(cls, "RETURN_NAMES", cls.RETURN_TYPES))
    spec = cls.INPUT_TYPES()
    assert "required" in spec
    for section in ("required", "optional"):
        for name, decl in spec.get(section, {}).items():
            assert isinstance(decl, tuple) and 1 <= len(decl) <= 2, name
            opts = decl[1] if len(decl) == 2 else {}
            assert opts.get("tooltip"), f"{node_id}.{name} has no tooltip"


@pytest.mark.parametrize("node_id,cls", NODES, ids=[n for n, _ in NODES])
def test_every_output_has_a_tooltip(node_id, cls):
    """ComfyUI shows OUTPUT_TOOLTIPS on hover over an output slot (a real ComfyUI's /object_info lists them): every
    node has one per output."""
    tips = getattr(cls, "OUTPUT_TOOLTIPS", None)
    assert isinstance(tips, tuple) and len(tips) == len(cls.RETURN_TYPES), f"{node_id}: OUTPUT_TOOLTIPS"
    assert all(isinstance(t, str) and t.strip() for t in tips), f"{node_id}: empty output tooltip"


@pytest.mark.parametrize("node_id,op,other", [("LeanTiledVAEDecode", "decode", "encode"),
                                              ("LeanTiledVAEEncode", "encode", "decode")])
def test_tiled_vae_tooltips_speak_of_their_own_direction(node_id, op, other):
    """The two tiled VAE nodes share their tiling widgets; the encoder's ``seam_mode`` tooltip said "decode"."""
    spec = NODE_CLASS_MAPPINGS[node_id].INPUT_TYPES()
    tips = {name: decl[1]["tooltip"] for section in spec.values() for name, decl in section.items()}
    assert f"untiled {op}" in tips["seam_mode"]
    wrong = {name: tip for name, tip in tips.items() if other in tip.lower()}
    assert not wrong, f"{node_id}: tooltips that speak of the other direction ({other}): {wrong}"


# Node -> (file-backed input, model folder, a file name in it). ComfyUI caches node outputs by their inputs alone, so
# a model replaced on disk under the same name would not be picked up before the server restarted.
FILE_INPUTS = {"LeanLoraInjector": ("lora_name", "loras", "style.safetensors"),
               "LeanESRGANUpscale": ("model_name", "upscale_models", "x4.pth"),
               "LeanModelLoader": ("model", "checkpoints", "sd15.safetensors")}


@pytest.mark.parametrize("node_id", sorted(FILE_INPUTS))
def test_file_backed_node_reruns_when_the_file_changes(node_id, tmp_path, monkeypatch):
    import os

    cls = NODE_CLASS_MAPPINGS[node_id]
    name, folder, filename = FILE_INPUTS[node_id]
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(tmp_path))
    path = tmp_path / folder / filename
    path.parent.mkdir(parents=True)
    path.write_bytes(b"first version")
    first = cls.IS_CHANGED(**{name: filename, "strength": 1.0})  # other widgets come along as keyword arguments
    assert cls.IS_CHANGED(**{name: filename}) == first, "unchanged file: the cached output must be reused"
    replacement = tmp_path / "new"
    replacement.write_bytes(b"second version, longer")
    os.replace(replacement, path)
    assert cls.IS_CHANGED(**{name: filename}) != first, f"{node_id}: a replaced {folder} file is not picked up"
    assert cls.IS_CHANGED(**{name: "missing.safetensors"}) == "missing.safetensors"  # never raises


def test_loader_fingerprint_of_tiny_model_and_diffusers_folder(tmp_path, monkeypatch):
    cls = NODE_CLASS_MAPPINGS["LeanModelLoader"]
    assert cls.IS_CHANGED(model="tiny-random (test)") == "tiny-random (test)"
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(tmp_path))
    unet = tmp_path / "diffusers" / "my_model" / "unet"
    unet.mkdir(parents=True)
    (unet.parent / "model_index.json").write_text("{}")
    (unet / "diffusion_pytorch_model.safetensors").write_bytes(b"v1")
    first = cls.IS_CHANGED(model="my_model")
    (unet / "diffusion_pytorch_model.safetensors").write_bytes(b"v2 with more bytes")
    assert cls.IS_CHANGED(model="my_model") != first


def test_stream_decode_tile_size_error_names_the_input():
    """The Stream Scheduler Sampler names a too-small decode_tile_size by its own input name, not as 'tile_size=64',
    an input it does not have."""
    from leandiffusion.sampling.stream.settings import StreamSettings

    with pytest.raises(ValueError, match=r"^decode_tile_size=64 is below the minimum 128 px; use 0 \(auto\)"):
        StreamSettings.from_text("a cube", decode_tile_size=64).validated()


def _number_inputs():
    for node_id, cls in NODES:
        for section in ("required", "optional"):
            for name, decl in cls.INPUT_TYPES().get(section, {}).items():
                if decl[0] in ("INT", "FLOAT"):
                    yield f"{node_id}.{name}", decl[0], decl[1]


@pytest.mark.parametrize("where, kind, opts", list(_number_inputs()), ids=[w for w, _, _ in _number_inputs()])
def test_number_inputs_fit_the_editor_widgets(where, kind, opts):
    """ComfyUI's editor (frontend 1.27 ``useIntWidget`` / ``useFloatWidget``) gives a number input without ``min`` /
    ``max`` the limits 0 and 2048, shows and rounds a FLOAT to the decimals of its step's magnitude
    (``-floor(log10(step))``, step 0.5 when none is declared), and snaps an INT to ``min % step + k * step``. A step
    or default those cannot hold changes under the user's hands: the loader's vram_budget_gb step of 0.25 made the
    arrows go 4 -> 4.3 -> 4.5 -> 4.8 (seen in the real editor, tests/integration/test_frontend.py)."""
    assert "min" in opts and "max" in opts, f"{where}: declare min and max (the editor assumes 0 and 2048)"
    step, default = opts.get("step", 1), opts["default"]
    assert opts["min"] <= default <= opts["max"], where
    if kind == "FLOAT":
        assert "step" in opts, f"{where}: declare a step (the editor assumes 0.5)"
        decimals = max(0, -math.floor(math.log10(step)))
        assert round(step, decimals) == step, f"{where}: step {step} needs more than the {decimals} decimals shown"
        assert round(default, decimals) == default, f"{where}: default {default} is shown with {decimals} decimals"
    else:
        assert (default - opts["min"] % step) % step == 0, f"{where}: default {default} is off the step grid"


def test_a_node_id_declared_by_two_modules_fails_the_import(monkeypatch):
    """Node IDs are what saved workflows reference, so a second module declaring one is an import-time error, not a
    silent override. The registry is re-run with one stand-in module that re-declares ``LeanModelLoader``, then
    restored."""
    import importlib
    import pkgutil
    import sys
    import types

    import leandiffusion.nodes as registry

    before = dict(registry.NODE_CLASS_MAPPINGS)
    clash = types.ModuleType("leandiffusion.nodes.zz_clash")
    clash.NODE_CLASS_MAPPINGS = {"LeanModelLoader": object}
    real = pkgutil.iter_modules
    try:
        with monkeypatch.context() as m:
            m.setitem(sys.modules, clash.__name__, clash)
            m.setattr(pkgutil, "iter_modules", lambda *a, **k: [*real(*a, **k), pkgutil.ModuleInfo(None, "zz_clash",
                                                                                                    False)])
            with pytest.raises(RuntimeError, match=r"node ID 'LeanModelLoader' is declared twice \(second time in "
                                                   r"leandiffusion\.nodes\.zz_clash\)"):
                importlib.reload(registry)
    finally:
        importlib.reload(registry)
    assert registry.NODE_CLASS_MAPPINGS == before
