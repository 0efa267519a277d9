"""``dpmpp_2m``, ``dpmpp_sde``, ``dpmpp_2m_sde``, ``dpmpp_3m_sde`` and ``uni_pc`` equal ComfyUI 0.3.64's sampler
functions of the same name (max abs <= 1e-5, CPU fp32, batch 2) for the same toy denoiser, sigmas, start and noise
sampler: discrete eps (SD1.5 betas) and flow (shift 3, CONST) sigma scales, several step counts, full and partial
denoise, ComfyUI's default options and a few others; every callback's x and denoised agree too, and UniPC leaves the
caller's sigmas as ComfyUI does. The noise sampler is ComfyUI's own, shared by both sides, so this checks the
samplers' math alone. ComfyUI's interpreter runs ``comfy_dpm_unipc.py``.
"""
import itertools
import os

import pytest

from leandiffusion.tests.kit.comfy_worker import run_comfy_worker

pytestmark = pytest.mark.comfyui
WORKER = os.path.join(os.path.dirname(__file__), "comfy_dpm_unipc.py")
TOL = 1e-5
NOISE = {"dpmpp_2m": None, "uni_pc": None, "dpmpp_sde": "brownian", "dpmpp_2m_sde": "brownian",
         "dpmpp_3m_sde": "brownian"}
SCHEDULERS = {"eps": ("karras", "normal"), "flow": ("simple", "beta")}
# options beyond ComfyUI's defaults, on one schedule each (eta 0 makes the SDE samplers ODE solvers)
OPTIONS = [("dpmpp_sde", {"eta": 0.0}), ("dpmpp_sde", {"eta": 0.6, "s_noise": 0.8, "r": 0.3}),
           ("dpmpp_2m_sde", {"eta": 0.0}), ("dpmpp_2m_sde", {"solver_type": "heun"}),
           ("dpmpp_2m_sde", {"eta": 0.5, "s_noise": 1.3}), ("dpmpp_3m_sde", {"eta": 0.0}),
           ("dpmpp_3m_sde", {"eta": 0.7, "s_noise": 0.9})]


def _case(kind, sampler, scheduler, steps, denoise, options=None, noise=None, seed=11):
    options = options or {}
    tag = ",".join(f"{k}={v}" for k, v in sorted(options.items()))
    noise = noise or NOISE[sampler]
    return {"id": f"{kind}-{sampler}-{scheduler}-{steps}-d{denoise:g}-{noise}{'-' + tag if tag else ''}",
            "kind": kind, "sampler": sampler, "scheduler": scheduler, "steps": steps, "denoise": denoise,
            "options": options, "noise": noise, "seed": seed}


def _cases():
    cases = [_case(kind, sampler, scheduler, steps, denoise)
             for kind, sampler in itertools.product(("eps", "flow"), NOISE)
             for scheduler in SCHEDULERS[kind] for steps in (1, 2, 3, 4, 7) for denoise in (1.0, 0.6)]
    cases += [_case(kind, sampler, SCHEDULERS[kind][0], 5, denoise, options)
              for kind in ("eps", "flow") for sampler, options in OPTIONS for denoise in (1.0, 0.6)]
    # ComfyUI's samplers take any noise sampler; a seeded Gaussian one drives the same arithmetic
    cases += [_case(kind, sampler, SCHEDULERS[kind][0], 5, 1.0, noise="gaussian")
              for kind in ("eps", "flow") for sampler in ("dpmpp_sde", "dpmpp_2m_sde", "dpmpp_3m_sde")]
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_comfy_worker(WORKER, tmp_path_factory.mktemp("dpm_unipc"), CASES, timeout=900)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_sampler_equals_comfyuis(results, case):
    r = results[case["id"]]
    assert r["finite"], r
    assert r["result"] <= TOL, r
    assert r["steps"] <= TOL and r["same_step_indices"], r
    assert r["sigmas_after"] == 0.0, r
    assert r["model_calls"][0] == r["model_calls"][1], r
    if r["n_sigmas"] > 2 or case["sampler"] != "uni_pc":  # one-step UniPC only rescales (ComfyUI's order 0)
        assert r["moved"] > 1e-3, "the run must change the start for the comparison to mean anything"

