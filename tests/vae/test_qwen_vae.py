"""Tiled VAE Decode / Encode on Qwen-Image's VAE (issue 44): diffusers' ``AutoencoderKLQwenImage``, a Wan 2.1-style
causal 3D VAE (``[B, C, T, H, W]``, an image is one frame; RMS norms over channels; one-head mid-block attention).

Guards: ``vae/causal3d.py`` reads the module tree as the module computes one frame (causal convolutions as their last
time tap, resamplers without their temporal half, per-pixel norms, the ``to_qkv`` split), so ``exact`` tiled decode and
encode equal diffusers' own untiled ``decode`` / ``encode`` (the posterior mean, which is its mode, raw latent space:
the pack's LATENT convention) within 1e-4 in fp32 on the CPU, at tile sizes that do not divide the image, with device
or host stores, batches included; ``blend`` equals ``exact`` here (no GroupNorm statistics to estimate); the untiled
fast path (``vae.untiled``) takes the 4D LATENT / IMAGE too; a 4-channel SD latent is refused naming ``samples``.
The reference is always diffusers' module called on the 5D frame tensor, never the code under test.
"""
import copy

import pytest
import torch

from leandiffusion.memory.engine import parts_from_components
from leandiffusion.memory.load import build_engine
from leandiffusion.memory.tiny_qwen_image import build_tiny_qwen_image
from leandiffusion.nodes.vae import LeanTiledVAEDecode, LeanTiledVAEEncode
from leandiffusion.tests.kit import tiny_components
from leandiffusion.tests.vae.qwen_vae import tiny_qwen_vae, voice
from leandiffusion.vae.adapters import decoder_program, encoder_program
from leandiffusion.vae.causal3d import FrameConv, is_causal3d
from leandiffusion.vae.targets import from_module
from leandiffusion.vae.tiled import tiled_decode, tiled_encode
from leandiffusion.vae.untiled import vae_decode, vae_encode

TOL = 1e-4
# bytes: most stage outputs of these maps go to host stores, and the mid-block attention has too little for resident
# keys and values, so it runs in streamed bands (``attention_bands``)
HOST_STORES = 96 * 2 ** 10


def _image(x: torch.Tensor) -> torch.Tensor:
    return ((x.float() + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1)


def _diffusers_decode(vae, z):
    with torch.no_grad():
        return _image(vae.decode(z.unsqueeze(2)).sample[:, :, 0])


def _diffusers_encode(vae, pixels):
    with torch.no_grad():
        return vae.encode((pixels.permute(0, 3, 1, 2) * 2 - 1).unsqueeze(2)).latent_dist.mode()[:, :, 0]


@pytest.fixture(scope="module")
def vae():
    return tiny_qwen_vae()


@pytest.fixture(scope="module")
def latents():
    return torch.randn(2, 16, 19, 27, generator=torch.Generator().manual_seed(0))  # 152 x 216 px


@pytest.fixture(scope="module")
def decoded(vae, latents):
    ref = _diffusers_decode(vae, latents)
    assert ref.std().item() > 0.1 and 0.0 < ref.mean().item() < 1.0  # a picture with contrast, not a clamped one
    return ref


def test_the_programs_read_the_causal_vae_as_one_frame(vae):
    assert is_causal3d(vae) and not is_causal3d(tiny_components("sd1")["vae"])
    dec, enc = decoder_program(vae), encoder_program(vae)
    assert dec.factor == enc.factor == 8 and dec.latent_channels == enc.latent_channels == 16
    assert dec.in_channels == 16 and dec.out_channels == 3 and enc.in_channels == 3 and enc.out_channels == 32
    assert [op.module.conv for op in dec.stages[0].ops] == [vae.post_quant_conv, vae.decoder.conv_in]
    assert enc.stages[-1].ops[-1].module.conv is vae.quant_conv  # moments, mean first
    kinds = {op.kind for program in (dec, enc) for st in program.stages for op in st.ops}
    assert "gn" not in kinds and "rms" in kinds  # per-pixel norms: no statistics pass anywhere
    attention = [st for st in dec.stages if st.kind == "attention"]
    assert len(attention) == 1 and attention[0].attention.pointwise_norm and attention[0].first_groups is None


@pytest.mark.parametrize("kernel", [1, 3])
def test_a_frame_conv_is_the_causal_conv_on_one_frame(vae, kernel):
    conv = vae.decoder.conv_in if kernel == 3 else vae.post_quant_conv
    x = torch.randn(2, conv.in_channels, 7, 9, generator=torch.Generator().manual_seed(kernel))
    with torch.no_grad():
        assert (FrameConv(conv, "c")(x) - conv(x.unsqueeze(2))[:, :, 0]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("tile, budget", [(0, None), (128, None), (160, None), (128, HOST_STORES)],
                         ids=["one-band", "tile-128", "tile-160", "host-stores"])
def test_exact_decode_equals_diffusers_untiled(vae, latents, decoded, tile, budget):
    img = tiled_decode(from_module(vae), latents, tile, 32, "exact", budget_bytes=budget, quiet=True)
    assert img.shape == (2, 152, 216, 3) and img.dtype == torch.float32 and img.device.type == "cpu"
    assert (img - decoded).abs().max().item() <= TOL


def test_blend_decode_equals_exact_here(vae, latents, decoded):
    img = tiled_decode(from_module(vae), latents[:1], 128, 32, "blend", quiet=True)
    assert (img - decoded[:1]).abs().max().item() <= TOL


@pytest.mark.parametrize("tile, budget", [(0, None), (128, None), (160, HOST_STORES)],
                         ids=["one-band", "tile-128", "tile-160-host-stores"])
def test_exact_encode_equals_diffusers_untiled_mean(vae, tile, budget):
    pixels = torch.rand(2, 155, 219, 3, generator=torch.Generator().manual_seed(1))  # cropped to 152 x 216
    ref = _diffusers_encode(vae, pixels[:, 1:153, 1:217])
    assert ref.std().item() > 0.3
    lat = tiled_encode(from_module(vae), pixels, tile, 32, "exact", budget_bytes=budget, quiet=True)
    assert lat.shape == (2, 16, 19, 27) and lat.dtype == torch.float32
    assert (lat - ref).abs().max().item() <= TOL


@pytest.fixture(scope="module", params=["full", "lowvram"])
def engine(request):
    components = build_tiny_qwen_image(seed=0)
    voice(components["vae"])
    return build_engine(parts_from_components(components, name="tiny-qwen"), request.param, device="cpu")


def test_the_nodes_run_a_qwen_image_model(engine, latents):
    """Through the LEAN_MODEL: batch of 2, tiles that do not divide the image; both ends against diffusers and the
    engine's untiled fast path."""
    vae = engine.parts.vae
    ref = _diffusers_decode(vae, latents)
    with engine.session("vae"):
        fast = vae_decode(engine, latents)
    (img,) = LeanTiledVAEDecode().decode({"samples": latents}, 160, 64, "exact", lean_model=engine)
    assert img.shape == fast.shape == (2, 152, 216, 3)
    assert (fast - ref).abs().max().item() <= TOL and (img - ref).abs().max().item() <= TOL

    pixels = ref.flip(2)  # a decoded picture, mirrored: smooth regions and edges
    lat_ref = _diffusers_encode(vae, pixels)
    with engine.session("vae"):
        fast_lat = vae_encode(engine, pixels)
    (lat,) = LeanTiledVAEEncode().encode(pixels, 128, 64, "blend", lean_model=engine)
    assert lat["samples"].shape == fast_lat.shape == (2, 16, 19, 27)
    assert (fast_lat - lat_ref).abs().max().item() <= TOL and (lat["samples"] - lat_ref).abs().max().item() <= TOL


def test_an_sd_latent_into_the_qwen_vae_is_refused_by_name(engine):
    with pytest.raises(ValueError, match=r"samples has 4 channels but this VAE takes 16-channel latents \(a "
                                         r"4-channel LATENT comes from SD1\.x / SD2\.x / SDXL models\); decode it "
                                         r"with the VAE of the model that made it"):
        LeanTiledVAEDecode().decode({"samples": torch.randn(1, 4, 8, 8)}, 0, 64, "exact", lean_model=engine)


def test_a_time_strided_conv_is_refused_not_approximated(vae):
    broken = copy.deepcopy(vae)
    broken.decoder.conv_in.stride = (2, 1, 1)
    with pytest.raises(TypeError, match=r"unsupported causal 3D VAE convolution at decoder\.conv_in"):
        decoder_program(broken)


def test_encoder_attention_blocks_are_refused():
    """``attn_scales`` puts attention blocks into the encoder's down blocks, which diffusers' own ``encode`` cannot
    run (their forward takes no feature cache): no reference, so no approximation either."""
    vae = tiny_qwen_vae(seed=3, attn_scales=[0.5])
    with pytest.raises(TypeError, match=r"attention block in the encoder's down blocks at down_blocks\.\d+; this "
                                        r"VAE needs ComfyUI's own"):
        encoder_program(vae)
