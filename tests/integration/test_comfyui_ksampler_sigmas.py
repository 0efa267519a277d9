"""The Fused KSampler's model sampling, sigmas and starting noise equal ComfyUI 0.3.64's bit for bit (CPU, float32):
``comfy.model_sampling`` (SD1.5 eps, SD2 v, discrete flow with shift 3: tables, timestep / sigma, percent_to_sigma,
model input and denoised estimate, noise scaling and its inverse, ``max_denoise``), ``comfy.samplers.KSampler``'s
sigmas for every scheduler x model x steps {1, 4, 9, 30} x denoise {1, 0.6} x a plain sampler and the two kinds
that drop the penultimate sigma (plus denoise 0), ``comfy.sample.prepare_noise`` with and without ``batch_index``,
and ``fix_empty_latent_channels``. The worker (``comfy_ksampler_sigmas.py``) runs both sides in ComfyUI's
interpreter, so both use the same torch build.
"""
import itertools
import os

import pytest

from leandiffusion.sampling.ksampler.schedulers import SCHEDULER_NAMES
from leandiffusion.tests.kit.comfy_worker import run_comfy_worker

pytestmark = pytest.mark.comfyui
WORKER = os.path.join(os.path.dirname(__file__), "comfy_ksampler_sigmas.py")
MODELS = ("sd15-eps", "sd2-v", "flow-shift3")


def _cases() -> list[dict]:
    cases = [{"id": f"model-{m}", "kind": "model", "model": m} for m in MODELS]
    grid = itertools.product(MODELS, SCHEDULER_NAMES, (1, 4, 9, 30), (1.0, 0.6), ("euler", "dpm_2", "uni_pc_bh2"))
    cases += [{"id": f"sigmas-{m}-{sch}-{steps}-d{d:g}-{smp}", "kind": "sigmas", "model": m, "scheduler": sch,
               "steps": steps, "denoise": d, "sampler": smp} for m, sch, steps, d, smp in grid]
    cases += [{"id": f"sigmas-{m}-{sch}-4-d0-euler", "kind": "sigmas", "model": m, "scheduler": sch, "steps": 4,
               "denoise": 0.0, "sampler": "euler"} for m in MODELS for sch in SCHEDULER_NAMES]
    noise = [((2, 4, 8, 8), 0, None), ((2, 4, 8, 8), 123, None), ((3, 16, 5, 7), 0xFFFFFFFFFFFFFFFF, None),
             ((2, 4, 8, 8), 123, [0, 1]), ((2, 4, 8, 8), 123, [3, 1]), ((3, 16, 5, 7), 9, [2, 2, 0])]
    cases += [{"id": f"noise-{'x'.join(map(str, shape))}-s{seed}-{index}", "kind": "noise", "shape": shape,
               "seed": seed, "batch_index": index} for shape, seed, index in noise]
    empty = [((2, 4, 8, 8), 16, False), ((1, 16, 4, 4), 4, False), ((1, 4, 8, 8), 16, True), ((1, 4, 8, 8), 4, False)]
    cases += [{"id": f"empty-{'x'.join(map(str, shape))}-to{c}-{'nonzero' if nz else 'zero'}", "kind": "empty",
               "shape": shape, "channels": c, "nonzero": nz} for shape, c, nz in empty]
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_comfy_worker(WORKER, tmp_path_factory.mktemp("ksampler_sigmas"), CASES, timeout=600)


@pytest.mark.parametrize("case", [c["id"] for c in CASES])
def test_equals_comfyui_bit_for_bit(results, case):
    checks = results[case]
    assert checks, "the worker must have compared something"
    different = {name: c for name, c in checks.items() if not c["equal"]}
    assert not different, different
    assert all(c["shapes"][0] == c["shapes"][1] and c["max_abs"] == 0.0 for c in checks.values())
