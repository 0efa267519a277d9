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


class _Patcher:
    """What ``comfy.samplers.KSampler`` and ``comfy.sample`` ask a ModelPatcher for."""

    def __init__(self, objects: dict):
        self.objects = objects

    def get_model_object(self, name):
        assert name in self.objects, name
        return self.objects[name]


class _Model:
    def __init__(self, sampling):
        self.model_sampling = sampling


def model_stand_ins(sampling, latent_format=None) -> tuple:
    """``(patcher, inner_model)``: stand-ins for ComfyUI's ModelPatcher and BaseModel around ``sampling`` (and
    ``latent_format``), what a worker's guider and ComfyUI's KSampler / samplers read from a loaded model."""
    objects = {"model_sampling": sampling}
    if latent_format is not None:
        objects["latent_format"] = latent_format
    return _Patcher(objects), _Model(sampling)
