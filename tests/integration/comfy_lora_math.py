"""Run by ComfyUI's interpreter (not collected by pytest): the merged weights ComfyUI's own LoRA code computes.

``python comfy_lora_math.py COMFYUI_PATH BUNDLE OUT STRENGTH[,STRENGTH...]``: ``BUNDLE`` (safetensors) holds the LoRA
file's tensors as ``lora::<key>`` and each targeted layer's base weight as ``base::<kohya layer name>``; ``OUT``
receives ``<strength>::<kohya layer name>`` -> ``comfy.lora.calculate_weight`` of that layer at that strength (what
ComfyUI's LoraLoader writes into the model; fp32). ComfyUI logs a patch that fails and leaves the weight as it was.
"""
import sys

comfy_path, bundle_path, out_path, strengths = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
sys.path.insert(0, comfy_path)
sys.argv = [sys.argv[0], "--cpu"]  # ComfyUI's device choice reads its command line

import comfy.options  # noqa: E402

comfy.options.enable_args_parsing()
import comfy.lora  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

bundle = load_file(bundle_path)
lora = {k[len("lora::"):]: v for k, v in bundle.items() if k.startswith("lora::")}
bases = {k[len("base::"):]: v for k, v in bundle.items() if k.startswith("base::")}
patches = comfy.lora.load_lora(lora, {b: b + ".weight" for b in bases}, log_missing=True)
missing = sorted(b for b in bases if b + ".weight" not in patches)
if missing:
    raise SystemExit(f"ComfyUI loaded no patch for {missing}")
out = {f"{s}::{b}": comfy.lora.calculate_weight([(float(s), patches[b + ".weight"], 1.0, None, None)],
                                               w.float().clone(), b + ".weight")
       for s in strengths for b, w in bases.items()}
save_file({k: v.contiguous() for k, v in out.items()}, out_path)
