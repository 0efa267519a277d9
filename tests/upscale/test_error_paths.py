"""ESRGAN Upscale node error paths (each test names the failure it guards).

Guards: inputs that need no model (the image's type, shape and 0..1 range, the numbers, the device and precision
choices) are refused before the model file is read (the node read and built the upscaler first, then refused a bad
tile size; a [1, 0, 0, 3] IMAGE died in torch; 0..255 pixels were upscaled silently); the ncnn
converter CLI reports a failed write in one line and leaves no file behind;
weights holding NaN/inf are refused by name; a file of another kind (checkpoint, LoRA, VAE, ...) is named with
the folder it belongs in; an unknown file says whether spandrel was asked; the converter refuses an output name
the node would not read and says that a .pth needs no conversion.
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
    (torch.rand(1, 0, 0, 3), {}, r"image: shape \(1, 0, 0, 3\) has no pixels"),  # was a raw RuntimeError
    (torch.rand(1, 16, 0, 3), {}, r"image: shape \(1, 16, 0, 3\) has no pixels"),
    (IMAGE * 255, {}, r"image: values range over .*\.\.2\d\d\.\d*, but a ComfyUI IMAGE holds 0\.\.1; divide"),
    (IMAGE - 2, {}, r"image: values range over -\d.*but a ComfyUI IMAGE holds 0\.\.1"),  # was upscaled silently
    (IMAGE.to(torch.complex64), {}, r"image: expected a float tensor"),
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
    """Some spandrel architectures (inside ComfyUI) run in fp32 only."""
    from dataclasses import replace

    from leandiffusion.tests.upscale import helpers as H
    from leandiffusion.upscale.loader import build_upscaler
    from leandiffusion.upscale.runner import upscale_images

    up = replace(build_upscaler(H.random_rrdb()), **{flag: False})
    with pytest.raises(ValueError, match=match):
        upscale_images(up, IMAGE, device="cpu", precision=precision, quiet=True)
    assert upscale_images(up, IMAGE, device="cpu", precision="fp32", quiet=True).shape == (1, 64, 64, 3)


@pytest.mark.parametrize("value,dtype,found", [(float("nan"), torch.float32, "1 NaN and 0 infinite"),
                                                (float("inf"), torch.float16, "0 NaN and 1 infinite")])
def test_weights_with_nan_or_inf_are_refused_by_name(tmp_path, value, dtype, found):
    """An upscaler file holding a NaN or infinite weight (a diverged training run, an fp16 conversion that
    overflowed) would turn every upscaled image NaN, which Save Image writes black; like a LoRA file with such
    tensors it is refused, naming the file and the tensor."""
    from safetensors.torch import save_file

    from leandiffusion.tests.upscale import helpers as H
    from leandiffusion.upscale.loader import load_upscaler

    sd = {k: v.to(dtype) for k, v in H.random_rrdb().items()}
    sd["body.1.rdb2.conv3.weight"][0, 0, 1, 1] = value
    path = tmp_path / "broken_x4.safetensors"
    save_file(sd, str(path))
    with pytest.raises(ValueError, match=rf"upscaler file {path}: 1 tensors hold NaN or infinite values "
                                         rf"\(body.1.rdb2.conv3.weight has {found} of 576 values\); they would turn "
                                         r"every upscaled image NaN \(black\) or noise; the file is corrupt .*: "
                                         r"download the model again or use another one"):
        load_upscaler(path)


_SD1 = {"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(4, 4, 3, 3),
        "first_stage_model.decoder.conv_in.weight": torch.zeros(4, 4, 3, 3)}


@pytest.mark.parametrize("sd,kind,folder", [
    (_SD1, "a Stable Diffusion checkpoint", "checkpoints"),
    ({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(4, 8)}, "a LoRA", "loras"),
    ({"unet.down_blocks.0.attentions.0.proj_in.lora_A.weight": torch.zeros(4, 8)}, "a LoRA", "loras"),
    ({"encoder.conv_in.weight": torch.zeros(4, 3, 3, 3), "decoder.conv_in.weight": torch.zeros(4, 4, 3, 3)},
     "a VAE", "vae"),
    ({"control_model.input_blocks.0.0.weight": torch.zeros(4, 4, 3, 3)}, "a ControlNet", "controlnet"),
    ({"text_model.embeddings.token_embedding.weight": torch.zeros(10, 4)}, "a text encoder", "text_encoders"),
    ({"clip_l": torch.zeros(2, 768), "clip_g": torch.zeros(2, 1280)}, "a textual-inversion embedding", "embeddings"),
])
def test_a_model_of_another_kind_is_named_with_its_folder(tmp_path, sd, kind, folder):
    """A checkpoint, LoRA, VAE ... saved into upscale_models was 'not a known upscaler (keys start [...])': the keys
    but not what the file is or what to do. Now the error says what it looks like and which models folder it
    belongs in."""
    from safetensors.torch import save_file

    from leandiffusion.upscale.loader import load_upscaler

    path = tmp_path / "4x_Something.safetensors"
    save_file(sd, str(path))
    with pytest.raises(ValueError, match=rf"{path}: not an upscaler: it looks like {kind} \(key '.*'\); move it to "
                                         rf"models/{folder} and choose an upscale model \(ESRGAN, Real-ESRGAN, ...\) "
                                         r"here"):
        load_upscaler(path)


def test_an_unknown_architecture_says_whether_spandrel_was_asked(monkeypatch):
    """The error for an unknown file always said 'plus every architecture spandrel knows when spandrel is installed
    (it is inside ComfyUI)', even inside ComfyUI where spandrel had just refused it. Now it says which happened."""
    import sys
    import types

    from leandiffusion.tests.kit.faults import refuse_import
    from leandiffusion.upscale.loader import build_upscaler

    sd = {"layers.0.residual_group.weight": torch.zeros(3, 3, 3, 3)}
    fake = types.ModuleType("spandrel")
    fake.__version__ = "0.4.2"
    fake.UnsupportedModelError = type("UnsupportedModelError", (Exception,), {})

    class Loader:
        def load_from_state_dict(self, sd):
            raise fake.UnsupportedModelError()

    fake.ModelLoader = Loader
    monkeypatch.setitem(sys.modules, "spandrel", fake)
    with pytest.raises(ValueError, match=r"x.pth: not a known upscaler \(keys start \['layers.0.residual_group.weight'"
                                         r"\]\); built in are ESRGAN/Real-ESRGAN RRDBNet and SRVGGNetCompact, and "
                                         r"spandrel 0.4.2 \(ComfyUI's upscale-model library\) does not know it "
                                         r"either, so ComfyUI's Load Upscale Model refuses it too"):
        build_upscaler(sd, source="x.pth")
    monkeypatch.delitem(sys.modules, "spandrel")
    refuse_import(monkeypatch, "spandrel")
    with pytest.raises(ValueError, match=r"and spandrel, which loads the other architectures \(SwinIR, HAT, DAT, "
                                         r"...\), is not installed in this Python \(it is inside ComfyUI\)"):
        build_upscaler(sd, source="x.pth")


@pytest.mark.parametrize("out_name", ["model.pth", "model"])
def test_converter_refuses_an_output_name_the_node_would_not_read(ncnn_dir, tmp_path, capsys, out_name):
    """The converter wrote safetensors bytes under any name: 'x.pth' was then listed by ESRGAN Upscale and refused
    as "not a torch weights file ... Re-download it", a name without extension was not listed at all. Now the CLI
    says to name the output *.safetensors, and writes nothing."""
    from leandiffusion.upscale import convert_ncnn

    rc = convert_ncnn.main([str(ncnn_dir / "REALESRGAN_ANIMAVIDEOV3_UP4X.param"), str(tmp_path / out_name)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: output {tmp_path / out_name}: the converter writes safetensors; name "
                                      f"the output file *.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_converter_given_an_upscaler_file_says_it_needs_no_conversion(tmp_path):
    """Given a .pth (a user converting a model that is already PyTorch), the converter said 'ncnn file x.bin does
    not exist'. Now it says the file is not an ncnn .param and needs no conversion."""
    from leandiffusion.upscale import convert_ncnn

    path = tmp_path / "4x-UltraSharp.pth"
    path.write_bytes(b"PK")
    with pytest.raises(ValueError, match=rf"{path}: not an ncnn .param file; .* \(a .pth or .safetensors upscaler "
                                         r"needs no conversion: put it in models/upscale_models\)"):
        convert_ncnn.convert(path)
