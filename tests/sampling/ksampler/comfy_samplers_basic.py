"""Run by ComfyUI's interpreter (not collected by pytest): ComfyUI 0.3.64's KSAMPLER path against the pack's
``samplers_basic`` and ``step_noise`` on one toy denoiser.

``python comfy_samplers_basic.py COMFYUI_PATH PACK_PARENT CASES_JSON OUT_JSON``. Two kinds of case:
- ``run``: ComfyUI's ``sampler_object(name)`` (``ksampler(name, extra_options)``; ``ddim`` as KSampler maps it) samples
  with the sigmas of ``comfy.samplers.KSampler`` over ``ModelSamplingDiscrete`` + ``EPS`` (SD1.5 betas) or
  ``ModelSamplingDiscreteFlow`` + ``CONST`` (shift 3), drawing its own per-step noise from the seed; the pack's side
  scales the same noise with ComfyUI's rule, draws its noise from ``step_noise`` as the spec's ``noise`` names it and
  runs the spec's function. For the SDE samplers (whose math lives elsewhere) ComfyUI's sampler runs twice: with its
  own Brownian tree and with the pack's ``brownian_noise_sampler``.
- ``noise``: the pack's noise samplers against ComfyUI's ``default_noise_sampler`` and ``BrownianTreeNoiseSampler``
  (``cpu=True``, as its SDE samplers build it) over a query sequence of sigma pairs.
``OUT_JSON`` maps case id -> max abs difference, bit equality, per-step callback differences and model call counts.
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

sys.path.insert(0, pack_parent)
from leandiffusion.sampling.ksampler import samplers_basic, step_noise  # noqa: E402
from leandiffusion.tests.kit.comfy_samplings import model_samplings  # noqa: E402

SHAPE = (2, 4, 6, 5)


def toy_denoiser(counter):
    """A fixed nonlinear map of x and sigma (channel mixing, tanh, sigma-dependent gains); counts its calls."""
    g = torch.Generator().manual_seed(77)
    mix = torch.randn(SHAPE[1], SHAPE[1], generator=g) / SHAPE[1] ** 0.5
    offset = torch.randn(1, SHAPE[1], 1, 1, generator=g) * 0.3

    def denoise(x, sigma):
        counter[0] += 1
        s = sigma.view(-1, 1, 1, 1)
        mixed = torch.einsum("oc,bchw->bohw", mix, x) / (1 + s * s).sqrt()
        return torch.tanh(mixed + offset) * 0.8 + x * (0.25 / (1 + s)) + 0.05 * torch.sin(3 * s) * x.mean()

    return denoise


class ModelWrap:
    """ComfyUI's CFGGuider as KSAMPLER.sample sees it: ``inner_model.model_sampling`` and ``(x, sigma, **kw)``."""

    def __init__(self, denoise, sampling):
        self.denoise = denoise
        self.inner_model = SimpleNamespace(model_sampling=sampling)
        self.model_patcher = SimpleNamespace(get_model_object=lambda name: sampling)

    def __call__(self, x, sigma, model_options=None, seed=None):
        return self.denoise(x, sigma)


class PackSampling:
    """The pack's model-sampling contract over ComfyUI's object (the comparison is about the samplers alone)."""

    def __init__(self, sampling):
        self.inner = sampling
        self.is_flow = isinstance(sampling, cms.CONST)
        self.sigma_min, self.sigma_max = float(sampling.sigma_min), float(sampling.sigma_max)

    def noise_scaling(self, sigma, noise, latent, max_denoise=False):
        return self.inner.noise_scaling(sigma, noise, latent, max_denoise)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def case_sigmas(sampling, case):
    model = SimpleNamespace(get_model_object=lambda name: sampling)
    return comfy.samplers.KSampler(model, case["steps"], "cpu", case["sampler"], case["scheduler"],
                                   case["denoise"]).sigmas


def case_start(case):
    g = torch.Generator().manual_seed(case["seed"])
    noise = torch.randn(SHAPE, generator=g)
    latent = torch.randn(SHAPE, generator=g) * 0.6 if case["denoise"] < 1 else torch.zeros(SHAPE)
    return noise, latent


def comfy_run(case, sampling, sigmas, noise, latent, extra_options):
    count, steps = [0], []
    options = {**case["options"], **extra_options}
    sampler = comfy.samplers.ksampler(case["sampler"], options) if options else \
        comfy.samplers.sampler_object(case["sampler"])  # "ddim" as ComfyUI's KSampler maps it
    out = sampler.sample(ModelWrap(toy_denoiser(count), sampling), sigmas, {"seed": case["seed"], "model_options": {}},
                         lambda i, denoised, x, total: steps.append((i, x.clone(), denoised.clone())), noise.clone(),
                         latent_image=latent, disable_pbar=True)
    return out, steps, count[0]


def pack_run(case, sampling, sigmas, noise, latent):
    count, steps = [0], []
    spec = samplers_basic.SAMPLERS[case["sampler"]]
    full = comfy.samplers.Sampler().max_denoise(ModelWrap(None, sampling), sigmas)
    x = sampling.noise_scaling(sigmas[0], noise, latent, full)
    draws = {"gaussian": lambda: step_noise.gaussian_noise_sampler(x, case["seed"]),
             "brownian": lambda: step_noise.brownian_noise_sampler(x, sigmas, case["seed"], PackSampling(sampling)),
             None: lambda: None}[spec.noise]()
    out = spec.fn(toy_denoiser(count), x, sigmas, sampling=PackSampling(sampling), noise_sampler=draws,
                  callback=lambda i, x_i, d_i: steps.append((i, x_i.clone(), d_i.clone())), **case["options"])
    return sampling.inverse_noise_scaling(sigmas[-1], out), steps, count[0]


def diff(a, b):
    return float((a - b).abs().max()) if a.numel() else 0.0


def compare(theirs, ours, start):
    (a, a_steps, a_calls), (b, b_steps, b_calls) = theirs, ours
    step_diff = max([max(diff(p[1], q[1]), diff(p[2], q[2])) for p, q in zip(a_steps, b_steps)] or [0.0])
    return {"result": diff(a, b), "equal": bool(torch.equal(a, b)), "steps": step_diff,
            "step_indices": [[p[0] for p in a_steps], [q[0] for q in b_steps]], "model_calls": [a_calls, b_calls],
            "moved": diff(a, start), "finite": bool(torch.isfinite(b).all())}


def run_case(case, samplings):
    sampling = samplings[case["kind"]]
    sigmas = case_sigmas(sampling, case)
    noise, latent = case_start(case)
    theirs = comfy_run(case, sampling, sigmas, noise, latent, {})
    if case["sampler"] in samplers_basic.SAMPLERS:
        ours = pack_run(case, sampling, sigmas, noise, latent)
    else:  # an SDE sampler: ComfyUI's math, the pack's Brownian tree
        x = sampling.noise_scaling(sigmas[0], noise, latent, case["denoise"] >= 1)
        tree = step_noise.brownian_noise_sampler(x, sigmas, case["seed"], PackSampling(sampling))
        ours = comfy_run(case, sampling, sigmas, noise, latent, {"noise_sampler": tree})
    return compare(theirs, ours, sampling.noise_scaling(sigmas[0], noise, latent, case["denoise"] >= 1))


def noise_pairs(sigmas):
    """The queries an SDE run makes: each step's pair and a log-midpoint, both orders."""
    pairs = []
    for a, b in zip(sigmas[:-1], sigmas[1:]):
        if a > 0 and b > 0:
            mid = (a.log() + b.log()).div(2).exp()
            pairs += [(a, b), (a, mid), (mid, b), (b, a)]
    return pairs


def noise_case(case):
    dtype = getattr(torch, case["dtype"])
    x = torch.zeros(SHAPE, dtype=dtype)
    if case["noise"] == "gaussian":
        theirs, ours = kds.default_noise_sampler(x, seed=case["seed"]), step_noise.gaussian_noise_sampler(x, case["seed"])
        draws = [(theirs(None, None), ours(None, None)) for _ in range(5)]
    else:
        sigmas = torch.tensor(case["sigmas"], dtype=torch.float32)
        theirs = kds.BrownianTreeNoiseSampler(x, sigmas[sigmas > 0].min(), sigmas.max(), seed=case["seed"], cpu=True)
        ours = step_noise.brownian_noise_sampler(x, sigmas, case["seed"], None)
        draws = [(theirs(a, b), ours(a, b)) for a, b in noise_pairs(sigmas)]
    return {"result": max(diff(a, b) for a, b in draws), "equal": all(torch.equal(a, b) for a, b in draws),
            "dtype": [str(b.dtype) for _, b in draws][0], "count": len(draws),
            "std": float(torch.stack([b.float() for _, b in draws]).std())}


def main():
    cases = json.loads(open(cases_path).read())
    samplings = model_samplings()
    with torch.no_grad():
        out = {case["id"]: run_case(case, samplings) if case["type"] == "run" else noise_case(case) for case in cases}
    with open(out_path, "w") as f:
        json.dump(out, f)


main()
