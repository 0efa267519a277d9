"""Run by ComfyUI's interpreter (not collected by pytest): ComfyUI's model sampling, KSampler sigmas and starting noise
next to the pack's, in one process (same torch build), for the cases the test writes.

``python comfy_ksampler_sigmas.py COMFYUI_PATH PACK_PARENT CASES_JSON OUT_JSON``. Models: ``sd15-eps``
(``ModelSamplingDiscrete`` + ``EPS`` with its SD defaults), ``sd2-v`` (+ ``V_PREDICTION``), ``flow-shift3``
(``ModelSamplingDiscreteFlow`` + ``CONST``, shift 3) against ``model_sampling_for_family`` of sd1, sd2-v and zimage.
Case kinds: ``model`` (tables, timestep, sigma, percent_to_sigma, input / denoised, noise scaling and its inverse,
``Sampler.max_denoise``), ``sigmas`` (``comfy.samplers.KSampler(...).sigmas`` against ``schedulers.sigmas_for``),
``noise`` (``comfy.sample.prepare_noise``) and ``empty`` (``comfy.sample.fix_empty_latent_channels``). ``OUT_JSON``
maps each case id to ``{check: {"equal": bit-equal, "max_abs": ..., "shapes": [theirs, ours]}}``.
"""
import json
import sys
from types import SimpleNamespace

comfy_path, pack_parent, cases_path, out_path = sys.argv[1:5]
sys.path.insert(0, comfy_path)
sys.argv = [sys.argv[0], "--cpu"]  # ComfyUI's device choice reads its command line

import comfy.options  # noqa: E402

comfy.options.enable_args_parsing()
import torch  # noqa: E402

import comfy.sample  # noqa: E402
import comfy.samplers  # noqa: E402

sys.path.insert(0, pack_parent)
from leandiffusion.sampling.ksampler.latent_noise import fix_empty_latent_channels, prepare_noise  # noqa: E402
from leandiffusion.sampling.ksampler.model_sampling import max_denoise, model_sampling_for_family  # noqa: E402
from leandiffusion.sampling.ksampler.schedulers import sigmas_for  # noqa: E402
from leandiffusion.tests.kit.comfy_samplings import EpsSampling, VSampling, flow_sampling  # noqa: E402


MODELS = {"sd15-eps": (EpsSampling(), model_sampling_for_family("sd1")),
          "sd2-v": (VSampling(), model_sampling_for_family("sd2-v")),
          "flow-shift3": (flow_sampling(3.0), model_sampling_for_family("zimage"))}


def compare(theirs, ours) -> dict:
    if not isinstance(theirs, torch.Tensor) or not isinstance(ours, torch.Tensor):  # a number: compare its value
        theirs, ours = torch.tensor(float(theirs), dtype=torch.float64), torch.tensor(float(ours), dtype=torch.float64)
    shapes = [list(theirs.shape), list(ours.shape)]
    if shapes[0] != shapes[1] or theirs.dtype != ours.dtype:
        return {"equal": False, "max_abs": float("inf"), "shapes": shapes, "dtypes": [str(theirs.dtype), str(ours.dtype)]}
    diff = (theirs.double() - ours.double()).abs().max().item() if theirs.numel() else 0.0
    return {"equal": bool(torch.equal(theirs, ours)), "max_abs": diff, "shapes": shapes}


def _probes(flow: bool):
    if flow:
        return torch.tensor([1.0, 0.999, 0.5, 0.25, 0.0031, 0.7123]), torch.tensor([1000.0, 999.0, 500.5, 3.0, 1.0])
    sigmas = torch.tensor([0.0292, 0.03, 0.5, 1.0, 3.3, 9.9, 14.0, 14.6146, 100.0])
    return sigmas, torch.tensor([0.0, 0.5, 17.25, 500.0, 998.7, 999.0, 1200.0, -5.0])


def model_checks(name: str) -> dict:
    theirs, ours = MODELS[name]
    flow = name.startswith("flow")
    out = {"sigmas": compare(theirs.sigmas, ours.sigmas), "sigma_min": compare(theirs.sigma_min, ours.sigma_min),
           "sigma_max": compare(theirs.sigma_max, ours.sigma_max)}
    if not flow:
        out["log_sigmas"] = compare(theirs.log_sigmas, ours.log_sigmas)
    sigmas, timesteps = _probes(flow)
    out["timestep"] = compare(theirs.timestep(sigmas), ours.timestep(sigmas))
    out["timestep_of_table"] = compare(theirs.timestep(theirs.sigmas), ours.timestep(ours.sigmas))
    out["sigma"] = compare(theirs.sigma(timesteps), ours.sigma(timesteps))
    for p in (0.0, 1e-4, 0.1, 0.5, 0.9, 1.0):
        out[f"percent_to_sigma({p})"] = compare(theirs.percent_to_sigma(p), ours.percent_to_sigma(p))
    gen = torch.Generator().manual_seed(11)
    shape = (2, 16 if flow else 4, 8, 8)
    x, model_out, latent = (torch.randn(shape, generator=gen) for _ in range(3))
    row_sigmas = torch.tensor([0.8, 0.3]) if flow else torch.tensor([14.6146, 0.7])
    for label, sigma in (("rows", row_sigmas), ("scalar", row_sigmas[:1])):
        out[f"calculate_input[{label}]"] = compare(theirs.calculate_input(sigma, x), ours.calculate_input(sigma, x))
        out[f"calculate_denoised[{label}]"] = compare(theirs.calculate_denoised(sigma, model_out, x),
                                                      ours.calculate_denoised(sigma, model_out, x))
        for full in (False, True):
            out[f"noise_scaling[{label},max_denoise={full}]"] = compare(
                theirs.noise_scaling(sigma, x.clone(), latent, full), ours.noise_scaling(sigma, x.clone(), latent, full))
        out[f"inverse_noise_scaling[{label}]"] = compare(theirs.inverse_noise_scaling(sigma, x),
                                                         ours.inverse_noise_scaling(sigma, x))
    wrap = SimpleNamespace(inner_model=SimpleNamespace(model_sampling=theirs))
    top = float(theirs.sigma_max)
    for start in (top, top * (1 + 5e-6), top * (1 - 5e-5), top * 2, top / 2):
        first = torch.tensor([start, 0.0])
        out[f"max_denoise({start:.7g})"] = compare(float(comfy.samplers.Sampler().max_denoise(wrap, first)),
                                                   float(max_denoise(ours, first)))
    return out


class Patcher:
    def __init__(self, model_sampling, latent_channels=4):
        self.objects = {"model_sampling": model_sampling,
                        "latent_format": SimpleNamespace(latent_channels=latent_channels, latent_dimensions=2)}

    def get_model_object(self, name):
        return self.objects[name]


def sigma_checks(case: dict) -> dict:
    theirs, ours = MODELS[case["model"]]
    sampler = comfy.samplers.KSampler(Patcher(theirs), steps=case["steps"], device="cpu", sampler=case["sampler"],
                                      scheduler=case["scheduler"], denoise=case["denoise"])
    mine = sigmas_for(ours, case["scheduler"], case["steps"], case["denoise"], case["sampler"])
    return {"sigmas": compare(sampler.sigmas, mine)}


def noise_checks(case: dict) -> dict:
    latent = torch.zeros(case["shape"])
    index = case["batch_index"]
    return {"noise": compare(comfy.sample.prepare_noise(latent, case["seed"], index),
                             prepare_noise(latent, case["seed"], index))}


def empty_checks(case: dict) -> dict:
    latent = torch.zeros(case["shape"])
    if case["nonzero"]:
        latent[0, 0, 0, 0] = 1.0
    theirs = comfy.sample.fix_empty_latent_channels(Patcher(None, case["channels"]), latent)
    return {"latent": compare(theirs, fix_empty_latent_channels(latent, case["channels"]))}


CHECKS = {"sigmas": sigma_checks, "noise": noise_checks, "empty": empty_checks}
results = {}
for case in json.loads(open(cases_path).read()):
    kind = case["kind"]
    results[case["id"]] = model_checks(case["model"]) if kind == "model" else CHECKS[kind](case)
with open(out_path, "w") as f:
    json.dump(results, f)
