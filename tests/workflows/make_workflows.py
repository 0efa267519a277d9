"""Write the shipped workflows: ``workflows/NAME.json`` (editor), ``NAME.jpg``, ``workflows_api/NAME.api.json`` (API).

The API files live outside ``workflows/`` because ComfyUI's template browser lists every ``*.json`` there and an
API-format file opens as an empty canvas.

    python -m leandiffusion.tests.workflows.make_workflows [--check]

Each workflow is declared once below (nodes, their values by input name, links by input name, layout column/row,
groups); the files are derived from the node specs (``specs.combined()``: the pack's declarations plus the recorded
ComfyUI core snapshot), so ``widgets_values`` follow each node's declared widget order, with the editor's
``control_after_generate`` value after a seed and the upload value after LoadImage's image. A node or input the pack
does not declare yet (work in progress on another branch) is taken from ``PROVISIONAL`` below, which holds what the
issue contracts say; ``--check`` reports which ones were needed and whether the files on disk are current.
The consistency test never uses ``PROVISIONAL``: it checks the committed files against the real declarations.

Thumbnails are diagrams drawn with Pillow's bundled font (deterministic for one Pillow version).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leandiffusion.runner.convert import input_names, widget_slots

from .specs import API_WORKFLOWS_DIR, WORKFLOWS_DIR, combined

SAMPLING_STR = {"tooltip": "provisional (issue contract)"}
PROVISIONAL_INPUTS = {  # (node, section, name) -> conf: the samplers' positive_cond / negative_cond
    ("LeanFusedDDIMSampler", "optional", "positive_cond"): ["CONDITIONING", SAMPLING_STR],
    ("LeanFusedDDIMSampler", "optional", "negative_cond"): ["CONDITIONING", SAMPLING_STR],
}
PROVISIONAL_NODES = {  # the LeanStreamSampler, inputs in the contract's order
    "LeanStreamSampler": {
        "input": {"required": {
            "lean_model": ["LEAN_MODEL", SAMPLING_STR],
            "prompts": ["STRING", {"multiline": True}],
            "negative": ["STRING", {"multiline": True}],
            "seed": ["INT", {"default": 0, "min": 0, "max": 2 ** 64 - 1, "control_after_generate": True}],
            "steps": ["INT", {"default": 30, "min": 1, "max": 1000}],
            "cfg": ["FLOAT", {"default": 7.5, "min": 0.0, "max": 30.0}],
            "width": ["INT", {"default": 512, "min": 64, "max": 8192, "step": 8}],
            "height": ["INT", {"default": 512, "min": 64, "max": 8192, "step": 8}],
            "timestep_spacing": [["leading", "trailing", "linspace"], {"default": "leading"}],
            "acceleration": [["none", "cuda_graph", "compile+cuda_graph"], {"default": "cuda_graph"}],
            "images_per_prompt": ["INT", {"default": 1, "min": 1, "max": 64}],
            "max_batch": ["INT", {"default": 0, "min": 0, "max": 64}],
            "decode_tile_size": ["INT", {"default": 0, "min": 0, "max": 4096}],
        }, "optional": {
            "positive_cond": ["CONDITIONING", SAMPLING_STR],
            "negative_cond": ["CONDITIONING", SAMPLING_STR],
        }},
        "output": ["IMAGE", "LATENT"], "output_name": ["IMAGE", "LATENT"], "display_name": "Stream Scheduler Sampler",
        "category": "LeanDiffusion/sampling",
    },
}
PACK_COLOR, CORE_COLOR = ("#2a5a58", "#1e3b3a"), ("#353535", "#262626")
NOTE_COLOR = ("#432", "#653")


@dataclass
class N:
    """One node: ``values`` by input name (widgets), ``links`` input name -> (source node id, output slot)."""
    id: int
    type: str
    col: int
    row: int = 0
    values: dict = field(default_factory=dict)
    links: dict = field(default_factory=dict)
    title: str | None = None
    width: int | None = None


@dataclass
class W:
    name: str
    title: str
    nodes: list
    groups: list  # (title, [node ids], color)
    note: str


NEG = "blurry, low quality, deformed, watermark, text"
SD15 = "v1-5-pruned-emaonly.safetensors"
SDXL = "sd_xl_base_1.0.safetensors"


def _sampler(nid, col, positive, negative=NEG, links=None, **values):
    base = {"positive": positive, "negative": negative, "seed": 42, "steps": 30, "cfg": 7.5, "eta": 0.0,
            "width": 512, "height": 512, "batch_size": 1, "timestep_spacing": "leading", "cfg_mode": "batched",
            "acceleration": "cuda_graph", "denoise": 1.0}
    base.update(values)
    return N(nid, "LeanFusedDDIMSampler", col, values=base, links=links or {}, width=400)


def _loader(nid, model, policy, budget=4.0, weight="fp16", col=0, row=0):
    return N(nid, "LeanModelLoader", col, row, values={"model": model, "vram_policy": policy, "vram_budget_gb": budget,
                                                       "weight_dtype": weight, "vae_dtype": "auto"})


def _decode(nid, col, samples, model, row=0):
    return N(nid, "LeanTiledVAEDecode", col, row, values={"tile_size": 0, "overlap": 64, "seam_mode": "exact"},
             links={"samples": samples, "lean_model": model})


def _save(nid, col, images, prefix, row=0):
    return N(nid, "SaveImage", col, row, values={"filename_prefix": prefix}, links={"images": images}, width=340)


QWEN_EDIT_INSTRUCTION = ("replace the background with a sunlit beach at golden hour, keep the subject, its pose and "
                         "its lighting unchanged")


def _qwen_edit_loader(nid):
    return N(nid, "LeanSplitModelLoader", 0, values={
        "diffusion_model": "qwen_image_edit_2509_bf16.safetensors", "text_encoder": "qwen_2.5_vl_7b.safetensors",
        "vae": "qwen_image_vae.safetensors", "vram_policy": "auto", "vram_budget_gb": 12.0, "weight_dtype": "auto",
        "vae_dtype": "auto"}, width=360)


WORKFLOWS = [
    W("quickstart", "Quickstart: tiny model, runs anywhere", [
        _loader(1, "tiny-random (test)", "auto", weight="auto"),
        _sampler(2, 1, "a lighthouse on a rocky cliff at sunset, watercolor", "blurry, low quality", steps=20,
                 links={"lean_model": (1, 0)}),
        _decode(3, 2, (2, 0), (1, 0)),
        _save(4, 3, (3, 0), "leandiffusion_quickstart"),
    ], [("Load", [1], "#3f789e"), ("Sample", [2], "#8A8"), ("Decode and save", [3, 4], "#b58b2a")],
        "Quickstart. 'tiny-random (test)' is a tiny random model built in memory: the picture is noise, but every "
        "node runs, on any machine. Pick a real checkpoint in the loader for real images."),
    W("sdxl_4gb_product_shot", "SDXL in a 4 GB budget: product shot, LoRA, 2x ESRGAN", [
        _loader(1, SDXL, "stream", 4.0),
        N(2, "LeanLoraInjector", 1, values={"lora_name": "sdxl_product_photography.safetensors", "strength": 0.8,
                                             "strength_text_encoder": 1.0, "target_blocks": "mid_block, up_blocks.2",
                                             "mode": "unmerged"}, links={"lean_model": (1, 0)}),
        _sampler(3, 2, "knolling photograph of a disassembled mechanical wristwatch, exploded view, every gear, "
                       "spring and screw laid out in a neat grid on a matte white surface, top-down view, soft "
                       "studio lighting, product photography, sharp focus, highly detailed",
                 "blurry, cluttered, messy, overlapping parts, text, watermark, logo, low quality, deformed",
                 seed=1234, width=1024, height=1024, links={"lean_model": (2, 0)}),
        _decode(4, 3, (3, 0), (1, 0)),
        N(5, "LeanESRGANUpscale", 3, 1, values={"model_name": "4x-UltraSharp.pth", "output_scale": 2.0,
                                                 "device": "auto", "tile_size": 0, "tile_overlap": 32,
                                                 "precision": "auto"}, links={"image": (4, 0)}),
        _save(6, 4, (5, 0), "leandiffusion_product_shot"),
    ], [("SDXL, weights streamed within 4 GB", [1, 2], "#3f789e"), ("Sample 1024x1024", [3], "#8A8"),
        ("Decode, upscale 2x, save", [4, 5, 6], "#b58b2a")],
        "SDXL at 1024x1024 inside a 4 GB VRAM budget: the 'stream' policy keeps what fits resident and streams the "
        "rest block by block. The LoRA is applied unmerged, only to mid_block and up_blocks.2. Tiled VAE Decode and "
        "the tiled ESRGAN keep the decode and the 2x upscale (to 2048x2048) inside the budget too."),
    W("sd15_fast", "SD1.5, fully resident, torch.compile + CUDA graph", [
        _loader(1, SD15, "full"),
        _sampler(2, 1, "a cozy reading nook by a rainy window, warm lamp light, film photograph, 35mm", seed=7,
                 steps=20, cfg=7.0, batch_size=4, acceleration="compile+cuda_graph", links={"lean_model": (1, 0)}),
        _decode(3, 2, (2, 0), (1, 0)),
        _save(4, 3, (3, 0), "leandiffusion_sd15_fast"),
    ], [("Load (full)", [1], "#3f789e"), ("Sample (compile + CUDA graph)", [2], "#8A8"),
        ("Decode and save", [3, 4], "#b58b2a")],
        "SD1.5 at full speed: everything resident on the GPU, the UNet compiled with torch.compile and each step "
        "replayed as a CUDA graph. The first run compiles (a minute or two); later runs with the same size reuse it."),
    W("lora_hot_swap", "Two LoRAs stacked on different blocks, hot-swappable", [
        _loader(1, SD15, "full"),
        N(2, "LeanLoraInjector", 1, values={"lora_name": "add_detail.safetensors", "strength": 0.6,
                                             "strength_text_encoder": 1.0, "target_blocks": "down_blocks, mid_block",
                                             "mode": "unmerged"}, links={"lean_model": (1, 0)},
          title="Dynamic LoRA Injector (detail)"),
        N(3, "LeanLoraInjector", 2, values={"lora_name": "watercolor_style_sd15.safetensors", "strength": 0.9,
                                             "strength_text_encoder": 1.0,
                                             "target_blocks": "up_blocks.1, up_blocks.2, text_encoder",
                                             "mode": "unmerged"}, links={"lean_model": (2, 0)},
          title="Dynamic LoRA Injector (style)"),
        _sampler(4, 3, "a fox in a misty birch forest at dawn, watercolor painting, loose brush strokes", seed=3,
                 steps=25, links={"lean_model": (3, 0)}),
        _decode(5, 4, (4, 0), (1, 0)),
        _save(6, 5, (5, 0), "leandiffusion_lora_hot_swap"),
    ], [("LoRAs, unmerged", [2, 3], "#a1309b"), ("Sample", [4], "#8A8"), ("Decode and save", [5, 6], "#b58b2a")],
        "Two LoRAs stacked without merging: a detail LoRA on the down and mid blocks, a style LoRA on the up blocks "
        "and the text encoder. Change a strength and queue again: only the nodes after it re-run, with no reload, "
        "no weight copy and no CUDA-graph recapture."),
    W("batch_catalogue", "Batch catalogue: many prompts pipelined across CUDA streams", [
        _loader(1, SD15, "balanced"),
        N(2, "LeanStreamSampler", 1, values={
            "prompts": "\n".join(f"studio product photo of {p}, centred on a seamless white background, soft "
                                 f"shadow, catalogue photography" for p in (
                                     "a ceramic coffee mug", "a leather backpack", "a pair of wireless headphones",
                                     "a glass perfume bottle", "a running shoe", "a wooden desk lamp")),
            "negative": NEG, "seed": 100, "steps": 25, "cfg": 7.0, "width": 512, "height": 512,
            "timestep_spacing": "leading", "acceleration": "cuda_graph", "images_per_prompt": 2, "max_batch": 0,
            "decode_tile_size": 0}, links={"lean_model": (1, 0)}, width=440),
        _save(3, 2, (2, 0), "leandiffusion_catalogue"),
    ], [("Load", [1], "#3f789e"), ("Encode, denoise and decode, overlapped", [2], "#8A8"),
        ("Save", [3], "#b58b2a")],
        "One prompt per line. The Stream Scheduler Sampler encodes the next batch, denoises this one and decodes "
        "the previous one at the same time on separate CUDA streams. Image n (prompt-major order) is what the Fused "
        "DDIM Sampler gives for its prompt with seed + n and batch size 1."),
    W("image_edit", "Image edit: encode, denoise 0.6, decode", [
        _loader(1, SD15, "balanced"),
        N(2, "LoadImage", 0, 1, values={"image": "example.png"}, width=320),
        N(3, "LeanTiledVAEEncode", 1, values={"tile_size": 0, "overlap": 64, "seam_mode": "exact"},
          links={"pixels": (2, 0), "lean_model": (1, 0)}),
        _sampler(4, 2, "the same scene as an oil painting, thick impasto brush strokes, rich warm colours",
                 seed=5, denoise=0.6, links={"lean_model": (1, 0), "latent_image": (3, 0)}),
        _decode(5, 3, (4, 0), (1, 0)),
        _save(6, 4, (5, 0), "leandiffusion_image_edit"),
    ], [("Load model and image", [1, 2], "#3f789e"), ("Encode and re-sample (denoise 0.6)", [3, 4], "#8A8"),
        ("Decode and save", [5, 6], "#b58b2a")],
        "Image-to-image: the picture is encoded to a latent in tiles, 60% of the schedule is re-run from it "
        "(denoise 0.6: 18 of 30 steps), and the result decoded. Lower denoise keeps more of the original. The "
        "sampler's width and height are ignored when a latent is connected."),
    W("upscale_only", "Upscale an image with ESRGAN", [
        N(1, "LoadImage", 0, values={"image": "example.png"}, width=320),
        N(2, "LeanESRGANUpscale", 1, values={"model_name": "RealESRGAN_x4plus.safetensors", "output_scale": 0.0,
                                              "device": "auto", "tile_size": 0, "tile_overlap": 32,
                                              "precision": "auto"}, links={"image": (1, 0)}),
        _save(3, 2, (2, 0), "leandiffusion_upscaled"),
    ], [("Upscale 4x and save", [2, 3], "#b58b2a")],
        "Upscale any image with an ESRGAN / Real-ESRGAN model from models/upscale_models (output_scale 0 = the "
        "model's native 4x). Tiles see their neighbours as context, so seams do not show; device 'cpu' works "
        "without a GPU."),
    W("z_image_turbo", "Z-Image-Turbo from ComfyUI's split files, inside 6 GB", [
        N(1, "LeanSplitModelLoader", 0, values={
            "diffusion_model": "z_image_turbo_bf16.safetensors", "text_encoder": "qwen_3_4b.safetensors",
            "vae": "ae.safetensors", "vram_policy": "stream", "vram_budget_gb": 6.0, "weight_dtype": "auto",
            "vae_dtype": "auto"}, width=360),
        N(2, "LeanFlowSampler", 1, values={
            "positive": "a cozy mountain cabin at dusk in deep snow, warm light glowing from the windows, pine "
                        "forest, a clear starry sky, photorealistic, 35mm photograph",
            "negative": "", "seed": 42, "steps": 9, "cfg": 1.0, "width": 1024, "height": 1024, "batch_size": 1,
            "acceleration": "cuda_graph", "denoise": 1.0}, links={"lean_model": (1, 0)}, width=400),
        _decode(3, 2, (2, 0), (1, 0)),
        _save(4, 3, (3, 0), "leandiffusion_z_image_turbo"),
    ], [("Z-Image-Turbo, every stage within 6 GB", [1], "#3f789e"), ("Sample 1024x1024, 9 steps", [2], "#8A8"),
        ("Decode and save", [3, 4], "#b58b2a")],
        "Z-Image-Turbo from the files ComfyUI users have: models/diffusion_models/z_image_turbo_bf16.safetensors, "
        "models/text_encoders/qwen_3_4b.safetensors and models/vae/ae.safetensors (fp8 variants load too). The "
        "'stream' policy keeps every stage, the 4B text encoder included, inside 6 GB. Turbo is distilled for 9 "
        "steps at cfg 1 (no negative pass)."),
    W("qwen_image_edit", "Qwen-Image-Edit: one instruction edit from ComfyUI's split files", [
        _qwen_edit_loader(1),
        N(2, "LoadImage", 0, 1, values={"image": "example.png"}, width=320),
        N(3, "LeanEditSampler", 1, values={
            "instruction": QWEN_EDIT_INSTRUCTION, "negative": "", "seed": 42, "steps": 40, "true_cfg": 4.0,
            "megapixels": 1.0, "acceleration": "cuda_graph"}, links={"lean_model": (1, 0), "image": (2, 0)},
          width=400),
        _decode(4, 2, (3, 0), (1, 0)),
        _save(5, 3, (4, 0), "leandiffusion_qwen_image_edit"),
    ], [("Qwen-Image-Edit and the image", [1, 2], "#3f789e"), ("Edit, 40 steps, true CFG 4", [3], "#8A8"),
        ("Decode and save", [4, 5], "#b58b2a")],
        "Qwen-Image-Edit from the files ComfyUI users have: models/diffusion_models/qwen_image_edit_2509_bf16"
        ".safetensors, models/text_encoders/qwen_2.5_vl_7b.safetensors (the whole Qwen2.5-VL, vision tower included: "
        "it reads the picture with the instruction) and models/vae/qwen_image_vae.safetensors (fp8 variants load "
        "too). The Fused Edit Sampler gives diffusers' QwenImageEditPlusPipeline result for the same seed; the "
        "output keeps the picture's aspect ratio at about 1 megapixel."),
    W("qwen_image_edit_batch", "Qwen-Image-Edit: many images, one instruction, pipelined on CUDA streams", [
        _qwen_edit_loader(1),
        N(2, "LoadImage", 0, 1, values={"image": "example.png"}, width=320),
        N(3, "LeanEditStreamSampler", 1, values={
            "instruction": QWEN_EDIT_INSTRUCTION, "negative": "", "seed": 42, "steps": 40, "true_cfg": 4.0,
            "megapixels": 1.0, "acceleration": "cuda_graph", "max_batch": 0, "folder": ""},
          links={"lean_model": (1, 0), "images": (2, 0)}, width=400),
        _save(4, 2, (3, 0), "leandiffusion_qwen_image_edit_batch"),
    ], [("Qwen-Image-Edit and the images", [1, 2], "#3f789e"),
        ("Encode, edit and decode, overlapped", [3], "#8A8"), ("Save", [4], "#b58b2a")],
        "Edits every image with one instruction: the images input (a Load Image batch) and, when folder names one, "
        "every picture in that folder of ComfyUI's input directory (sorted by name). The Stream Edit Sampler "
        "encodes the next batch and decodes the previous one while it denoises this one, on separate CUDA streams; "
        "edit n is exactly the Fused Edit Sampler's edit of that picture with seed + n. Pictures of different "
        "aspect ratios come out as one batch per output size."),
    W("ksampler_core_interop", "Core nodes around the Fused KSampler", [
        N(2, "CheckpointLoaderSimple", 0, 0, values={"ckpt_name": SD15}, width=320),
        _loader(1, SD15, "balanced", row=1),
        N(3, "CLIPTextEncode", 1, 0, values={"text": "a red fox curled up asleep in fresh snow, soft morning light, "
                                                     "wildlife photograph"},
          links={"clip": (2, 1)}, title="CLIP Text Encode (positive)", width=360),
        N(4, "CLIPTextEncode", 1, 1, values={"text": NEG}, links={"clip": (2, 1)},
          title="CLIP Text Encode (negative)", width=360),
        N(5, "EmptyLatentImage", 1, 2, values={"width": 512, "height": 512, "batch_size": 1}),
        N(6, "LeanKSampler", 2, 0, values={
            "seed": 42, "steps": 20, "cfg": 7.0, "sampler_name": "dpmpp_2m", "scheduler": "karras", "denoise": 1.0,
            "acceleration": "cuda_graph", "positive_prompt": "", "negative_prompt": ""},
          links={"lean_model": (1, 0), "positive": (3, 0), "negative": (4, 0), "latent_image": (5, 0)}, width=400),
        N(7, "VAEDecode", 3, 0, links={"samples": (6, 0), "vae": (2, 2)}),
        _save(8, 4, (7, 0), "leandiffusion_ksampler_core_interop"),
    ], [("ComfyUI's loader and text encoding", [2, 3, 4, 5], "#3f789e"), ("Sample", [1, 6], "#8A8"),
        ("ComfyUI's decode, save", [7, 8], "#b58b2a")],
        "The Fused KSampler takes core KSampler's inputs with core KSampler's meaning: the CONDITIONING of ComfyUI's "
        "CLIP Text Encode, a LATENT from Empty Latent Image, the same sampler and scheduler names; with the same "
        "seed it gives core KSampler's latent, faster (the model call replays a CUDA graph). Its LATENT goes "
        "straight into ComfyUI's VAE Decode. The Memory Pool Loader loads the same checkpoint for the sampler."),
    W("comfy_conditioning", "ComfyUI CONDITIONING into the Fused DDIM Sampler", [
        _loader(1, SD15, "balanced"),
        N(2, "CLIPLoader", 0, 1, values={"clip_name": "clip_l.safetensors", "type": "stable_diffusion",
                                          "device": "default"}, width=320),
        N(3, "CLIPTextEncode", 1, 0, values={"text": "(a red vintage bicycle:1.2) leaning against a ((yellow)) "
                                                     "stucco wall, afternoon sun, [blur], street photography"},
          links={"clip": (2, 0)}, title="CLIP Text Encode (positive)", width=360),
        N(4, "CLIPTextEncode", 1, 1, values={"text": NEG}, links={"clip": (2, 0)},
          title="CLIP Text Encode (negative)", width=360),
        _sampler(5, 2, "", "", seed=11, links={"lean_model": (1, 0), "positive_cond": (3, 0),
                                               "negative_cond": (4, 0)}),
        _decode(6, 3, (5, 0), (1, 0)),
        _save(7, 4, (6, 0), "leandiffusion_comfy_conditioning"),
        N(8, "LeanStreamSampler", 2, 1, values={
            "prompts": "", "negative": "", "seed": 11, "steps": 30, "cfg": 7.5, "width": 512, "height": 512,
            "timestep_spacing": "leading", "acceleration": "cuda_graph", "images_per_prompt": 2, "max_batch": 0,
            "decode_tile_size": 0}, links={"lean_model": (1, 0), "positive_cond": (3, 0), "negative_cond": (4, 0)},
          width=400),
        _save(9, 4, (8, 0), "leandiffusion_comfy_conditioning_stream", row=1),
    ], [("ComfyUI text encoding", [2, 3, 4], "#3f789e"), ("Sample", [5, 8], "#8A8"),
        ("Decode and save", [6, 7, 9], "#b58b2a")],
        "Any node that makes a CONDITIONING can drive the pack's samplers: here ComfyUI's own CLIP Text Encode "
        "(clip_l.safetensors is SD1.5's text encoder, in models/text_encoders) feeds the Fused DDIM Sampler and "
        "the Stream Scheduler Sampler. A connected positive_cond / negative_cond replaces the sampler's prompt "
        "text, which is left empty; in the Stream Scheduler Sampler each row of the CONDITIONING is one prompt "
        "(one CLIP Text Encode = one prompt, here 2 images of it, seeds 11 and 12)."),
]


# --------------------------------------------------------------------------------------------- specs
def build_specs() -> tuple[dict, set, list[str]]:
    """(object_info with provisional additions, dynamic combos, the provisional entries that were needed)."""
    info, dynamic = combined()
    info = copy.deepcopy(info)
    used = []
    for name, spec in PROVISIONAL_NODES.items():
        if name not in info:
            spec = copy.deepcopy(spec)
            spec["input_order"] = {k: list(v) for k, v in spec["input"].items()}
            info[name] = spec
            used.append(f"node {name}")
    for (node, section, name), conf in PROVISIONAL_INPUTS.items():
        spec = info.get(node)
        if spec is not None and name not in input_names(spec):
            spec["input"].setdefault(section, {})[name] = conf
            spec.setdefault("input_order", {}).setdefault(section, []).append(name)
            used.append(f"input {node}.{name}")
    return info, dynamic, used


def _provisional(used: list[str]) -> set[tuple[str, str]]:
    """(node, input) pairs taken from the contracts: their sockets are written only where a link uses them."""
    out = {tuple(item.split(" ", 1)[1].split(".", 1)) for item in used if item.startswith("input ")}
    for item in used:
        if item.startswith("node "):
            name = item.split(" ", 1)[1]
            out |= {(name, i) for s in PROVISIONAL_NODES[name]["input"].values() for i in s}
    return out


def _conf(spec, name):
    for section in ("required", "optional"):
        if name in (spec["input"].get(section) or {}):
            conf = spec["input"][section][name]
            return conf[0], (conf[1] if len(conf) > 1 else {}), section == "required"
    raise KeyError(name)


def _is_widget(spec, name):
    return any(name == w for w, _, _ in widget_slots(spec))


def _default(typ, opts):
    if "default" in opts:
        return opts["default"]
    if isinstance(typ, list):
        return typ[0]
    return {"INT": 0, "FLOAT": 0.0, "STRING": "", "BOOLEAN": False}[typ]


# --------------------------------------------------------------------------------------------- layout
COL_GAP, ROW_GAP, TOP, LEFT = 60, 50, 80, 40
SLOT_H, WIDGET_H, MULTILINE_H, TITLE_H = 22, 26, 110, 30


def _node_size(node: N, spec) -> list[int]:
    sockets = [n for n in input_names(spec) if not _is_widget(spec, n)]
    slots = max(len(sockets), len(spec.get("output") or []), 1)
    widgets = 0
    for name, control, _ in widget_slots(spec):
        typ, opts, _ = _conf(spec, name)
        widgets += MULTILINE_H if typ == "STRING" and opts.get("multiline") else WIDGET_H
        widgets += WIDGET_H if control else 0
    if node.type == "LoadImage":
        widgets += WIDGET_H + 260  # upload button + preview
    if node.type == "SaveImage":
        widgets += 240  # image preview
    return [node.width or 320, slots * SLOT_H + widgets + 16]


def _layout(wf: W, specs) -> dict[int, tuple[list[int], list[int]]]:
    sizes = {n.id: _node_size(n, specs[n.type]) for n in wf.nodes}
    cols = sorted({n.col for n in wf.nodes})
    x, xs = LEFT, {}
    for c in cols:
        xs[c] = x
        x += max(sizes[n.id][0] for n in wf.nodes if n.col == c) + COL_GAP
    out = {}
    for c in cols:
        y = TOP
        for n in sorted((n for n in wf.nodes if n.col == c), key=lambda n: n.row):
            out[n.id] = ([xs[c], y], sizes[n.id])
            y += sizes[n.id][1] + TITLE_H + ROW_GAP
    note_y = max(p[1] + s[1] for p, s in out.values()) + TITLE_H + ROW_GAP
    out["note"] = ([LEFT, note_y], [max(640, x - COL_GAP - LEFT), 110])
    return out


# --------------------------------------------------------------------------------------------- files
def _order(wf: W) -> dict[int, int]:
    """Topological execution order, as the editor stores it in each node's ``order``."""
    done, order = set(), {}
    while len(done) < len(wf.nodes):
        for n in wf.nodes:
            if n.id not in done and all(src in done for src, _ in n.links.values()):
                order[n.id] = len(done)
                done.add(n.id)
    return order


def build(wf: W, specs: dict, provisional: set = frozenset()) -> tuple[dict, dict]:
    """(editor workflow, API prompt) for ``wf``."""
    layout = _layout(wf, specs)
    order = _order(wf)
    by_id = {n.id: n for n in wf.nodes}
    links, link_of = [], {}
    for n in sorted(wf.nodes, key=lambda n: order[n.id]):
        for name in input_names(specs[n.type]):
            if name in n.links:
                link_of[(n.id, name)] = len(links) + 1
                src, slot = n.links[name]
                links.append([len(links) + 1, src, slot, n.id, None, _conf(specs[n.type], name)[0]])
    ui_nodes, api = [], {}
    for n in wf.nodes:
        spec = specs[n.type]
        unknown = set(n.values) - set(input_names(spec)) | set(n.links) - set(input_names(spec))
        if unknown:
            raise ValueError(f"{wf.name}: node {n.id} ({n.type}) has no inputs {sorted(unknown)}")
        inputs, widgets, api_inputs = [], [], {}
        for name in input_names(spec):
            typ, opts, required = _conf(spec, name)
            if _is_widget(spec, name):
                if isinstance(typ, list) and name not in n.values and not typ:
                    raise ValueError(f"{wf.name}: node {n.id} ({n.type}) needs a value for file list '{name}'")
                value = n.values[name] if name in n.values else _default(typ, opts)
                widgets.append(value)
                api_inputs[name] = value
                for w, control, upload in widget_slots(spec):
                    if w == name:
                        widgets += ["fixed"] if control else []
                        widgets += ["image"] if upload else []
                continue
            link = link_of.get((n.id, name))
            if link is None and not required and (n.type, name) in provisional:
                continue
            entry = {"name": name, "type": typ, "link": link}
            if not required:
                entry["shape"] = 7
            if link is not None:
                links[link - 1][4] = len(inputs)
                src, slot = n.links[name]
                api_inputs[name] = [str(src), slot]
            inputs.append(entry)
        outputs = []
        for slot, (typ, oname) in enumerate(zip(spec["output"], spec.get("output_name") or spec["output"])):
            used = [rec[0] for rec in links if rec[1] == n.id and rec[2] == slot]
            outputs.append({"name": oname, "type": typ, "links": used or None, "slot_index": slot})
        pos, size = layout[n.id]
        title = n.title or spec.get("display_name") or n.type
        colors = PACK_COLOR if n.type.startswith("Lean") else CORE_COLOR
        ui_nodes.append({"id": n.id, "type": n.type, "pos": pos, "size": size, "flags": {}, "order": order[n.id],
                         "mode": 0, "inputs": inputs, "outputs": outputs, "title": title,
                         "properties": {"Node name for S&R": n.type}, "widgets_values": widgets,
                         "color": colors[0], "bgcolor": colors[1]})
        api[str(n.id)] = {"inputs": api_inputs, "class_type": n.type, "_meta": {"title": title}}
    note_id = max(by_id) + 1
    pos, size = layout["note"]
    ui_nodes.append({"id": note_id, "type": "Note", "pos": pos, "size": size, "flags": {}, "order": len(wf.nodes),
                     "mode": 0, "inputs": [], "outputs": [], "title": "About this workflow",
                     "properties": {"text": ""}, "widgets_values": [wf.note],
                     "color": NOTE_COLOR[0], "bgcolor": NOTE_COLOR[1]})
    groups = []
    for gid, (title, members, color) in enumerate(wf.groups, 1):
        x0 = min(layout[m][0][0] for m in members) - 15
        y0 = min(layout[m][0][1] for m in members) - TITLE_H - 45
        x1 = max(layout[m][0][0] + layout[m][1][0] for m in members) + 15
        y1 = max(layout[m][0][1] + layout[m][1][1] for m in members) + 15
        groups.append({"id": gid, "title": title, "bounding": [x0, y0, x1 - x0, y1 - y0], "color": color,
                       "font_size": 24, "flags": {}})
    ui = {"id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"leandiffusion/workflows/{wf.name}")), "revision": 0, "last_node_id": note_id, "last_link_id": len(links),
          "nodes": ui_nodes, "links": links, "groups": groups, "config": {},
          "extra": {"ds": {"scale": 0.8, "offset": [0, 0]}, "leandiffusion": {"title": wf.title}},
          "version": 0.4}
    return ui, api


def _dump(data) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report files that differ; write nothing")
    parser.add_argument("--out", default=str(WORKFLOWS_DIR), help="editor files and thumbnails (default: workflows/)")
    parser.add_argument("--api-out", default=str(API_WORKFLOWS_DIR), help="API files (default: workflows_api/)")
    args = parser.parse_args(argv)
    from .thumbnails import icon, thumbnail

    specs, _, used = build_specs()
    out, api_out, stale = Path(args.out), Path(args.api_out), []
    for wf in WORKFLOWS:
        ui, api = build(wf, specs, _provisional(used))
        files = {out / f"{wf.name}.json": _dump(ui).encode(), api_out / f"{wf.name}.api.json": _dump(api).encode(),
                 out / f"{wf.name}.jpg": thumbnail(wf, specs)}
        for path, data in files.items():
            if path.exists() and path.read_bytes() == data:
                continue
            stale.append(path.name)
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
    path = out / "icon.png"  # the registry icon named in pyproject.toml [tool.comfy]
    if not (path.exists() and path.read_bytes() == icon()):
        stale.append(path.name)
        if not args.check:
            path.write_bytes(icon())
    for item in used:
        sys.stderr.write(f"provisional (not declared by the pack yet): {item}\n")
    verb = "differ" if args.check else "written"
    sys.stdout.write(f"{len(stale)} file(s) {verb}: {', '.join(stale) or 'none'}\n")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
