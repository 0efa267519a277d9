"""ComfyUI's own model samplings for the comparison workers (imported only under ComfyUI's interpreter, after the
worker has set ComfyUI's arguments up; ``comfy_worker.run_comfy_worker`` runs them).

Invariant: each class is the pair of ``comfy.model_sampling`` classes ComfyUI's model loader mixes for that kind of
model, with ComfyUI's own defaults (SD1.5's betas for the discrete ones), so a worker compares the pack against
exactly what ComfyUI samples with. Why one module: every worker compares against the same ComfyUI objects.
"""
import comfy.model_sampling as cms


class EpsSampling(cms.ModelSamplingDiscrete, cms.EPS):
    """SD1.x / SDXL: the discrete schedule, epsilon prediction."""


class VSampling(cms.ModelSamplingDiscrete, cms.V_PREDICTION):
    """SD2-v: the discrete schedule, v prediction."""


class FlowSampling(cms.ModelSamplingDiscreteFlow, cms.CONST):
    """Z-Image: the discrete flow schedule, CONST noise rule."""


def flow_sampling(shift: float = 3.0) -> FlowSampling:
    """The discrete flow at a static ``shift`` (Z-Image-Turbo's is 3.0)."""
    sampling = FlowSampling()
    sampling.set_parameters(shift=shift)
    return sampling


def model_samplings() -> dict:
    """``{"eps": SD1.5 eps, "flow": flow at shift 3}``: the two sigma scales the sampler workers run on."""
    return {"eps": EpsSampling(), "flow": flow_sampling()}
