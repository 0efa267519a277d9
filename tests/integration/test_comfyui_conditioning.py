"""ComfyUI 0.3.64's own conditioning nodes into the samplers' ``positive_cond`` / ``negative_cond``.

Invariant: a CONDITIONING either conditions the UNet as ComfyUI's sampler does, or is refused before any model runs
(no text, UNet or VAE session opened) with an error naming the input, the node that wrote what is unsupported and the
fix -- never sampled with a part of it dropped.

Reference: ComfyUI's interpreter runs ``comfy_conditioning_nodes.py``: the real node code (CLIPTextEncode,
CLIPTextEncodeSDXL and its refiner variant, ConditioningCombine / Concat / Average / ZeroOut / SetArea /
SetAreaPercentage / SetAreaStrength / SetMask / SetTimestepRange / SetProperties, ControlNetApply(Advanced),
GLIGENTextBoxApply, unCLIPConditioning, StyleModelApply) over fixed tiny-width encodings, and for single-entry outputs
what ComfyUI's sampler hands its UNet for a batch of 3 latents of 80 x 64 pixels (``encode_model_conds`` +
``extra_conds``: the cross-attention context and SDXL's ``y`` = pooled output + the size embedding built by
``SDXL.encode_adm``). Supported outputs: the pack's context equals ComfyUI's ``c_crossattn`` bit for bit, and its
pooled output and time ids, embedded by the engine's own UNet time projection, equal ComfyUI's ``y`` (<= 1e-6; both
are float32 sinusoids of the same numbers). One output is also sampled and compared with diffusers' SDXL pipeline
given the node's own sizes (1e-4, as ``tests/sampling/test_sampler_prompts.py``).
"""
import json
import os
import subprocess

import pytest
import torch
from diffusers import DDIMScheduler, StableDiffusionXLPipeline
from safetensors.torch import load_file, save_file

from leandiffusion.nodes.sampler import LeanFusedDDIMSampler
from leandiffusion.runner.local import comfyui_python
from leandiffusion.sampling.conditioning import from_conditioning
from leandiffusion.sampling.stream.scheduler import run_stream
from leandiffusion.sampling.stream.settings import StreamSettings
from leandiffusion.tests.kit import tiny_engine

pytestmark = pytest.mark.comfyui
WORKER = os.path.join(os.path.dirname(__file__), "comfy_conditioning_nodes.py")
BATCH, HEIGHT, WIDTH = 3, 80, 64
SUPPORTED = ["CLIPTextEncode", "CLIPTextEncodeSDXL", "ConditioningConcat", "ConditioningAverage",
             "ConditioningZeroOut", "ConditioningSetTimestepRange 0-1", "ConditioningSetAreaStrength 1",
             "ConditioningSetProperties plain", "ControlNetApplyAdvanced strength 0", "StyleModelApply multiply",
             "batched rows", "SD1 CLIPTextEncode"]
# case -> (the node the message names, the fix it gives): each names its own node; all but the refiner's send the
# user to ComfyUI's KSampler
REFUSED = {case: (case, "KSampler") for case in [
    "ConditioningCombine", "ConditioningSetArea", "ConditioningSetAreaPercentage", "ConditioningSetAreaStrength",
    "ConditioningSetMask", "ConditioningSetTimestepRange", "ConditioningSetProperties", "ControlNetApply",
    "ControlNetApplyAdvanced", "GLIGENTextBoxApply", "unCLIPConditioning", "StyleModelApply"]}
REFUSED["CLIPTextEncodeSDXLRefiner"] = ("CLIPTextEncodeSDXLRefiner", "Encode the prompt with CLIPTextEncodeSDXL")


@pytest.fixture(scope="module")
def engines():
    return {"sd1": tiny_engine("sd1"), "sdxl": tiny_engine("sdxl")}


@pytest.fixture(scope="module")
def comfy(engines, tmp_path_factory):
    """``{case: (family, CONDITIONING as the node returned it, ComfyUI's UNet inputs)}`` from ComfyUI's interpreter."""
    folder = tmp_path_factory.mktemp("comfy_conditioning")
    g = torch.Generator().manual_seed(19)
    sdxl, sd1 = engines["sdxl"].parts.unet.config, engines["sd1"].parts.unet.config
    pooled = sdxl.projection_class_embeddings_input_dim - 6 * sdxl.addition_time_embed_dim
    shapes = {"sdxl_a": (1, 77, sdxl.cross_attention_dim), "sdxl_a_pooled": (1, pooled),
              "sdxl_b": (1, 77, sdxl.cross_attention_dim), "sdxl_b_pooled": (1, pooled),
              "sdxl_rows": (2, 77, sdxl.cross_attention_dim), "sdxl_rows_pooled": (2, pooled),
              "style": (1, 8, sdxl.cross_attention_dim), "sd1_a": (1, 77, sd1.cross_attention_dim),
              "sd1_a_pooled": (1, sd1.cross_attention_dim)}
    save_file({k: torch.randn(s, generator=g) for k, s in shapes.items()}, str(folder / "bundle.safetensors"))
    comfy_path = os.environ["COMFYUI_PATH"]
    run = subprocess.run([comfyui_python(comfy_path), WORKER, comfy_path, str(folder / "bundle.safetensors"),
                          str(folder), str(sdxl.addition_time_embed_dim), str(BATCH), str(HEIGHT), str(WIDTH)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    tensors = load_file(str(folder / "tensors.safetensors"))
    cases = {}
    for name, case in json.loads((folder / "cases.json").read_text()).items():
        conditioning = []
        for i, described in enumerate(case["entries"]):
            extras = {}
            for key, value in described.items():
                if "tensor" in value:
                    extras[key] = tensors[value["tensor"]]
                elif "json" in value:
                    extras[key] = value["json"]
                else:  # a model or ControlNet object: only its type reaches the pack's message
                    extras[key] = type(value["object"], (), {})()
            conditioning.append([tensors[f"{name}/{i}/cond"], extras])
        inputs = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith(f"{name}/") and k.count("/") == 1}
        cases[name] = (case["family"], conditioning, inputs)
    assert set(cases) == set(SUPPORTED) | set(REFUSED)
    return cases


def _added_embedding(engine, conditioning) -> torch.Tensor:
    """The SDXL UNet's added-embedding input for the pack's pooled output and time ids (diffusers' ``text_time``)."""
    time = engine.parts.unet.add_time_proj(conditioning.time_ids.flatten()).reshape(conditioning.pooled.shape[0], -1)
    return torch.cat([conditioning.pooled.float(), time.float()], dim=-1)


@pytest.mark.parametrize("case", SUPPORTED)
def test_supported_output_conditions_the_unet_as_comfyui(comfy, engines, case):
    family, conditioning, theirs = comfy[case]
    engine = engines[family]
    ours = from_conditioning(conditioning, engine, BATCH, width=WIDTH, height=HEIGHT)
    assert torch.equal(ours.context, theirs["c_crossattn"])
    if family == "sd1":
        assert "y" not in theirs and ours.pooled is None and ours.time_ids is None
        return
    diff = (_added_embedding(engine, ours) - theirs["y"]).abs().max().item()
    assert diff <= 1e-6, f"{case}: added embedding differs from ComfyUI's y by {diff:.3g}"


def test_size_keys_move_the_added_embedding(comfy, engines):
    """Guard for the comparison above: CLIPTextEncodeSDXL's sizes (same text encoding) change ComfyUI's ``y``."""
    plain, sized = comfy["CLIPTextEncode"][2]["y"], comfy["CLIPTextEncodeSDXL"][2]["y"]
    assert (plain - sized).abs().max().item() > 0.1


def test_clip_text_encode_sdxl_samples_as_diffusers_with_the_node_sizes(comfy, engines):
    """The Fused DDIM Sampler on CLIPTextEncodeSDXL's output (negative: ConditioningZeroOut, image-size defaults)
    against diffusers' SDXL pipeline given the sizes typed into the node."""
    engine = engines["sdxl"]
    positive, negative = comfy["CLIPTextEncodeSDXL"][1], comfy["ConditioningZeroOut"][1]
    ours = LeanFusedDDIMSampler().run(lean_model=engine, positive="", negative="", seed=7, steps=2, cfg=5.0, eta=0.0,
                                      width=WIDTH, height=HEIGHT, batch_size=1, timestep_spacing="leading",
                                      cfg_mode="batched", acceleration="none", positive_cond=positive,
                                      negative_cond=negative)[0]["samples"]
    p = engine.parts
    pipe = StableDiffusionXLPipeline(vae=p.vae, text_encoder=p.text_encoder, text_encoder_2=p.text_encoder_2,
                                     tokenizer=p.tokenizer, tokenizer_2=p.tokenizer_2, unet=p.unet,
                                     scheduler=DDIMScheduler(**p.scheduler_config), add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        ref = pipe(num_inference_steps=2, guidance_scale=5.0, width=WIDTH, height=HEIGHT,
                   generator=torch.Generator("cpu").manual_seed(7), output_type="latent",
                   prompt_embeds=positive[0][0], pooled_prompt_embeds=positive[0][1]["pooled_output"],
                   negative_prompt_embeds=negative[0][0],
                   negative_pooled_prompt_embeds=negative[0][1]["pooled_output"],
                   original_size=(1200, 1000), crops_coords_top_left=(40, 24), target_size=(1104, 1016),
                   negative_original_size=(HEIGHT, WIDTH), negative_target_size=(HEIGHT, WIDTH)).images
    diff = (ours - ref / p.vae_scaling_factor).abs().max().item()
    assert diff <= 1e-4, f"max abs diff {diff:.3g}"


@pytest.mark.parametrize("side", ["positive_cond", "negative_cond"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_before_any_model_runs_naming_the_node(comfy, engines, opened_sessions, case, side):
    family, conditioning, _ = comfy[case]
    engine, (node, fix) = engines[family], REFUSED[case]
    fused = dict(lean_model=engine, positive="a boat", negative="fog", seed=1, steps=2, cfg=5.0, eta=0.0, width=WIDTH,
                 height=HEIGHT, batch_size=1, timestep_spacing="leading", cfg_mode="batched", acceleration="none")
    stream = StreamSettings.from_text("a boat", negative="fog", seed=1, steps=2, cfg=5.0, width=WIDTH, height=HEIGHT,
                                      acceleration="none")
    for run in (lambda: LeanFusedDDIMSampler().run(**fused, **{side: conditioning}),
                lambda: run_stream(engine, stream, quiet=True, **{side: conditioning})):
        with pytest.raises(ValueError) as err:
            run()
        message = str(err.value)
        assert message.startswith(f"{side}: ") and node in message and fix in message, message
        assert opened_sessions == [], f"{case}: sessions opened before the error: {opened_sessions}"
