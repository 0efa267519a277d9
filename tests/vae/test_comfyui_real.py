"""Exact tiling on ComfyUI's real LDM ``AutoencoderKL`` (needs COMFYUI_PATH; the stand-in covers it otherwise).

Guards the adapter against drift in ComfyUI's module names/semantics: the tiled decode/encode of ComfyUI's own
modules (``comfy.ops`` subclasses) must equal ComfyUI's own untiled ``decode``/``encode``.
"""

import pytest
import torch

from leandiffusion.tests.kit import tiny_components
from leandiffusion.tests.vae.ldm_tree import FakeComfyVAE, ldm_from_diffusers
from leandiffusion.vae.targets import from_comfy
from leandiffusion.vae.tiled import tiled_decode, tiled_encode
from leandiffusion.tests.kit.comfy_source import comfyui_imports

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def comfy_ae():
    with comfyui_imports():
        from comfy.ldm.models.autoencoder import AutoencoderKL

    ddconfig = dict(double_z=True, z_channels=4, resolution=256, in_channels=3, out_ch=3, ch=32, ch_mult=[1, 1, 2, 2],
                    num_res_blocks=1, attn_resolutions=[], dropout=0.0)
    ae = AutoencoderKL(ddconfig=ddconfig, embed_dim=4)
    missing, unexpected = ae.load_state_dict(ldm_from_diffusers(tiny_components("sd1")["vae"]).state_dict(),
                                             strict=False)
    assert not missing and not unexpected
    return ae.eval().requires_grad_(False)


def test_real_comfy_decode_encode_exact(comfy_ae):
    vae = FakeComfyVAE(comfy_ae)
    z = torch.randn(1, 4, 17, 13)
    with torch.no_grad():
        ref = ((comfy_ae.decode(z) + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1)
    out = tiled_decode(from_comfy(vae), z, 128, 32, "exact", quiet=True)
    assert (out - ref).abs().max().item() <= 1e-4
    pixels = torch.rand(1, 136, 96, 3)
    with torch.no_grad():
        ref_lat = comfy_ae.encode(pixels.permute(0, 3, 1, 2) * 2 - 1)
    lat = tiled_encode(from_comfy(vae), pixels, 128, 32, "exact", quiet=True)
    assert (lat - ref_lat).abs().max().item() <= 1e-4


def test_comfys_wan_vae_module_is_refused_naming_the_fix():
    """ComfyUI's own Wan 2.1 / Qwen-Image VAE module (``comfy.ldm.wan.vae.WanVAE``: ``conv1`` / ``middle`` /
    ``upsamples`` / ``head``) has another module tree than diffusers' ``AutoencoderKLQwenImage``; it is refused with
    the way that works (lean_model), not read as something else."""
    with comfyui_imports():
        from comfy.ldm.wan.vae import WanVAE

    ae = WanVAE(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                temperal_downsample=[False, True, True])
    with pytest.raises(TypeError, match=r"vae: WanVAE is neither .*ComfyUI's own Wan / Qwen-Image VAE module is not "
                                        r"supported yet: load the VAE with the Memory Pool Loader and connect "
                                        r"lean_model instead"):
        tiled_decode(from_comfy(FakeComfyVAE(ae)), torch.randn(1, 16, 8, 8), 0, 64, "exact", quiet=True)
