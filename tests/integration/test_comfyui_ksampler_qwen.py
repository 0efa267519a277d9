"""The Fused KSampler on Qwen-Image equals ComfyUI 0.3.64's own samplers and schedulers driving the same transformer
through the model sampling ComfyUI gives Qwen-Image (ModelSamplingFlux + CONST, shift 1.15, read from ComfyUI's
own model classes) with its plain cfg (issue contract: max abs <= 1e-4 on the LATENT, CPU fp32): every sampler x
scheduler txt2img at cfg 2.5 from an empty 4-D latent; every sampler with one scheduler and every scheduler with one
sampler img2img (denoise 0.7) from ComfyUI's one-frame ``[B, 16, 1, h, w]`` LATENT, at cfg 2.5 and at cfg 1;
prompt strings and CONDITIONING (``_cases``).

ComfyUI cannot load the tiny Qwen-Image, so the worker (``comfy_ksampler_qwen.py``) runs ComfyUI's code below core
KSampler with diffusers' transformer as the model, conditioned by diffusers' ``QwenImagePipeline.encode_prompt``.
"""
import itertools
import os

import pytest

from leandiffusion.sampling.ksampler.settings import SAMPLER_NAMES, SCHEDULER_NAMES
from leandiffusion.tests.kit.comfy_worker import run_comfy_worker

pytestmark = pytest.mark.comfyui
WORKER = os.path.join(os.path.dirname(__file__), "comfy_ksampler_qwen.py")
TOL = 1e-4


def _cases() -> list[dict]:
    grid = [(("txt2img", 2.5, 1.0, False), pair) for pair in itertools.product(SAMPLER_NAMES, SCHEDULER_NAMES)]
    crosses = [(s, "simple") for s in SAMPLER_NAMES] + [("dpmpp_2m_sde", s) for s in SCHEDULER_NAMES if s != "simple"]
    grid += [(mode, pair) for mode in (("img2img", 2.5, 0.7, False), ("img2img", 1.0, 0.7, False)) for pair in crosses]
    grid += [(("txt2img", 2.5, 1.0, True), ("euler", "simple")), (("img2img", 2.5, 0.7, True), ("uni_pc", "beta"))]
    cases = []
    for (mode, cfg, denoise, conditioning), (sampler, scheduler) in grid:
        cases.append({"id": f"{mode}-cfg{cfg:g}-{sampler}-{scheduler}{'-cond' if conditioning else ''}",
                      "img2img": mode == "img2img", "sampler": sampler, "scheduler": scheduler, "steps": 4,
                      "cfg": cfg, "denoise": denoise, "seed": 77, "latent_seed": 3, "batch": 2, "h": 6, "w": 4,
                      "conditioning": conditioning})
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_comfy_worker(WORKER, tmp_path_factory.mktemp("ksampler_qwen"), CASES)


def test_the_model_sampling_is_comfyuis_flux_one(results):
    """Guards the premise: ComfyUI 0.3.64 samples Qwen-Image as Flux (a 10000-entry table up to sigma 1)."""
    first = next(iter(results.values()))
    assert first["table"] == 10000 and first["sigma_max"] == 1.0


@pytest.mark.parametrize("case", [c["id"] for c in CASES])
def test_latent_equals_comfyuis_samplers_on_qwen_image(results, case):
    r = results[case]
    assert r["shape_ok"]
    assert r["ref_max"] > 0.1
    assert r["max_abs"] <= TOL, r
