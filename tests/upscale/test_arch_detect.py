"""Architectures and the declarative detector, on tiny random models in every key naming.

Guards: each naming (Real-ESRGAN, BSRGAN, original ESRGAN; pixel-unshuffle x2/x1; x8) is detected with the right
hyperparameters and computes what the published equations say (plain cat-based reference in helpers.py); the
RRDB tail strips and the dense-block buffer change nothing; .safetensors and .pth round trips; clear errors for
files that are not upscalers, are cut short, or carry code.
"""
import pickle

import pytest
import torch
from safetensors.torch import save_file

from leandiffusion.tests.upscale import helpers as H
from leandiffusion.upscale.detect import detect
from leandiffusion.upscale.loader import build_upscaler, load_upscaler

SPANDREL, WHY = H.import_spandrel()

RRDB_CASES = [  # (n_up, unshuffle, net scale)
    (2, 1, 4), (2, 2, 2), (2, 4, 1), (1, 1, 2), (3, 1, 8),
]


@pytest.mark.parametrize("n_up,unshuffle,scale", RRDB_CASES)
@pytest.mark.parametrize("naming", ["realesrgan", "bsrgan", "original"])
def test_rrdb_detect_and_forward(n_up, unshuffle, scale, naming):
    sd = H.random_rrdb(n_up=n_up, unshuffle=unshuffle)
    named = {"realesrgan": sd, "bsrgan": H.to_bsrgan_keys(sd), "original": H.to_original_keys(sd, n_up)}[naming]
    up = build_upscaler(named)
    assert up.arch == "ESRGAN" and up.scale == scale and up.multiple_of == unshuffle
    assert up.in_channels == 3 and up.out_channels == 3
    x = torch.rand(1, 3, 13, 10)  # odd sizes: the unshuffle variants pad by reflection like Real-ESRGAN
    with torch.inference_mode():
        ours = up.module(x)
    ref = H.ref_rrdb(sd, x, unshuffle)
    assert ours.shape == (1, 3, 13 * scale, 10 * scale)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_rrdb_tail_strips_are_exact():
    up = build_upscaler(H.random_rrdb(n_up=2))
    x = torch.rand(1, 3, 17, 9)
    with torch.inference_mode():
        whole = up.module(x)
        for rows in (1, 2, 5, 16):
            torch.testing.assert_close(up.module(x, tail_rows=rows), whole, atol=1e-6, rtol=0)


@pytest.mark.parametrize("unshuffle,n_up", [(1, 2), (2, 2), (4, 2), (1, 3)])
@pytest.mark.parametrize("feat,grow", [(64, 32), (32, 16)])
def test_rrdb_memory_estimate_covers_the_live_activations(unshuffle, n_up, feat, grow):
    """``work_bytes`` (what tile sizes come from) against the bytes of every tensor alive at once while the net runs
    a window through its own call (tail strips included), counted exactly on the meta device (tests/vae/live_bytes:
    what PyTorch's allocator would hold, without cuDNN workspaces). The estimate must cover the peak and not
    overstate it by more than half: a pixel-unshuffle net runs its body at 1/u^2 of the pixels, and an estimate
    without that factor (4x / 16x) shrank the automatic tiles of Real-ESRGAN x2 / x1 for nothing."""
    from leandiffusion.tests.vae.live_bytes import LiveBytes

    up = build_upscaler(H.random_rrdb(num_feat=feat, grow=grow, num_block=2, n_up=n_up, unshuffle=unshuffle))
    module = up.module.to("meta")
    for h, w in ((512, 384), (768, 768)):  # window sizes of real runs (smaller ones hit the 8-row tail floor)
        live = LiveBytes("meta", exclude=list(module.parameters()))
        estimate = up.work_bytes(h, w, torch.float32)
        with torch.inference_mode(), live:
            up.call(module, torch.empty(1, 3, h, w, device="meta"), estimate)
        assert live.peak <= estimate <= 1.5 * live.peak, (h, w, live.peak, estimate)


@pytest.mark.parametrize("scale,num_conv", [(4, 3), (2, 1), (3, 2), (1, 2)])
def test_compact_detect_and_forward(scale, num_conv):
    sd = H.random_compact(num_conv=num_conv, scale=scale)
    up = build_upscaler(sd)
    assert up.arch == "SRVGGNetCompact" and up.scale == scale and up.context == num_conv + 2
    x = torch.rand(1, 3, 11, 7)
    with torch.inference_mode():
        torch.testing.assert_close(up.module(x), H.ref_compact(sd, x), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(SPANDREL is None, reason=WHY or "spandrel")
@pytest.mark.parametrize("kind", ["rrdb_x4", "rrdb_x2", "compact"])
def test_matches_spandrel(kind):
    # spandrel hard-codes the growth channels to 32
    sd = {"rrdb_x4": lambda: H.random_rrdb(grow=32), "rrdb_x2": lambda: H.random_rrdb(grow=32, unshuffle=2),
          "compact": lambda: H.random_compact()}[kind]()
    ours = build_upscaler(sd)
    theirs = SPANDREL.ModelLoader().load_from_state_dict(sd).eval()
    assert theirs.scale == ours.scale
    x = torch.rand(1, 3, 12, 16)
    with torch.inference_mode():
        torch.testing.assert_close(ours.module(x).clamp(0, 1), theirs(x), atol=1e-5, rtol=1e-5)


def test_detection_is_by_keys_and_ordered():
    assert detect(H.random_compact()).name == "SRVGGNetCompact"
    assert detect(H.random_rrdb()).name.startswith("ESRGAN (Real-ESRGAN")
    assert detect(H.to_bsrgan_keys(H.random_rrdb())).name.startswith("ESRGAN (BSRGAN")
    plus = H.to_original_keys(H.random_rrdb(), 2)
    plus["model.1.sub.0.RDB1.conv1x1.weight"] = torch.zeros(4, 8, 1, 1)  # ESRGAN+ is not ours
    assert detect(plus) is None
    assert detect({"foo.weight": torch.zeros(1)}) is None


def _compact_odd_last(sd):
    last = max(int(k.split(".")[1]) for k in sd)
    sd[f"body.{last + 1}.weight"] = torch.ones(8)  # a trailing PReLU: the net ends on an activation
    return sd


def _compact_bad_scale(sd):
    last = max(int(k.split(".")[1]) for k in sd)
    sd[f"body.{last}.weight"] = sd[f"body.{last}.weight"][:40]  # 40 = 3 * 13.3: no square scale
    sd[f"body.{last}.bias"] = sd[f"body.{last}.bias"][:40]
    return sd


def _original_layout(extra_top):
    sd = H.to_original_keys(H.random_rrdb(n_up=2), 2)
    sd[f"model.{extra_top}.weight"] = torch.zeros(3)
    return sd


@pytest.mark.parametrize("sd,match", [  # state dicts that match an entry but do not load
    (_original_layout(99), r"looks like ESRGAN \(original keys\) but does not load: original-ESRGAN state dict: "
                           r"top-level layers model.\[3, 6, 8, 10, 99\] do not follow the ESRGAN layout"),
    ({**H.random_rrdb(), "conv_first.weight": torch.zeros(8, 3, 3)},
     r"looks like ESRGAN \(Real-ESRGAN keys\) but does not load: key 'conv_first.weight': expected a 4-D tensor, "
     r"got \(8, 3, 3\)"),
    (H.random_rrdb(n_up=0, unshuffle=2), r"looks like ESRGAN \(Real-ESRGAN keys\) but does not load: RRDBNet with 0 "
                                        r"upsampling layers and pixel-unshuffle 2 would downscale"),
    (_compact_odd_last(H.random_compact()), r"looks like SRVGGNetCompact but does not load: SRVGGNetCompact: last "
                                            r"body index 9 should be even"),
    (_compact_bad_scale(H.random_compact()), r"looks like SRVGGNetCompact but does not load: SRVGGNetCompact: last "
                                             r"conv has 40 outputs, not 3 x a square scale"),
])
def test_state_dicts_that_only_look_like_an_architecture_are_named(sd, match):
    with pytest.raises(ValueError, match=r"<state dict>: " + match):
        build_upscaler(sd)


@pytest.mark.parametrize("obj,match", [
    ([torch.zeros(2)], r"holds list, not a state dict of tensors; an upscaler file must be a"),
    ({}, r"holds dict, not a state dict of tensors"),
    ({"epoch": 3, "note": "x"}, r"the mapping holds no tensors, so it is not a model's weights"),
])
def test_files_without_weights_are_named(tmp_path, obj, match):
    path = tmp_path / "odd.pth"
    torch.save(obj, str(path))
    with pytest.raises(ValueError, match=rf"{path}: {match}"):
        load_upscaler(path)


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_file_round_trip_and_wrappers(tmp_path, suffix):
    sd = H.random_rrdb()
    path = tmp_path / f"m{suffix}"
    if suffix == ".safetensors":
        save_file(sd, str(path))
    else:
        torch.save({"params_ema": {f"module.{k}": v for k, v in sd.items()}}, path)
    up = load_upscaler(path)
    x = torch.rand(1, 3, 8, 8)
    with torch.inference_mode():
        torch.testing.assert_close(up.module(x), H.ref_rrdb(sd, x), atol=1e-5, rtol=1e-5)


def test_not_an_upscaler(tmp_path):
    path = tmp_path / "unet.safetensors"
    save_file({"down_blocks.0.resnets.0.conv1.weight": torch.zeros(4, 4, 3, 3)}, str(path))
    with pytest.raises(ValueError, match="not a known upscaler"):
        load_upscaler(path)


def test_wrong_shapes_are_refused():
    sd = H.random_rrdb()
    sd["body.1.rdb2.conv3.weight"] = torch.zeros(4, 7, 3, 3)
    with pytest.raises(ValueError, match="size mismatch"):
        build_upscaler(sd)
    sd = H.random_rrdb()
    del sd["body.0.rdb3.conv5.bias"]
    with pytest.raises(ValueError, match="missing keys"):
        build_upscaler(sd)


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_truncated_file(tmp_path, suffix):
    path = tmp_path / f"m{suffix}"
    sd = H.random_compact()
    save_file(sd, str(path)) if suffix == ".safetensors" else torch.save(sd, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated|cut short") as err:
        load_upscaler(path)
    assert path.name in str(err.value)


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_pickle_with_code_is_refused(tmp_path):
    path = tmp_path / "evil.pth"
    with open(path, "wb") as f:
        pickle.dump({"x": _Evil()}, f)
    with pytest.raises(ValueError, match="refused for safety|not a torch weights file") as err:
        load_upscaler(path)
    # one line, naming the file and the fix; none of torch's advice to load with weights_only=False
    message = str(err.value)
    assert "\n" not in message and "evil.pth" in message and ".safetensors" in message
    assert "weights_only" not in message


def test_missing_file_and_bad_extension(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_upscaler(tmp_path / "nope.pth")
    bad = tmp_path / "m.onnx"
    bad.write_bytes(b"x")
    with pytest.raises(ValueError, match="extension"):
        load_upscaler(bad)


def test_rrdb_batch_uses_concatenation_path():
    sd = H.random_rrdb()
    up = build_upscaler(sd)
    x = torch.rand(2, 3, 9, 7)
    with torch.inference_mode():
        torch.testing.assert_close(up.module(x), H.ref_rrdb(sd, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sd", [H.random_rrdb(), H.to_bsrgan_keys(H.random_rrdb()), H.random_compact(num_conv=2)],
                         ids=["rrdb", "rrdb-bsrgan", "compact"])
def test_building_leaves_the_global_generator_alone(sd):
    # Bug guarded: modules were built with PyTorch's random init, which advanced torch's global generator, so a
    # ComfyUI node drawing from it after an ESRGAN Upscale got different numbers than without one.
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    build_upscaler(sd)
    assert torch.equal(torch.rand(4), expected)


def test_spandrel_route_leaves_the_global_generator_alone(monkeypatch):
    # spandrel (present inside ComfyUI) builds its architectures with random init before loading the weights.
    import sys
    import types

    class Loader:
        def load_from_state_dict(self, sd):
            torch.nn.Conv2d(3, 3, 3)  # what a spandrel architecture's constructor does
            raise fake.UnsupportedModelError()

    fake = types.ModuleType("spandrel")
    fake.UnsupportedModelError = type("UnsupportedModelError", (Exception,), {})
    fake.ModelLoader = Loader
    monkeypatch.setitem(sys.modules, "spandrel", fake)
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    with pytest.raises(ValueError, match="not a known upscaler"):
        build_upscaler({"head.weight": torch.zeros(3, 3, 3, 3)})
    assert torch.equal(torch.rand(4), expected)


# --------------------------------------------------------------------------------------------- builder limits
@pytest.mark.parametrize("n_up, unshuffle", [(1, 4), (0, 2), (2, 3)])
def test_rrdb_refuses_an_unshuffle_its_upsampling_cannot_undo(n_up, unshuffle):
    """Net scale 2**n_up / u must be whole: (1, 4) would be a 1/2x net, which ``scale`` (an integer) would call 0x."""
    from leandiffusion.upscale.arch_rrdb import RRDBNet

    with pytest.raises(ValueError, match=f"unshuffle={unshuffle} with num_upsample={n_up}"):
        RRDBNet(num_feat=4, num_block=1, num_grow_ch=2, num_upsample=n_up, unshuffle=unshuffle)


def test_compact_refuses_different_in_and_out_channels():
    from leandiffusion.upscale.arch_compact import SRVGGNetCompact

    with pytest.raises(ValueError, match="num_out_ch=1 != num_in_ch=3"):
        SRVGGNetCompact(num_in_ch=3, num_out_ch=1, num_feat=4, num_conv=1)


def test_rrdb_keeps_a_channels_last_input_channels_last():
    """The ESRGAN descriptor says ``channels_last=True`` (every op keeps NHWC, so ``layout="auto"`` runs it NHWC):
    a dense block must not route an NHWC input through its NCHW buffer, which would turn the rest of the net NCHW."""
    sd = H.random_rrdb()
    up = build_upscaler(sd)
    assert up.channels_last
    x = torch.rand(1, 3, 9, 7)
    with torch.inference_mode():
        out = up.module(x.contiguous(memory_format=torch.channels_last))
        torch.testing.assert_close(out, H.ref_rrdb(sd, x), atol=1e-5, rtol=1e-5)
    assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()


@pytest.mark.parametrize("n, channels", [(1, 2 * 8 + 4 * 4), (2, 8 + 8 * 4)])
def test_dense_block_peak_activations(n, channels):
    """Live bytes of one dense block (F 8, G 4), counted on the meta device (tests/vae/live_bytes), its input not
    counted. Buffer path (one image): the [F + 4G] buffer plus conv5's F output. Concatenation path (a batch): at the
    last concatenation x1..x4 (4G) and their F + 4G concatenation; x1..x4 are dropped before conv5 runs (kept, they
    would add 4G while conv5's output is live: 2F + 8G)."""
    from leandiffusion.tests.vae.live_bytes import LiveBytes
    from leandiffusion.upscale.arch_rrdb import ResidualDenseBlock

    rdb = ResidualDenseBlock(8, 4).to("meta")
    live = LiveBytes("meta", exclude=list(rdb.parameters()))
    x = torch.empty(n, 8, 16, 16, device="meta")
    with torch.inference_mode(), live:
        rdb(x)
    assert live.peak <= channels * n * 16 * 16 * 4, live.peak / (n * 16 * 16 * 4)


def test_each_tail_strip_starts_after_the_previous_one_was_freed():
    """Tail strips bound the upsampling tail's memory only if a finished strip is freed before the next is computed:
    counted on the meta device, every strip starts with the same live bytes (features, output buffer)."""
    from leandiffusion.tests.vae.live_bytes import LiveBytes

    net = build_upscaler(H.random_rrdb(n_up=2)).module.to("meta")
    live = LiveBytes("meta", exclude=list(net.parameters()))
    entries, tail = [], net._tail
    net._tail = lambda feat: (entries.append(live.current()), tail(feat))[1]
    with torch.inference_mode(), live:
        net(torch.empty(1, 3, 40, 24, device="meta"), tail_rows=8)
    assert len(entries) == 5 and len(set(entries)) == 1, entries
