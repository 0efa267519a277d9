"""Run by ComfyUI's interpreter (not collected by pytest): ComfyUI's own samplers and schedulers driving Qwen-Image
(here a tiny random one ComfyUI cannot load) against the pack's Fused KSampler.

``python comfy_ksampler_qwen.py COMFYUI_PATH PACK_PARENT CASES_JSON OUT_JSON``. The reference is ComfyUI's code path
below core KSampler with the model replaced: the model sampling ComfyUI's loader gives Qwen-Image (read from ComfyUI:
``model_base.model_sampling`` of ``supported_models.QwenImage`` with ``model_base.QwenImage``'s default model type,
ModelSamplingFlux + CONST at shift 1.15), ``comfy.samplers.KSampler`` (its sigmas: scheduler, penultimate-sigma and
denoise rules), ``comfy.sample.fix_empty_latent_channels`` / ``prepare_noise`` on ComfyUI's one-frame
``[B, 16, 1, h, w]`` LATENT, ``comfy.samplers.sampler_object(name).sample`` (noise scaling, the sampler, inverse
scaling), the Wan 2.1 latent format's ``process_in`` / ``process_out`` as ``inner_sample`` applies them (a zero
latent stays zero), and ComfyUI's cfg combine on CONST denoised values (``model_sampling.calculate_denoised``), as
``BaseModel._apply_model`` feeds the model (``calculate_input``, ``timestep(sigma)``). The model inside is
diffusers' transformer loaded by diffusers' ``QwenImagePipeline`` from the tiny folder, its latents packed by the
pipeline's own helpers, conditioned on the pipeline's own ``encode_prompt`` per side (the issue's "driving our
denoiser": the DiT itself). The pack's side: ``LeanKSampler`` on an engine loaded from the same folder, given the
prompt strings, or CONDITIONING holding the pipeline's prompt embeddings.
"""
import inspect
import json
import os
import sys
import tempfile

comfy_path, pack_parent, cases_path, out_path = sys.argv[1:5]
sys.path.insert(0, comfy_path)
sys.argv = [sys.argv[0], "--cpu"]

import comfy.options  # noqa: E402

comfy.options.enable_args_parsing()
import torch  # noqa: E402

import comfy.model_base  # noqa: E402
import comfy.sample  # noqa: E402
import comfy.samplers  # noqa: E402
import comfy.supported_models  # noqa: E402

sys.path.insert(0, pack_parent)
from diffusers import QwenImagePipeline  # noqa: E402

from leandiffusion.memory.load import load_engine  # noqa: E402
from leandiffusion.memory.tiny_qwen_image import build_tiny_qwen_image, save_qwen_image_folder  # noqa: E402
from leandiffusion.nodes.ksampler import LeanKSampler  # noqa: E402
from leandiffusion.tests.kit.comfy_samplings import model_stand_ins  # noqa: E402

models = tempfile.mkdtemp()
folder = save_qwen_image_folder(build_tiny_qwen_image(seed=1), os.path.join(models, "diffusers", "tiny-qwen"))
os.environ["LEANDIFFUSION_MODELS"] = models
engine = load_engine("tiny-qwen", "full", weight_dtype="fp32", vae_dtype="fp32", device="cpu")
pipe = QwenImagePipeline.from_pretrained(str(folder), local_files_only=True)

config = comfy.supported_models.QwenImage({"image_model": "qwen_image"})
model_type = inspect.signature(comfy.model_base.QwenImage.__init__).parameters["model_type"].default
sampling = comfy.model_base.model_sampling(config, model_type)
latent_format = config.latent_format
assert torch.allclose(latent_format.latents_mean.flatten(), torch.tensor(pipe.vae.config.latents_mean))


patcher, base = model_stand_ins(sampling, latent_format)


class Guider:
    """What KSAMPLER.sample's samplers call: denoised = ComfyUI's cfg combine of CONST denoised values."""
    inner_model, model_patcher = base, patcher

    def __init__(self, sides, cfg):
        self.sides, self.cfg = sides, cfg

    def denoised(self, x, sigma, side):
        embeds, mask = side
        b, c, _, h, w = x.shape
        xc = sampling.calculate_input(sigma, x)[:, :, 0]
        tokens = QwenImagePipeline._pack_latents(xc, b, c, h, w)
        t = sampling.timestep(sigma).float().expand(b)
        with torch.no_grad():
            out = pipe.transformer(hidden_states=tokens, timestep=t, encoder_hidden_states=embeds,
                                   encoder_hidden_states_mask=mask, img_shapes=[[(1, h // 2, w // 2)]] * b,
                                   return_dict=False)[0]
        out = QwenImagePipeline._unpack_latents(out, h * 8, w * 8, 8).float()  # [B, 16, 1, h, w]
        return sampling.calculate_denoised(sigma, out, x)

    def __call__(self, x, sigma, model_options=None, seed=None):
        if self.cfg == 1.0:
            return self.denoised(x, sigma, self.sides[0])
        dc, du = (self.denoised(x, sigma, side) for side in self.sides)
        return du + (dc - du) * self.cfg


PROMPTS = ("a lighthouse at dusk, oil painting", "blurry, dark")
results = {}
for case in json.loads(open(cases_path).read()):
    b, h, w = case["batch"], case["h"], case["w"]
    sides = [pipe.encode_prompt(p, device="cpu", num_images_per_prompt=b) for p in PROMPTS]
    g = torch.Generator().manual_seed(case["latent_seed"])
    samples = torch.randn((b, 16, 1, h, w), generator=g) if case["img2img"] else torch.zeros((b, 16, h, w))
    comfy_latent = comfy.sample.fix_empty_latent_channels(patcher, samples)
    sigmas = comfy.samplers.KSampler(patcher, case["steps"], "cpu", case["sampler"], case["scheduler"],
                                     case["denoise"]).sigmas
    noise = comfy.sample.prepare_noise(comfy_latent, case["seed"])
    latent_in = latent_format.process_in(comfy_latent) if torch.count_nonzero(comfy_latent) > 0 else comfy_latent
    ref = comfy.samplers.sampler_object(case["sampler"]).sample(
        Guider(sides, case["cfg"]), sigmas, {"seed": case["seed"], "model_options": {}}, None, noise, latent_in,
        disable_pbar=True)
    ref = latent_format.process_out(ref.float())
    conds = {}
    if case["conditioning"]:  # ComfyUI's CONDITIONING layout: one row, the template dropped, no mask when unpadded
        conds = {"positive": [[sides[0][0][:1], {"pooled_output": None}]],
                 "negative": [[sides[1][0][:1], {"pooled_output": None}]]}
    ours = LeanKSampler().run(engine, case["seed"], case["steps"], case["cfg"], case["sampler"], case["scheduler"],
                              {"samples": samples}, case["denoise"], "none", positive_prompt=PROMPTS[0],
                              negative_prompt=PROMPTS[1], **conds)[0]["samples"]
    shape_ok = tuple(ours.shape) == tuple(samples.shape)
    if ours.ndim == 4:
        ours = ours.unsqueeze(2)
    results[case["id"]] = {"max_abs": float((ours - ref).abs().max()), "ref_max": float(ref.abs().max()),
                           "shape_ok": shape_ok and tuple(ours.shape) == tuple(ref.shape),
                           "sigma_max": float(sampling.sigma_max), "table": len(sampling.sigmas)}
with open(out_path, "w") as f:
    json.dump(results, f)
