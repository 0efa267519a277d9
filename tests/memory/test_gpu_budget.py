"""GPU: under the ``stream`` policy the loader's budget holds along a whole workflow, not only in the UNet.

A full-size SDXL engine (random fp16 weights, SDXL VAE in fp32) at 4 GB and 1.5 GB runs the nodes one after another
as a ComfyUI graph does: Fused DDIM Sampler (``cuda_graph``, 1024 px, prompts encoded inside) -> Tiled VAE Decode
(auto tile) -> Tiled VAE Encode -> the sampler again (its graph was dropped to make room for the VAE: it must
capture again and give the same latent, within fp16's 1e-3 relative) -> a one-prompt Stream Scheduler run (the
same image). The process's peak reserved memory must stay within the budget plus what
it held before the engine was built (``memory/budget.py``). The budgeted decode must also be the untiled decode's picture (diffusers' ``AutoencoderKL.decode``
of the same latent, same weights, fp32): within 2/255.
"""
import gc

import pytest
import torch

from leandiffusion.nodes.sampler import LeanFusedDDIMSampler
from leandiffusion.nodes.stream import LeanStreamSampler
from leandiffusion.nodes.vae import LeanTiledVAEDecode, LeanTiledVAEEncode

pytestmark = pytest.mark.gpu
GiB = 2 ** 30


@pytest.fixture(scope="module")
def sdxl_parts():
    from leandiffusion.bench.suite_stream import _full_parts

    parts = _full_parts("sdxl", torch.device("cuda"))
    for m in (parts.unet, parts.vae, parts.text_encoder, parts.text_encoder_2):
        m.to("cpu")
    torch.cuda.empty_cache()
    return parts


def _free():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("budget_gb", [4.0, 1.5])
def test_workflow_keeps_the_budget(sdxl_parts, budget_gb):
    from leandiffusion.memory.load import build_engine
    from leandiffusion.sampling.graph_runner import default_runner

    _free()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine = build_engine(sdxl_parts, "stream", budget_gb, device="cuda", weight_dtype="auto", vae_dtype="auto")
    kw = dict(positive="a photo of a cat", negative="blurry", seed=0, steps=2, cfg=7.5, eta=0.0, width=1024,
              height=1024, batch_size=1, timestep_spacing="leading", cfg_mode="batched", acceleration="cuda_graph")
    try:
        latent = LeanFusedDDIMSampler().run(engine, **kw)[0]
        image = LeanTiledVAEDecode().decode(latent, lean_model=engine)[0]
        LeanTiledVAEEncode().encode(image, lean_model=engine)
        again = LeanFusedDDIMSampler().run(engine, **kw)[0]
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_reserved()
        assert peak <= budget_gb * GiB + base, (
            f"peak reserved {peak / GiB:.3f} GiB over the {budget_gb} GB budget (+{base / GiB:.3f} held before)")
        rel = ((again["samples"] - latent["samples"]).abs().max() / latent["samples"].abs().max()).item()
        assert rel <= 1e-3  # recaptured: the same step (fp16 kernels may be re-chosen under the cap)
        # a budgeted Stream Scheduler run first releases cuBLAS's workspaces and the cache, then replays the graph
        # the sampler captured after the VAE dropped the first one (a capture that baked in a cached workspace would
        # read freed memory here: an illegal memory access)
        _, streamed = LeanStreamSampler().run(engine, "a photo of a cat", "blurry", 0, 2, 7.5, 1024, 1024,
                                              "leading", "cuda_graph", 1, 0, 0)
        torch.cuda.synchronize()
        rel = ((streamed["samples"] - again["samples"]).abs().max() / again["samples"].abs().max()).item()
        assert rel <= 1e-3
        assert torch.cuda.max_memory_reserved() <= budget_gb * GiB + base
    finally:
        default_runner().clear(engine)
        engine.placement.remove()
        _free()

    vae = sdxl_parts.vae.to("cuda", torch.float32)
    try:
        with torch.no_grad():
            z = latent["samples"].to("cuda", torch.float32)
            ref = ((vae.decode(z).sample.float() + 1) / 2).clamp(0, 1)[0].permute(1, 2, 0).cpu()
        assert (image[0] - ref).abs().max().item() <= 2 / 255
    finally:
        vae.to("cpu")
        _free()
