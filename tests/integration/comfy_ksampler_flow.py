"""Run by ComfyUI's interpreter (not collected by pytest): ComfyUI's own samplers and schedulers driving Z-Image
(which ComfyUI 0.3.64 cannot load) against the pack's Fused KSampler.

``python comfy_ksampler_flow.py COMFYUI_PATH PACK_PARENT CASES_JSON OUT_JSON``. The reference is ComfyUI's code path
below core KSampler with the model replaced: ``comfy.samplers.KSampler`` (its sigmas: scheduler, penultimate-sigma
and denoise rules), ``comfy.sample.prepare_noise``, ``comfy.samplers.sampler_object(name).sample`` (noise scaling,
the k-diffusion / UniPC sampler, inverse scaling) over ComfyUI's ``ModelSamplingDiscreteFlow`` + ``CONST`` with
Z-Image's shift 3, and ComfyUI's cfg combine on denoised values. The model inside is the pack's own DiT forward (the issue's "driving
our denoiser"; ``sampling.flow.dit_forward``, itself checked against diffusers' ``ZImageTransformer2DModel`` in
``tests/sampling/flow``), cond and uncond rows batched in one call as ComfyUI batches them, at the timestep ``ZImagePipeline`` gives (``(1000 - 1000 sigma) /
1000``) with its output negated to a velocity, on the tiny random Z-Image; the latent goes in and out through the
Flux latent format as ComfyUI's ``inner_sample`` moves it (a zero latent stays zero). The pack's side: ``LeanKSampler`` on an engine over
the same modules, given CONDITIONING holding the same caption features.
"""
import json
import sys

comfy_path, pack_parent, cases_path, out_path = sys.argv[1:5]
sys.path.insert(0, comfy_path)
sys.argv = [sys.argv[0], "--cpu"]

import comfy.options  # noqa: E402

comfy.options.enable_args_parsing()
import torch  # noqa: E402

import comfy.model_sampling  # noqa: E402
import comfy.sample  # noqa: E402
import comfy.samplers  # noqa: E402

sys.path.insert(0, pack_parent)
from leandiffusion.memory.load import TINY_ZIMAGE_CHOICE, load_engine  # noqa: E402
from leandiffusion.nodes.ksampler import LeanKSampler  # noqa: E402
from leandiffusion.sampling.flow.dit_forward import ImageGrid, caption_capacity, caption_layout  # noqa: E402
from leandiffusion.sampling.flow.dit_forward import dit_forward  # noqa: E402
from leandiffusion.sampling.flow.text import encode_prompts  # noqa: E402
from leandiffusion.tests.kit.comfy_samplings import model_stand_ins  # noqa: E402

engine = load_engine(TINY_ZIMAGE_CHOICE, weight_dtype="fp32", vae_dtype="fp32", device="cpu")
dit = engine.parts.unet
scale, shift = engine.parts.vae_scaling_factor, engine.parts.vae_shift_factor


class FlowSampling(comfy.model_sampling.ModelSamplingDiscreteFlow, comfy.model_sampling.CONST):
    pass


sampling = FlowSampling()
sampling.set_parameters(shift=float(engine.parts.scheduler_config["shift"]))


patcher, base = model_stand_ins(sampling)


class Guider:
    """What KSAMPLER.sample's samplers call: denoised = cfg combine of ComfyUI's CONST denoised values."""
    inner_model, model_patcher = base, patcher

    def __init__(self, cond, uncond, cfg):
        self.cond, self.uncond, self.cfg = cond, uncond, cfg

    def predictions(self, x, sigma, captions):
        """Velocities for ``x`` repeated once per caption set, in one batched call (ComfyUI's calc_cond_batch
        batches the cond and uncond rows together when their shapes allow)."""
        rows = len(captions)
        xs = x.repeat(rows, 1, 1, 1)
        t = ((1000.0 - sigma * 1000.0) / 1000.0).repeat(rows)
        grid = ImageGrid.of(x.shape[2], x.shape[3], 2)
        flat = [c for c in captions for _ in range(x.shape[0])]
        layout = caption_layout(dit, flat, grid, caption_capacity([len(c) for c in flat]), torch.float32, x.device)
        with torch.no_grad():
            velocity = -dit_forward(dit, xs, t, layout, grid).float()
        return velocity.chunk(rows)

    def __call__(self, x, sigma, model_options=None, seed=None):
        if self.cfg == 1.0:
            (vc,) = self.predictions(x, sigma, [self.cond])
            return sampling.calculate_denoised(sigma, vc, x)
        vc, vu = self.predictions(x, sigma, [self.cond, self.uncond])
        dc, du = sampling.calculate_denoised(sigma, vc, x), sampling.calculate_denoised(sigma, vu, x)
        return du + (dc - du) * self.cfg


cond, uncond = encode_prompts(engine, ["a lighthouse at dusk, oil painting", "blurry"])
results = {}
for case in json.loads(open(cases_path).read()):
    g = torch.Generator().manual_seed(case["latent_seed"])
    shape = (case["batch"], 16, case["size"], case["size"])
    samples = torch.randn(shape, generator=g) if case["img2img"] else torch.zeros(shape)
    sigmas = comfy.samplers.KSampler(patcher, case["steps"], "cpu", case["sampler"], case["scheduler"],
                                     case["denoise"]).sigmas
    noise = comfy.sample.prepare_noise(samples, case["seed"])
    latent_in = (samples - shift) * scale if torch.count_nonzero(samples) > 0 else samples
    guider = Guider(cond, uncond, case["cfg"])
    ref = comfy.samplers.sampler_object(case["sampler"]).sample(
        guider, sigmas, {"seed": case["seed"], "model_options": {}}, None, noise, latent_in, disable_pbar=True)
    ref = ref.float() / scale + shift
    positive, negative = [[cond[None], {}]], [[uncond[None], {}]]
    ours = LeanKSampler().run(engine, case["seed"], case["steps"], case["cfg"], case["sampler"], case["scheduler"],
                              {"samples": samples}, case["denoise"], "none", positive=positive,
                              negative=negative)[0]["samples"]
    results[case["id"]] = {"max_abs": float((ours - ref).abs().max()), "ref_max": float(ref.abs().max()),
                           "shape_ok": tuple(ours.shape) == tuple(ref.shape)}
with open(out_path, "w") as f:
    json.dump(results, f)
