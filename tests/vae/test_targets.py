"""``vae/targets.py``: a ComfyUI ``VAE`` runs where and in what ComfyUI says, not where its weights sit now.

Guard: ComfyUI's ``VAE`` keeps its weights offloaded until its model manager loads them, and ``vae_dtype`` is the dtype
it computes in (weights may be stored in another and cast on load), so the target takes ``VAE.device`` and
``VAE.vae_dtype``; the weights' own are only the fallback for an object without them.
"""
import torch

from leandiffusion.tests.vae.ldm_tree import FakeComfyVAE, LdmAutoencoderKL
from leandiffusion.vae.targets import from_comfy


def test_a_comfy_vae_runs_on_its_own_device_and_dtype_not_its_weights():
    fake = FakeComfyVAE(LdmAutoencoderKL())  # weights: fp32 on the CPU
    fake.device, fake.vae_dtype = torch.device("cuda", 1), torch.bfloat16
    target = from_comfy(fake)
    assert (target.device, target.dtype) == (torch.device("cuda", 1), torch.bfloat16)
    fake.device = fake.vae_dtype = None
    target = from_comfy(fake)
    assert (target.device, target.dtype) == (torch.device("cpu"), torch.float32)
