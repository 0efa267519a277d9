"""``vae/adapters.py``: which autoencoders the exact tiling takes, and how it refuses the others.

Guards:
- every refusal names the module, what is unsupported and the fix (ComfyUI's own tiled nodes). Before: an
  unsupported activation gave no fix, a non-zero padding mode was reported as a plain "kernel (3, 3), stride
  (1, 1), padding (1, 1)" (nothing said what was wrong), an attention block without its GroupNorm was called
  "no residual" and no attention refusal said where the block was; encoder refusals named only the decode node;
- a ResNet ``output_scale_factor`` other than 1 is computed exactly (reference: diffusers' untiled fp64 decode);
- the engine's untiled fast path leaves an attention block it cannot run to its own processor: same output.
"""
import copy

import pytest
import torch
from torch import nn

from leandiffusion.vae import untiled
from leandiffusion.vae.targets import from_module
from leandiffusion.vae.tiled import tiled_decode, tiled_encode

FIX = r"; this VAE needs ComfyUI's own VAE Decode \(Tiled\) / VAE Encode \(Tiled\)$"


def _vae(seed=0, **kw):
    from diffusers import AutoencoderKL

    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    kw = {"up_block_types": ("UpDecoderBlock2D",) * 2, **kw}
    try:
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 32),
                            layers_per_block=1, norm_num_groups=32, down_block_types=("DownEncoderBlock2D",) * 2,
                            **kw)
    finally:
        torch.random.set_rng_state(state)
    return vae.eval().requires_grad_(False)


def _set(path, value):
    def change(vae):
        *owner, name = path.split(".")
        target = vae
        for part in owner:
            target = target[int(part)] if part.isdigit() else getattr(target, part)
        setattr(target, name, value)
    return change


RES = "decoder.up_blocks.0.resnets.0"


@pytest.mark.parametrize("change,match", [
    (_set(f"{RES}.nonlinearity", nn.GELU()),
     r"unsupported activation at up_blocks.0.resnets.0: GELU \(expected SiLU\)"),
    (_set(f"{RES}.norm1", nn.LayerNorm(32)),
     r"unsupported normalisation at up_blocks.0.resnets.0.norm1: LayerNorm \(expected a GroupNorm\)"),
    (_set(f"{RES}.conv1", nn.Conv2d(32, 32, 3, padding=1, padding_mode="reflect")),
     r"unsupported convolution at up_blocks.0.resnets.0.conv1: kernel \(3, 3\), stride \(1, 1\), padding \(1, 1\), "
     r"padding_mode 'reflect'"),
    (_set(f"{RES}.conv2", nn.Conv2d(32, 32, 3, padding=1, groups=2)),
     r"unsupported convolution at up_blocks.0.resnets.0.conv2: kernel \(3, 3\), stride \(1, 1\), padding \(1, 1\), "
     r"groups 2"),
    (_set(f"{RES}.conv_shortcut", nn.Conv2d(32, 32, 3, padding=1)),
     r"unsupported 3x3 shortcut at up_blocks.0.resnets.0"),
    (_set("decoder.mid_block.attentions.0.residual_connection", False),
     r"unsupported VAE attention block at mid.attentions.0 \(Attention: no residual connection\)"),
    (_set("decoder.mid_block.attentions.0.group_norm", None),
     r"unsupported VAE attention block at mid.attentions.0 \(Attention: no group_norm\)"),
    (_set("decoder.mid_block.attentions.0.spatial_norm", nn.Identity()),
     r"unsupported VAE attention block at mid.attentions.0 \(Attention: spatial_norm\)"),
    (_set("decoder.up_blocks.0.upsamplers.0.use_conv_transpose", True),
     r"unsupported upsampler at up_blocks.0.upsamplers.0"),
    (_set("post_quant_conv", nn.Conv2d(4, 4, 1, padding=1)),
     r"unsupported convolution at post_quant_conv: kernel \(1, 1\), stride \(1, 1\), padding \(1, 1\)"),
    (_set("decoder", nn.Identity()), r"vae: AutoencoderKL is neither a diffusers AutoencoderKL nor a ComfyUI/LDM "
                                     r"AutoencoderKL \(no decoder.up_blocks or decoder.up\); exact tiling supports "
                                     r"those two and diffusers' AutoencoderKLQwenImage \(.*\)"),
])
def test_unsupported_decoders_are_refused_by_module_with_the_fix(change, match):
    vae = _vae()
    change(vae)
    with pytest.raises(TypeError, match=match + FIX):
        tiled_decode(from_module(vae), torch.zeros(1, 4, 8, 8), tile_size=128, overlap=32, quiet=True)


@pytest.mark.parametrize("name,value,where", [("use_conv", False, "down_blocks.0"),
                                              ("padding", 1, "down_blocks.0.downsamplers.0")])
def test_unsupported_encoders_are_refused_with_the_fix(name, value, where):
    """``padding=1``: diffusers then skips the bottom/right zero pad SD's encoder has, so
    the band algebra of ``down2`` would compute another picture."""
    vae = _vae()
    setattr(vae.encoder.down_blocks[0].downsamplers[0], name, value)
    with pytest.raises(TypeError, match=rf"unsupported downsampler at {where}" + FIX):
        tiled_encode(from_module(vae), torch.zeros(1, 64, 64, 3), tile_size=128, overlap=32, quiet=True)


def test_a_decoder_up_block_with_attention_is_refused():
    """The up blocks' attentions must not be silently left out of the program."""
    vae = _vae(up_block_types=("AttnUpDecoderBlock2D", "UpDecoderBlock2D"))
    with pytest.raises(TypeError, match=r"unsupported attention in decoder up block 0" + FIX):
        tiled_decode(from_module(vae), torch.zeros(1, 4, 8, 8), tile_size=128, overlap=32, quiet=True)


def test_an_ldm_resnet_with_a_3x3_conv_shortcut_is_refused():
    """LDM's ``use_conv_shortcut`` means a 3x3 ``conv_shortcut`` where the channels change (without the check the
    program would take the block's ``nin_shortcut``, another function, or crash without it)."""
    from leandiffusion.tests.vae.ldm_tree import LdmAutoencoderKL

    ldm = LdmAutoencoderKL().eval().requires_grad_(False)
    block = ldm.decoder.up[1].block[0]
    assert block.in_channels != block.out_channels
    block.use_conv_shortcut = True
    with pytest.raises(TypeError, match=r"unsupported 3x3 shortcut at up.1.block.0" + FIX):
        tiled_decode(from_module(ldm), torch.zeros(1, 4, 8, 8), tile_size=128, overlap=32, quiet=True)


def test_resnet_output_scale_is_computed_exactly():
    vae = _vae(seed=3)
    for block in list(vae.decoder.up_blocks) + [vae.decoder.mid_block]:
        for res in block.resnets:
            res.output_scale_factor = 2.0
    z = torch.randn(1, 4, 13, 9, generator=torch.Generator().manual_seed(4))
    ref_vae = copy.deepcopy(vae).double()
    with torch.no_grad():
        ref = ((ref_vae.decode(z.double()).sample + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1).float()
        plain = ((_vae(seed=3).double().decode(z.double()).sample + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1).float()
    assert (plain - ref).abs().max() > 0.05, "the scale must change the image for the test to mean anything"
    got = tiled_decode(from_module(vae), z, tile_size=128, overlap=32, seam_mode="exact", quiet=True)
    assert (got - ref).abs().max().item() <= 1e-4


def test_untiled_fast_path_leaves_an_attention_it_cannot_run_to_its_own_processor():
    vae = _vae(seed=5)
    attn = vae.decoder.mid_block.attentions[0]
    attn.residual_connection = False  # diffusers still runs it (no residual added); run_attention cannot
    processor = attn.processor
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = vae.decode(z).sample
        with untiled.fast_vae(vae):
            assert attn.processor is processor
            got = untiled.decode(vae, z)
    assert torch.equal(got, want)
    assert attn.processor is processor


@pytest.mark.parametrize("flag", ["give_pre_end", "tanh_out"])
def test_an_ldm_decoder_that_ends_otherwise_is_refused(flag):
    """Without the check a decoder ending before its output layers (``give_pre_end``) or in ``tanh`` would decode as
    if it ended in ``norm_out``, SiLU, ``conv_out``."""
    from leandiffusion.tests.vae.ldm_tree import LdmAutoencoderKL

    ldm = LdmAutoencoderKL().eval().requires_grad_(False)
    setattr(ldm.decoder, flag, True)
    with pytest.raises(TypeError, match=r"unsupported LDM decoder \(give_pre_end/tanh_out\)" + FIX):
        tiled_decode(from_module(ldm), torch.zeros(1, 4, 8, 8), tile_size=128, overlap=32, quiet=True)


@pytest.mark.parametrize("name,value", [("scale_factor", 4.0), ("with_conv", False)])
def test_an_ldm_upsampler_other_than_2x_with_a_convolution_is_refused(name, value):
    """ComfyUI's LDM ``Upsample`` takes any ``scale_factor`` (a 4x upsampler must not run as 2x)."""
    from leandiffusion.tests.vae.ldm_tree import LdmAutoencoderKL

    ldm = LdmAutoencoderKL().eval().requires_grad_(False)
    setattr(ldm.decoder.up[1].upsample, name, value)
    with pytest.raises(TypeError, match=r"unsupported upsampler at up.1" + FIX):
        tiled_decode(from_module(ldm), torch.zeros(1, 4, 8, 8), tile_size=128, overlap=32, quiet=True)
