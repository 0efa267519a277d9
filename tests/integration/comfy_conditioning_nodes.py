"""Run by ComfyUI's interpreter (not collected by pytest): ComfyUI's own conditioning nodes and what its SDXL / SD1
model makes of their output.

``python comfy_conditioning_nodes.py COMFYUI_PATH BUNDLE OUT_DIR TIME_DIM BATCH HEIGHT WIDTH``. ``BUNDLE`` (safetensors)
holds the text encodings the nodes start from (tiny widths: SDXL ``sdxl_a``/``sdxl_b`` [1, 77, C] with pooled
``*_pooled``, ``sdxl_rows`` [2, 77, C], ``style`` [1, 8, C] for the style model; SD1 ``sd1_a``). Each case runs ComfyUI
0.3.64's real node code (``nodes.py``, ``comfy_extras``); text encodes run ComfyUI's own
``CLIP.encode_from_tokens_scheduled`` over a fixed encoding (``FixedClip``), so the dict is the one the node writes.
Models, ControlNets, style and GLIGEN models are stand-ins: the nodes only store them (or, for the style model, append
its tokens).

``OUT_DIR/cases.json``: per case the model family and each entry's dict, values as ``{"json": v}``, ``{"tensor":
name}`` (in ``OUT_DIR/tensors.safetensors``) or ``{"object": type name}``. For a single-entry case, also what ComfyUI
feeds its UNet for a batch of ``BATCH`` latents of ``HEIGHT x WIDTH`` pixels: ``comfy.sampler_helpers.convert_cond``,
``comfy.samplers.encode_model_conds`` with ``BaseModel.extra_conds`` (``SDXL.encode_adm`` with ``Timestep(TIME_DIM)``,
the tiny UNet's time-embedding width, for SDXL; none for SD1), then each cond's ``process_cond`` to the batch:
``<case>/c_crossattn`` and (SDXL) ``<case>/y``.
"""
import json
import sys
import types
from pathlib import Path

comfy_path, bundle_path, out_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
time_dim, batch, height, width = (int(v) for v in sys.argv[4:8])
sys.path.insert(0, comfy_path)
sys.argv = [sys.argv[0], "--cpu"]  # ComfyUI's device choice reads its command line

import comfy.options  # noqa: E402

comfy.options.enable_args_parsing()
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import comfy.conds  # noqa: E402,F401
import comfy.hooks  # noqa: E402
import comfy.model_base  # noqa: E402
import comfy.sampler_helpers  # noqa: E402
import comfy.samplers  # noqa: E402
import comfy.sd  # noqa: E402
import nodes  # noqa: E402
from comfy.ldm.modules.diffusionmodules.openaimodel import Timestep  # noqa: E402
from comfy_extras.nodes_clip_sdxl import CLIPTextEncodeSDXL, CLIPTextEncodeSDXLRefiner  # noqa: E402
from comfy_extras.nodes_hooks import ConditioningSetProperties  # noqa: E402

t = load_file(bundle_path)


class FixedClip:
    """Stands for ``comfy.sd.CLIP`` with a fixed encoding; ComfyUI's own ``encode_from_tokens_scheduled`` runs on it
    (no hooks: the encoding's dict plus the node's ``add_dict``)."""

    patcher = types.SimpleNamespace(forced_hooks=None)
    use_clip_schedule = False
    apply_hooks_to_conds = None
    encode_from_tokens_scheduled = comfy.sd.CLIP.encode_from_tokens_scheduled
    add_hooks_to_dict = comfy.sd.CLIP.add_hooks_to_dict

    def __init__(self, cond, pooled):
        self.cond, self.pooled = cond, pooled

    def tokenize(self, text):
        return {"g": [[(320, 1.0)]], "l": [[(320, 1.0)]]}

    def encode_from_tokens(self, tokens, return_pooled=False, return_dict=False):
        if return_dict:
            return self.add_hooks_to_dict({"cond": self.cond.clone(), "pooled_output": self.pooled.clone()})
        return (self.cond.clone(), self.pooled.clone()) if return_pooled else self.cond.clone()


class ControlNet:  # stand-in: the apply nodes store it
    def copy(self):
        return ControlNet()

    def set_cond_hint(self, *args, **kwargs):
        return self

    def set_previous_controlnet(self, previous):
        return self


class StyleModel:  # stand-in: StyleModelApply appends get_cond's tokens to the text
    def get_cond(self, clip_vision_output):
        return t["style"].clone()


class GLIGEN:
    pass


vision = types.SimpleNamespace(image_embeds=torch.zeros(1, 16))
clip = FixedClip(t["sdxl_a"], t["sdxl_a_pooled"])
a = clip.encode_from_tokens_scheduled(clip.tokenize("a"))
b = [[t["sdxl_b"], {"pooled_output": t["sdxl_b_pooled"]}]]
sdxl_size = dict(width=1000, height=1200, crop_w=24, crop_h=40, target_width=1016, target_height=1104)
image = torch.zeros(1, 64, 64, 3)


def cnet_advanced(strength):
    return nodes.ControlNetApplyAdvanced().apply_controlnet(a, b, ControlNet(), image, strength, 0.0, 1.0)[0]


CASES = {  # name -> (family, CONDITIONING)
    "CLIPTextEncode": ("sdxl", nodes.CLIPTextEncode().encode(clip, "a")[0]),
    "CLIPTextEncodeSDXL": ("sdxl", CLIPTextEncodeSDXL.execute(clip, text_g="a", text_l="b", **sdxl_size).result[0]),
    "ConditioningConcat": ("sdxl", nodes.ConditioningConcat().concat(a, b)[0]),
    "ConditioningAverage": ("sdxl", nodes.ConditioningAverage().addWeighted(a, b, 0.3)[0]),
    "ConditioningZeroOut": ("sdxl", nodes.ConditioningZeroOut().zero_out(a)[0]),
    "ConditioningSetTimestepRange 0-1": ("sdxl", nodes.ConditioningSetTimestepRange().set_range(a, 0.0, 1.0)[0]),
    "ConditioningSetAreaStrength 1": ("sdxl", nodes.ConditioningSetAreaStrength().append(a, 1.0)[0]),
    "ConditioningSetProperties plain": ("sdxl", ConditioningSetProperties().set_properties(a, 1.0, "default")[0]),
    "ControlNetApplyAdvanced strength 0": ("sdxl", cnet_advanced(0.0)),
    "StyleModelApply multiply": ("sdxl", nodes.StyleModelApply().apply_stylemodel(a, StyleModel(), vision, 1.0,
                                                                                  "multiply")[0]),
    "batched rows": ("sdxl", [[t["sdxl_rows"], {"pooled_output": t["sdxl_rows_pooled"]}]]),
    "SD1 CLIPTextEncode": ("sd1", nodes.CLIPTextEncode().encode(FixedClip(t["sd1_a"], t["sd1_a_pooled"]), "a")[0]),
    # ComfyUI samples these with machinery the pack's samplers do not have
    "ConditioningCombine": ("sdxl", nodes.ConditioningCombine().combine(a, b)[0]),
    "ConditioningSetArea": ("sdxl", nodes.ConditioningSetArea().append(a, 32, 32, 8, 0, 1.0)[0]),
    "ConditioningSetAreaPercentage": ("sdxl", nodes.ConditioningSetAreaPercentage().append(a, 0.5, 0.5, 0, 0,
                                                                                           1.0)[0]),
    "ConditioningSetAreaStrength": ("sdxl", nodes.ConditioningSetAreaStrength().append(a, 0.5)[0]),
    "ConditioningSetMask": ("sdxl", nodes.ConditioningSetMask().append(a, torch.ones(1, height // 8, width // 8),
                                                                       "default", 0.7)[0]),
    "ConditioningSetTimestepRange": ("sdxl", nodes.ConditioningSetTimestepRange().set_range(a, 0.2, 1.0)[0]),
    "ConditioningSetProperties": ("sdxl", ConditioningSetProperties().set_properties(
        a, 1.0, "default", hooks=comfy.hooks.HookGroup())[0]),
    "ControlNetApply": ("sdxl", nodes.ControlNetApply().apply_controlnet(a, ControlNet(), image, 0.8)[0]),
    "ControlNetApplyAdvanced": ("sdxl", cnet_advanced(0.8)),
    "GLIGENTextBoxApply": ("sdxl", nodes.GLIGENTextBoxApply().append(a, clip, GLIGEN(), "a box", 32, 32, 0, 0)[0]),
    "unCLIPConditioning": ("sdxl", nodes.unCLIPConditioning().apply_adm(a, vision, 1.0, 0.1)[0]),
    "StyleModelApply": ("sdxl", nodes.StyleModelApply().apply_stylemodel(a, StyleModel(), vision, 0.5,
                                                                         "attn_bias")[0]),
    "CLIPTextEncodeSDXLRefiner": ("sdxl", CLIPTextEncodeSDXLRefiner.execute(clip, 6.0, 1024, 1024, "a").result[0]),
}


def model_inputs(family, conditioning):
    """What ComfyUI's sampler hands the UNet for this single-entry conditioning (module docstring)."""
    ns = types.SimpleNamespace(concat_keys=(), embedder=Timestep(time_dim), noise_augmentor=None)
    base = comfy.model_base.SDXL if family == "sdxl" else comfy.model_base.BaseModel
    ns.concat_cond = lambda **kw: comfy.model_base.BaseModel.concat_cond(ns, **kw)
    ns.encode_adm = lambda **kw: base.encode_adm(ns, **kw)
    conds = comfy.sampler_helpers.convert_cond(conditioning)
    noise = torch.zeros(batch, 4, height // 8, width // 8)
    conds = comfy.samplers.encode_model_conds(lambda **kw: comfy.model_base.BaseModel.extra_conds(ns, **kw), conds,
                                              noise, torch.device("cpu"), "positive")
    return {k: c.process_cond(batch_size=batch, area=None).cond for k, c in conds[0]["model_conds"].items()}


tensors, cases = {}, {}
for name, (family, conditioning) in CASES.items():
    entries = []
    for i, (cond, extras) in enumerate(conditioning):
        tensors[f"{name}/{i}/cond"] = cond
        described = {}
        for key, value in extras.items():
            if torch.is_tensor(value):
                tensors[f"{name}/{i}/{key}"] = value
                described[key] = {"tensor": f"{name}/{i}/{key}"}
            elif value is None or isinstance(value, (bool, int, float, str)) or (
                    isinstance(value, (list, tuple)) and all(isinstance(v, (int, float, str)) for v in value)):
                described[key] = {"json": value}
            else:
                described[key] = {"object": type(value).__name__}
        entries.append(described)
    cases[name] = {"family": family, "entries": entries}
    if len(conditioning) == 1 and not set(conditioning[0][1]) & {"unclip_conditioning", "gligen"}:
        for key, value in model_inputs(family, conditioning).items():
            tensors[f"{name}/{key}"] = value
save_file({k: v.clone().contiguous() for k, v in tensors.items()}, str(out_dir / "tensors.safetensors"))
(out_dir / "cases.json").write_text(json.dumps(cases, indent=1))
