"""ESRGAN Upscale node error paths (session-13 audit; each test fails on the code before its fix).

Guards: inputs that need no model (the image's type, the numbers, the device and precision choices) are refused
before the model file is read (the node read and built the upscaler first, then refused a bad tile size); the ncnn
converter CLI reports a failed write in one line and leaves no file behind.
"""
import pytest
import torch

import leandiffusion.nodes.upscale as node_module
from leandiffusion.nodes.upscale import LeanESRGANUpscale

IMAGE = torch.rand(1, 16, 16, 3)


@pytest.mark.parametrize("image,kwargs,match", [
    (IMAGE, dict(tile_size=8), r"tile_size=8: use 0 \(automatic\) or 32..2048"),
    (IMAGE, dict(tile_overlap=-4), r"tile_overlap=-4: use 0..256"),
    (IMAGE, dict(output_scale=40.0), r"output_scale=40.0: use 0"),
    (IMAGE, dict(device="tpu"), r"device='tpu': expected one of"),
    (IMAGE, dict(precision="fp8"), r"precision='fp8': expected one of"),
    (torch.rand(0, 16, 16, 3), {}, r"image: the batch is empty"),
    ("not an image", {}, r"image: expected a float tensor"),
])
def test_inputs_needing_no_model_are_refused_before_the_file_is_read(monkeypatch, image, kwargs, match):
    read = []
    monkeypatch.setattr(node_module, "resolve_model", lambda folder, name, input_name: read.append(name) or name)
    monkeypatch.setattr(node_module, "load_upscaler", lambda path: read.append(path))
    args = dict(output_scale=0.0, device="cpu", tile_size=0, tile_overlap=32, precision="auto")
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        LeanESRGANUpscale().upscale(image, "model.safetensors", **args)
    assert read == [], "the model file was read before the inputs were checked"


def test_converter_cli_write_failure_is_one_line_and_leaves_nothing(ncnn_dir, tmp_path, capsys):
    """The ncnn converter's CLI reported a failed write (here: a folder where the output file should go) with a
    Python traceback; now one ``error:`` line and exit code 2, and no temporary file is left in the folder."""
    from leandiffusion.upscale import convert_ncnn

    out = tmp_path / "out.safetensors"
    out.mkdir()
    rc = convert_ncnn.main([str(ncnn_dir / "REALESRGAN_ANIMAVIDEOV3_UP4X.param"), str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: cannot write {out}: ") and "choose another output path" in err
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"] and not any(out.iterdir())


@pytest.mark.parametrize("flag,precision,match", [
    ("supports_half", "fp16", r"precision='fp16': ESRGAN does not run correctly in fp16; use 'bf16' or 'fp32'"),
    ("supports_bf16", "bf16", r"precision='bf16': ESRGAN does not run correctly in bf16; use 'fp32'"),
])
def test_a_precision_the_architecture_cannot_run_is_refused(flag, precision, match):
    """Some spandrel architectures (inside ComfyUI) run in fp32 only (session-14 audit: never run)."""
    from dataclasses import replace

    from leandiffusion.tests.upscale import helpers as H
    from leandiffusion.upscale.loader import build_upscaler
    from leandiffusion.upscale.runner import upscale_images

    up = replace(build_upscaler(H.random_rrdb()), **{flag: False})
    with pytest.raises(ValueError, match=match):
        upscale_images(up, IMAGE, device="cpu", precision=precision, quiet=True)
    assert upscale_images(up, IMAGE, device="cpu", precision="fp32", quiet=True).shape == (1, 64, 64, 3)
