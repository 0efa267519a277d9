"""The Fused KSampler on Z-Image equals ComfyUI 0.3.64's own samplers and schedulers driving the same DiT through
ComfyUI's discrete-flow model sampling with the model's shift (issue contract: max abs <= 1e-4 on the LATENT, CPU
fp32): every sampler x scheduler txt2img at cfg 1 (Turbo's setting); at cfg 3, txt2img and img2img, every sampler
and every scheduler (``_cases``).

ComfyUI 0.3.64 cannot load Z-Image, so the worker (``comfy_ksampler_flow.py``) runs ComfyUI's code below core
KSampler with diffusers' transformer as the model, called as ZImagePipeline calls it.
"""
import itertools
import os

import pytest

from leandiffusion.sampling.ksampler.settings import SAMPLER_NAMES, SCHEDULER_NAMES
from leandiffusion.tests.kit.comfy_worker import run_comfy_worker

pytestmark = pytest.mark.comfyui
WORKER = os.path.join(os.path.dirname(__file__), "comfy_ksampler_flow.py")
TOL = 1e-4


def _cases() -> list[dict]:
    """Every sampler x scheduler at cfg 1 (one model pass per call: cheap); every sampler with one scheduler and
    every scheduler with one sampler at cfg 3, txt2img and img2img."""
    grid = [(("txt2img", 1.0, 1.0), pair) for pair in itertools.product(SAMPLER_NAMES, SCHEDULER_NAMES)]
    crosses = [(s, "simple") for s in SAMPLER_NAMES] + [("dpmpp_2m_sde", s) for s in SCHEDULER_NAMES if s != "simple"]
    grid += [(mode, pair) for mode in (("txt2img", 3.0, 1.0), ("img2img", 3.0, 0.7)) for pair in crosses]
    cases = []
    for (mode, cfg, denoise), (sampler, scheduler) in grid:
        cases.append({"id": f"{mode}-cfg{cfg:g}-{sampler}-{scheduler}", "img2img": mode == "img2img",
                      "sampler": sampler, "scheduler": scheduler, "steps": 4, "cfg": cfg, "denoise": denoise,
                      "seed": 77, "latent_seed": 3, "batch": 2, "size": 8})
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_comfy_worker(WORKER, tmp_path_factory.mktemp("ksampler_flow"), CASES)


@pytest.mark.parametrize("case", [c["id"] for c in CASES])
def test_latent_equals_comfyuis_samplers_on_the_flow_model(results, case):
    r = results[case]
    assert r["shape_ok"]
    assert r["ref_max"] > 0.1
    assert r["max_abs"] <= TOL, r
