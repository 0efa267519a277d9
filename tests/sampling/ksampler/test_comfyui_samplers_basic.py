"""``euler``, ``euler_ancestral``, ``heun``, ``dpm_2``, ``lms``, ``ddim``, ``lcm`` and ``res_multistep`` equal ComfyUI
0.3.64's KSAMPLER of the same name (max abs <= 1e-5, CPU fp32, batch 2), each side drawing its own per-step noise from
the seed (the pack's through ``step_noise`` as the sampler's spec names it): discrete eps (SD1.5 betas) and flow
(shift 3, CONST) sigma scales, several step counts, full and partial denoise, ComfyUI's default options and others;
every callback's x and denoised agree and the model is called as often. The SDE samplers run ComfyUI's own math
with the pack's Brownian tree in place of ComfyUI's; the noise samplers alone equal ComfyUI's bit for bit.
ComfyUI's interpreter runs ``comfy_samplers_basic.py``.
"""
import itertools
import os

import pytest

from leandiffusion.tests.kit.comfy_worker import run_comfy_worker

pytestmark = pytest.mark.comfyui
WORKER = os.path.join(os.path.dirname(__file__), "comfy_samplers_basic.py")
TOL = 1e-5
BASIC = ["euler", "euler_ancestral", "heun", "dpm_2", "lms", "ddim", "lcm", "res_multistep"]
SDE = ["dpmpp_sde", "dpmpp_2m_sde", "dpmpp_3m_sde"]
SCHEDULERS = {"eps": ("karras", "normal"), "flow": ("simple", "beta")}
OPTIONS = [("euler_ancestral", {"eta": 0.0}), ("euler_ancestral", {"eta": 0.5, "s_noise": 0.6}),
           ("euler_ancestral", {"eta": 1.7}),  # eta > 1: the ancestral step can reach 0 before the last sigma
           ("lms", {"order": 1}), ("lms", {"order": 2}), ("lms", {"order": 6})]
KARRAS_LIKE = [14.6146, 9.1, 5.2, 2.7, 1.2, 0.45, 0.12, 0.0292, 0.0]
FLOW_LIKE = [1.0, 0.96, 0.88, 0.71, 0.5, 0.27, 0.08, 0.0]


def _run(kind, sampler, scheduler, steps, denoise, options=None, seed=21):
    options = options or {}
    tag = "".join(f"-{k}={v}" for k, v in sorted(options.items()))
    return {"type": "run", "id": f"{kind}-{sampler}-{scheduler}-{steps}-d{denoise:g}{tag}", "kind": kind,
            "sampler": sampler, "scheduler": scheduler, "steps": steps, "denoise": denoise, "options": options,
            "seed": seed}


def _noise(noise, seed, dtype, sigmas=None, label=""):
    return {"type": "noise", "id": f"noise-{noise}-{seed}-{dtype}{label}", "noise": noise, "seed": seed,
            "dtype": dtype, "sigmas": sigmas}


def _cases():
    runs = [_run(kind, sampler, scheduler, steps, denoise)
            for kind, sampler in itertools.product(("eps", "flow"), BASIC) for scheduler in SCHEDULERS[kind]
            for steps in (1, 2, 3, 5, 8) for denoise in (1.0, 0.6)]
    runs += [_run(kind, sampler, SCHEDULERS[kind][0], 6, denoise, options)
             for kind in ("eps", "flow") for sampler, options in OPTIONS for denoise in (1.0, 0.6)]
    runs += [_run(kind, sampler, SCHEDULERS[kind][0], steps, denoise, seed=5)
             for kind in ("eps", "flow") for sampler in SDE for steps in (2, 4, 7) for denoise in (1.0, 0.6)]
    noises = [_noise("gaussian", seed, dtype) for seed in (0, 3, 2 ** 64 - 1) for dtype in ("float32", "float16")]
    noises += [_noise("brownian", seed, dtype, sigmas, label)
               for seed in (0, 9, 2 ** 63 + 11) for dtype in ("float32", "float16")
               for sigmas, label in ((KARRAS_LIKE, "-eps"), (FLOW_LIKE, "-flow"), (KARRAS_LIKE[3:7], "-partial"))]
    return runs + noises


CASES = _cases()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_comfy_worker(WORKER, tmp_path_factory.mktemp("samplers_basic"), CASES, timeout=900)


RUNS = [c for c in CASES if c["type"] == "run"]
NOISES = [c for c in CASES if c["type"] == "noise"]


@pytest.mark.parametrize("case", RUNS, ids=[c["id"] for c in RUNS])
def test_sampler_equals_comfyuis_ksampler(results, case):
    r = results[case["id"]]
    assert r["finite"], r
    assert r["result"] <= TOL, r
    assert r["steps"] <= TOL and r["step_indices"][0] == r["step_indices"][1], r
    assert r["model_calls"][0] == r["model_calls"][1], r
    assert r["moved"] > 1e-3, "the run must change its start for the comparison to mean anything"


@pytest.mark.parametrize("case", NOISES, ids=[c["id"] for c in NOISES])
def test_noise_sampler_equals_comfyuis_bit_for_bit(results, case):
    r = results[case["id"]]
    assert r["equal"] and r["result"] == 0.0, r
    assert r["count"] >= 5 and 0.7 < r["std"] < 1.3, r  # unit-variance draws, several of them
