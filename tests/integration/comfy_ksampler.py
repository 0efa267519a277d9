"""Run by ComfyUI's interpreter (not collected by pytest): core KSampler against the pack's Fused KSampler on one
checkpoint both load.

``python comfy_ksampler.py COMFYUI_PATH PACK_PARENT CHECKPOINT CASES_JSON OUT_JSON``. ComfyUI 0.3.64 loads
``CHECKPOINT`` with its own loader and encodes the prompts with its own CLIPTextEncode; each case then runs core
KSampler's function (``nodes.common_ksampler``) and the pack's ``LeanKSampler`` node on an engine loaded from the same
file (fp32, CPU), both given the same CONDITIONING objects, seed, steps, cfg, sampler, scheduler, denoise and latent.
A case with ``"prediction": "v_prediction"`` patches ComfyUI's model with its own ModelSamplingDiscrete node and gives
the pack's engine a v-prediction scheduler config (the weights are random: both predictions are valid readings).
``OUT_JSON``: per case id, ``{"max_abs": ..., "ref_max": ...}`` (the largest difference and the reference's scale).
"""
import json
import sys
from dataclasses import replace

comfy_path, pack_parent, checkpoint, cases_path, out_path = sys.argv[1:6]
sys.path.insert(0, comfy_path)
sys.argv = [sys.argv[0], "--cpu"]  # ComfyUI's device choice reads its command line

import comfy.options  # noqa: E402

comfy.options.enable_args_parsing()
import torch  # noqa: E402

import comfy.sd  # noqa: E402
import folder_paths  # noqa: E402
import nodes  # noqa: E402
from comfy_extras.nodes_model_advanced import ModelSamplingDiscrete  # noqa: E402

sys.path.insert(0, pack_parent)
from leandiffusion.memory.engine import parts_from_components  # noqa: E402
from leandiffusion.memory.ldm import load_ldm_checkpoint  # noqa: E402
from leandiffusion.memory.load import build_engine  # noqa: E402
from leandiffusion.nodes.ksampler import LeanKSampler  # noqa: E402

model, clip, _vae = comfy.sd.load_checkpoint_guess_config(checkpoint, output_vae=True, output_clip=True,
                                                          embedding_directory=folder_paths.get_folder_paths(
                                                              "embeddings"))[:3]
models = {"epsilon": model, "v_prediction": ModelSamplingDiscrete().patch(model, "v_prediction", False)[0]}
positive = nodes.CLIPTextEncode().encode(clip, "a red fox in the snow, photograph")[0]
negative = nodes.CLIPTextEncode().encode(clip, "blurry")[0]

parts = parts_from_components(load_ldm_checkpoint(checkpoint))
engines = {"epsilon": build_engine(parts, "full", weight_dtype="fp32", vae_dtype="fp32", device="cpu")}
v_parts = replace(parts, scheduler_config={**parts.scheduler_config, "prediction_type": "v_prediction"})
engines["v_prediction"] = build_engine(v_parts, "full", weight_dtype="fp32", vae_dtype="fp32", device="cpu")

results = {}
for case in json.loads(open(cases_path).read()):
    g = torch.Generator().manual_seed(case["latent_seed"])
    shape = (case["batch"], 4, case["size"], case["size"])
    samples = torch.randn(shape, generator=g) * 5.0 if case["img2img"] else torch.zeros(shape)
    latent = {"samples": samples}
    ref = nodes.common_ksampler(models[case["prediction"]], case["seed"], case["steps"], case["cfg"],
                                case["sampler"], case["scheduler"], positive, negative, latent,
                                denoise=case["denoise"])[0]["samples"]
    ours = LeanKSampler().run(engines[case["prediction"]], case["seed"], case["steps"], case["cfg"], case["sampler"],
                              case["scheduler"], latent, case["denoise"], "none", positive=positive,
                              negative=negative)[0]["samples"]
    results[case["id"]] = {"max_abs": float((ours - ref).abs().max()), "ref_max": float(ref.abs().max()),
                           "shape_ok": tuple(ours.shape) == tuple(ref.shape)}
with open(out_path, "w") as f:
    json.dump(results, f)
