"""How far does the SDXL UNet output move when one block computes with another same-shaped block's weights?

That is what a race in the ``stream`` policy's staging ring would produce (a block reading an arena slice that
still holds, wholly or half, the previous occupant's weights), so it sizes the tolerance of the capture test in
tests/memory/test_gpu_stream.py. Full-size SDXL, fp16, random weights, batch 2 at 1024 px, eager, full policy.
Usage (device, pack importable): python scripts/diag/stale_block.py; writes $OUT/stale_block.json.
"""
import torch

from diag_timing import Recorder
from leandiffusion.bench.models import full_unet, unet_inputs

rec = Recorder("stale_block.json")
PAIRS = [  # (block that gets stale weights, block whose weights it gets): same shapes
    ("mid_block.attentions.0.transformer_blocks.4", "mid_block.attentions.0.transformer_blocks.5"),
    ("down_blocks.2.attentions.1.transformer_blocks.3", "down_blocks.2.attentions.1.transformer_blocks.7"),
    ("up_blocks.0.attentions.2.transformer_blocks.9", "up_blocks.0.attentions.2.transformer_blocks.2"),
    ("down_blocks.1.attentions.0.transformer_blocks.0", "down_blocks.1.attentions.0.transformer_blocks.1"),
    ("up_blocks.1.attentions.1.transformer_blocks.1", "up_blocks.1.attentions.1.transformer_blocks.0"),
    ("down_blocks.0.resnets.0", "down_blocks.0.resnets.1"),
    ("mid_block.resnets.0", "mid_block.resnets.1"),
]


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


unet = full_unet("sdxl", device="cuda", dtype=torch.float16)
inputs = unet_inputs("sdxl", batch=2, latent_hw=128, device="cuda", dtype=torch.float16)
with torch.no_grad():
    ref = unet(**inputs).sample.clone()
    modules = dict(unet.named_modules())
    for victim, donor in PAIRS:
        params = list(modules[victim].parameters())
        donor_params = list(modules[donor].parameters())
        saved = [p.detach().clone() for p in params]
        for fraction in (1.0, 0.5):  # whole copy stale, or the first half of every tensor (a copy cut midway)
            for p, d in zip(params, donor_params):
                n = int(p.numel() * fraction)
                p.view(-1)[:n].copy_(d.view(-1)[:n])
            rec(f"{victim} <- {fraction:.0%} of {donor}", rel(unet(**inputs).sample, ref))
            for p, s in zip(params, saved):
                p.copy_(s)
    rec("restored (must be 0)", rel(unet(**inputs).sample, ref))
