"""The Stream Scheduler Sampler on LyCORIS / DoRA LoRA views on a GPU: what tests/sampling/test_stream_lycoris.py
checks on the CPU, with real CUDA streams (the text stage attaching the views' adapters on its side stream while the
UNet's steps are queued), CUDA graphs and fp16.

Tiny SD1 model (tests.kit), fp16, 128 px, 4 steps, cfg 6, ``cuda_graph``; policies ``full`` and ``balanced`` (text
encoders and VAE moved on their side streams). Views: LoHa + DoRA (output axis) unmerged; a merged LoKr under an
unmerged LoKr-DoRA (the DoRA gain follows the merged weights); per view three runs (strengths a, b, a again). Per run
and image: max |stream - Fused DDIM Sampler| / max |Fused| (same view, seed + n, batch 1; ``max_batch`` 3 over 6
images: batches 3, 3 -- and image 5 alone in a second pass with ``max_batch`` 5: batches 5, 1, where the batch of
one must replay the Fused DDIM Sampler's own graph bit-identically); afterwards whether the base model's weights are
unchanged. Expected: batched rel <= 5e-3 (docs/stream.md's fp16 bound), batch of one 0.0, ``base_untouched`` true.
Usage (device, pack importable as ``leandiffusion``): python scripts/diag/stream_lycoris_gpu.py; writes
$OUT/stream_lycoris_gpu.json. About a minute on an H100.
"""
import re
import tempfile
from pathlib import Path

import torch

from diag_timing import Recorder
from leandiffusion.lora import inject_lora
from leandiffusion.memory.load import build_engine
from leandiffusion.sampling.loop import sample
from leandiffusion.sampling.stream.scheduler import run_stream
from leandiffusion.sampling.stream.settings import StreamSettings
from leandiffusion.tests.kit import tiny_components, tiny_parts
from leandiffusion.tests.lora import lorafiles as lf

rec = Recorder("stream_lycoris_gpu.json")
PROMPTS = ("a red boat", "snowy forest")
UNET_ALL = re.compile(lf.ATTN_FF.pattern + "|" + lf.LOCON.pattern)
VIEWS = {"loha+dora_out": [("loha_lowrank", "unmerged"), ("dora_out", "unmerged")],
         "merged_lokr+lokr_dora_in": [("lokr_tucker", "merged"), ("lokr_dora_in", "unmerged")]}
STRENGTHS = ([(0.8, 0.9), (-0.6, 1.1)], [(-0.4, 0.3), (1.2, -0.5)], [(0.8, 0.9), (-0.6, 1.1)])

folder = Path(tempfile.mkdtemp())
comps = tiny_components("sd1")
roots = {"unet": comps["unet"], "text_encoder": comps["text_encoder"]}
patterns = {"unet": UNET_ALL, "text_encoder": lf.TE_LINEARS}
files = {case: lf.write(lf.lycoris_case(roots, patterns, case, seed=2), folder / f"{case}.safetensors")
         for layers in VIEWS.values() for case, _ in layers}


def settings(max_batch):
    return StreamSettings.from_text("\n".join(PROMPTS), negative="blurry", seed=21, steps=4, cfg=6.0, width=128,
                                    height=128, acceleration="cuda_graph", images_per_prompt=3, max_batch=max_batch)


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


for policy in ("full", "balanced"):
    base = build_engine(tiny_parts("sd1"), policy, device="cuda", weight_dtype="fp16", vae_dtype="fp16")
    weights = {k: v.detach().clone() for m in (base.parts.unet, base.parts.text_encoder)
               for k, v in m.state_dict().items()}
    for name, layers in VIEWS.items():
        for run, strengths in enumerate(STRENGTHS):
            view = base
            for (case, mode), (s_unet, s_text) in zip(layers, strengths):
                view = inject_lora(view, files[case], s_unet, s_text, mode=mode)
            s = settings(3).validated()
            refs = torch.cat([sample(view, s.sampler_settings(PROMPTS[n // 3], s.seed + n), quiet=True)["samples"]
                              for n in range(6)])
            got = run_stream(view, s, quiet=True)
            alone = run_stream(view, settings(5), quiet=True)  # image 5 in a batch of one
            rec(f"{policy} {name} run {run}", {
                "batches": list(got.batch_sizes), "rel_per_image": [round(rel(got.latents[n], refs[n]), 6)
                                                                    for n in range(6)],
                "batch_of_one_abs": (alone.latents[5] - refs[5]).abs().max().item(),
                "batches_second_pass": list(alone.batch_sizes)})
    after = {k: v for m in (base.parts.unet, base.parts.text_encoder) for k, v in m.state_dict().items()}
    rec(f"{policy} base_untouched", all(torch.equal(after[k].to(v.device), v) for k, v in weights.items()))
