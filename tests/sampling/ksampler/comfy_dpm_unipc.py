"""Run by ComfyUI's interpreter (not collected by pytest): ComfyUI's DPM-Solver++ samplers and UniPC against the
pack's ``samplers_dpm`` and ``unipc`` on the same toy denoiser, sigmas, start latent and noise sampler.

``python comfy_dpm_unipc.py COMFYUI_PATH PACK_PARENT CASES_JSON OUT_JSON``. Per case: the sigmas come from ComfyUI's
``KSampler`` (scheduler, penultimate-sigma and denoise rules) over ``ModelSamplingDiscrete`` + ``EPS`` (SD1.5 betas)
or ``ModelSamplingDiscreteFlow`` + ``CONST`` (shift 3); the start is ComfyUI's ``noise_scaling`` of seeded noise and
a latent; the SDE samplers get one ``BrownianTreeNoiseSampler`` (or ``default_noise_sampler``, rebuilt per side since
it is a running generator) built as ComfyUI builds it. ``OUT_JSON`` maps case id -> max abs differences of the
result, of every callback's x and denoised, and of the sigma tensor after the run (UniPC edits it in place), plus
whether the results are bit-equal and the number of model calls on each side.
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

import comfy.k_diffusion.sampling as kds  # noqa: E402
import comfy.model_sampling as cms  # noqa: E402
import comfy.samplers  # noqa: E402
from comfy.extra_samplers import uni_pc as comfy_uni_pc  # noqa: E402

sys.path.insert(0, pack_parent)
from leandiffusion.sampling.ksampler import samplers_dpm, unipc  # noqa: E402
from leandiffusion.tests.kit.comfy_samplings import model_samplings  # noqa: E402

OURS = {**samplers_dpm.SAMPLERS, **unipc.SAMPLERS}


def _toy_denoiser(channels: int, counter: list):
    """A fixed nonlinear map of x and sigma (channel mixing, tanh, sigma-dependent gains); counts its calls."""
    g = torch.Generator().manual_seed(1234)
    mix = torch.randn(channels, channels, generator=g) / channels ** 0.5
    bias = torch.randn(channels, generator=g).view(1, -1, 1, 1) * 0.2

    def denoise(x, sigma):
        counter[0] += 1
        s = sigma.view(-1, 1, 1, 1)
        inner = torch.einsum("oc,bchw->bohw", mix, x) / (1 + s * s).sqrt()
        return torch.tanh(inner + bias) * 0.9 + x * (0.3 / (1 + s)) - 0.1 * s.cos() * x.square().mean()

    return denoise


class _ComfyModel:
    """What ComfyUI's samplers call: ``model(x, sigma, **extra_args)`` and its model sampling lookup."""

    def __init__(self, denoise, sampling):
        self.denoise = denoise
        self.inner_model = SimpleNamespace(model_patcher=SimpleNamespace(get_model_object=lambda name: sampling))

    def __call__(self, x, sigma, **extra_args):
        return self.denoise(x, sigma)


def _duck(sampling):
    """The pack's sampling contract, read off ComfyUI's object (so the test checks only the samplers' math)."""
    return SimpleNamespace(is_flow=isinstance(sampling, cms.CONST), sigma_min=float(sampling.sigma_min),
                           sigma_max=float(sampling.sigma_max), percent_to_sigma=sampling.percent_to_sigma)


def _sigmas(sampling, case):
    model = SimpleNamespace(get_model_object=lambda name: sampling)
    return comfy.samplers.KSampler(model, case["steps"], "cpu", case["sampler"], case["scheduler"],
                                   case["denoise"]).sigmas.float()


def _start(sampling, sigmas, case):
    g = torch.Generator().manual_seed(case["seed"])
    shape = (2, 4, 6, 5)
    noise = torch.randn(shape, generator=g)
    latent = torch.randn(shape, generator=g) * 0.7 if case["denoise"] < 1 else torch.zeros(shape)
    full = case["denoise"] >= 1
    return sampling.noise_scaling(sigmas[0], noise, latent, full)


def _noise_maker(case, x, sigmas):
    if case["noise"] == "gaussian":
        return lambda: kds.default_noise_sampler(x, seed=case["seed"] + 1)
    if case["noise"] == "brownian":
        shared = kds.BrownianTreeNoiseSampler(x, sigmas[sigmas > 0].min(), sigmas.max(), seed=case["seed"] + 1,
                                              cpu=True)
        return lambda: shared
    return lambda: None


def _comfy_run(case, sampling, denoise, x, sigmas, noise_sampler):
    steps = []
    callback = lambda d: steps.append((d["i"], d["x"].clone(), d["denoised"].clone()))  # noqa: E731
    model = _ComfyModel(denoise, sampling)
    options = dict(case["options"])
    if case["sampler"] == "uni_pc":
        out = comfy_uni_pc.sample_unipc(model, x.clone(), sigmas, extra_args={}, callback=callback, disable=True)
    else:
        fn = getattr(kds, "sample_" + case["sampler"])
        if noise_sampler is not None:
            options["noise_sampler"] = noise_sampler
        out = fn(model, x.clone(), sigmas, extra_args={"seed": case["seed"]}, callback=callback, disable=True,
                 **options)
    return out, steps


def _our_run(case, sampling, denoise, x, sigmas, noise_sampler):
    steps = []
    callback = lambda i, x_i, d_i: steps.append((i, x_i.clone(), d_i.clone()))  # noqa: E731
    out = OURS[case["sampler"]].fn(denoise, x.clone(), sigmas, sampling=_duck(sampling),
                                   noise_sampler=noise_sampler, callback=callback, **case["options"])
    return out, steps


def _diff(a, b):
    return float((a - b).abs().max()) if a.numel() else 0.0


def run_case(case, samplings):
    sampling = samplings[case["kind"]]
    sigmas = _sigmas(sampling, case)
    x = _start(sampling, sigmas, case)
    make_noise = _noise_maker(case, x, sigmas)
    theirs_count, ours_count = [0], [0]
    theirs_sigmas, ours_sigmas = sigmas.clone(), sigmas.clone()
    theirs, theirs_steps = _comfy_run(case, sampling, _toy_denoiser(4, theirs_count), x, theirs_sigmas, make_noise())
    ours, ours_steps = _our_run(case, sampling, _toy_denoiser(4, ours_count), x, ours_sigmas, make_noise())
    same_steps = [a[0] for a in theirs_steps] == [b[0] for b in ours_steps]
    step_diff = max([max(_diff(a[1], b[1]), _diff(a[2], b[2])) for a, b in zip(theirs_steps, ours_steps)] or [0.0])
    return {"result": _diff(theirs, ours), "equal": bool(torch.equal(theirs, ours)), "steps": step_diff,
            "same_step_indices": same_steps, "callbacks": len(ours_steps), "sigmas_after": _diff(theirs_sigmas,
                                                                                                   ours_sigmas),
            "model_calls": [theirs_count[0], ours_count[0]], "moved": _diff(theirs, x), "finite":
            bool(torch.isfinite(ours).all()), "n_sigmas": int(sigmas.numel())}


def main():
    cases = json.loads(open(cases_path).read())
    samplings = model_samplings()
    with torch.no_grad():
        out = {case["id"]: run_case(case, samplings) for case in cases}
    with open(out_path, "w") as f:
        json.dump(out, f)


main()
