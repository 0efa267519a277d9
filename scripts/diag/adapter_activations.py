"""How much more activation memory per image an unmerged LoRA / LyCORIS / DoRA view needs than the base UNet, next to
the Stream Scheduler's automatic-batch estimate (``sampling.stream.batching.per_image_bytes``, the base UNet's).

SDXL 1024 px (128x128 latent) and SD1.5 512 px (64x64), fp16, random weights; every attention and feed-forward
Linear carries the adapter (files as ``lycoris_cost.py`` writes them). Per case and UNet batch (2, 4, 8 rows = 1, 2, 4
guided images): the allocated peak of one eager UNet call above what was allocated before it (output included),
after a warm-up call of the same shape. Per image = (peak at 8 rows - peak at 2 rows) / 3; ``extra_per_image`` is
that minus the base UNet's, and ``estimate`` the scheduler's per-image bytes.
Usage (device machine, pack importable as ``leandiffusion``): cd scripts/diag && python3 adapter_activations.py;
writes $OUT/adapter_activations.json. About two minutes on an H100.
"""
import gc
import sys
import tempfile

import torch

from diag_timing import Recorder
from lycoris_cost import write_file
from leandiffusion.bench.models import full_unet, unet_inputs
from leandiffusion.bench.suite_lora import _engine
from leandiffusion.lora import clear_cache, inject_lora
from leandiffusion.sampling.stream.batching import per_image_bytes

dev = torch.device("cuda")
rec = Recorder("adapter_activations.json")
CASES = ["base", "lora_r32", "loha_r16", "lokr_default", "dora_in_r32", "dora_out_r32"]
MODELS = {"sdxl": 128, "sd15": 64}
MiB = 2 ** 20


def _call(unet, inputs):
    return unet(inputs["sample"], inputs["timestep"], encoder_hidden_states=inputs["encoder_hidden_states"],
                added_cond_kwargs=inputs.get("added_cond_kwargs"), return_dict=False)[0]


def peak_of(unet, inputs):
    _call(unet, inputs)  # warm-up (workspaces, cuDNN plans)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = _call(unet, inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak


@torch.no_grad()
def main():
    kinds = sys.argv[1].split(",") if len(sys.argv) > 1 else list(MODELS)
    for kind in kinds:
        hw = MODELS[kind]
        unet = full_unet(kind, device=dev)
        engine = _engine(unet, dev, torch.float16)
        estimate = per_image_bytes(engine, hw, hw, True)
        base_per_image = None
        with tempfile.TemporaryDirectory() as folder:
            for case in CASES:
                clear_cache()
                gc.collect()
                torch.cuda.empty_cache()
                view = engine if case == "base" else inject_lora(engine, write_file(case, unet, folder), 1.0,
                                                                   mode="unmerged")
                peaks = {}
                with view.session("unet"):
                    for rows in (2, 4, 8):
                        inputs = unet_inputs(kind, batch=rows, latent_hw=hw, device=dev)
                        peaks[rows] = peak_of(unet, inputs)
                        del inputs
                per_image = (peaks[8] - peaks[2]) / 3
                if case == "base":
                    base_per_image = per_image
                rec(f"{kind} {case}", {
                    "peak_mib": {r: round(p / MiB, 1) for r, p in peaks.items()},
                    "per_image_mib": round(per_image / MiB, 1),
                    "extra_per_image_mib": round((per_image - base_per_image) / MiB, 1),
                    "extra_vs_base_pct": round(100 * (per_image / base_per_image - 1), 1),
                    "estimate_mib": round(estimate / MiB, 1),
                    "measured_over_estimate": round(per_image / estimate, 3)})
                del view
        del unet, engine
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
