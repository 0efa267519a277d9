"""Tiny random Z-Image LoRA files in the layouts trainers write (test helper, not a test).

- diffusers/PEFT: written by diffusers' own ``ZImagePipeline.save_lora_weights`` from a copy of the transformer that
  peft's ``LoraConfig`` was injected into (``transformer.<module>.lora_A/lora_B.weight`` plus diffusers'
  ``lora_adapter_metadata`` header with ``lora_alpha`` and ``alpha_pattern``).
- the model's original names (ComfyUI, kohya-style trainers), renamed here from diffusers' names by a hand-written
  table (independent of ``lora.zimage_names``): ``attention.to_q/to_k/to_v`` -> one fused ``attention.qkv`` layer
  (the three up factors stacked, one shared down), ``attention.to_out.0`` -> ``attention.out``,
  ``all_x_embedder.2-1`` -> ``x_embedder``, ``all_final_layer.2-1.`` -> ``final_layer.``; prefixed
  ``diffusion_model.`` (dotted) or ``lora_unet_`` (``_`` for ``.``), with any factor spelling and an ``.alpha`` each.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

# every Linear a Z-Image LoRA trainer targets, in diffusers' names (the final layer's adaLN_modulation.0 is a SiLU)
TARGETS = (r".*(attention\.(to_q|to_k|to_v|to_out\.0)|feed_forward\.w[123]|(layers|refiner)\.\d+\.adaLN_modulation\.0"
           r"|all_final_layer\.2-1\.(linear|adaLN_modulation\.1)|all_x_embedder\.2-1|cap_embedder\.1"
           r"|t_embedder\.mlp\.[02])")
PEFT_ALPHA_PATTERN = {"feed_forward.w2": 7.0, "to_out.0": 1.0}
ORIGINAL = (("all_final_layer.2-1.", "final_layer."), ("all_x_embedder.2-1", "x_embedder"),
            ("attention.to_out.0", "attention.out"))
FACTOR_SPELLINGS = {"lora_down": (".lora_down.weight", ".lora_up.weight"),
                    "lora.down": (".lora.down.weight", ".lora.up.weight"),
                    "lora_A": (".lora_A.weight", ".lora_B.weight")}
QKV = re.compile(r"(?P<block>.+)\.attention\.to_(?P<p>[qkv])")


def target_names(transformer: torch.nn.Module, targets: str = TARGETS) -> list[str]:
    """The Linear modules whose names match ``targets`` (a regex; default: Z-Image's), in module order."""
    return [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear) and re.fullmatch(targets, n)]


def linear_factors(module: torch.nn.Linear, rank: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """down [r, in], up [out, r]: ``up @ down`` about 0.4x the scale of a default-initialised weight."""
    down = torch.randn(rank, module.in_features, generator=gen) / module.in_features ** 0.5
    up = 0.25 * torch.randn(module.out_features, rank, generator=gen) / rank ** 0.5
    return down, up


def save_peft_lora(transformer: torch.nn.Module, folder: str | Path, rank: int = 4, alpha: float = 2.0,
                   seed: int = 0, pipeline: str = "ZImagePipeline", targets: str = TARGETS,
                   alpha_pattern: dict | None = None) -> Path:
    """diffusers' own LoRA file (``<pipeline>.save_lora_weights``, default Z-Image's) for a peft-injected copy of
    ``transformer`` with seeded random factors (``linear_factors`` over ``target_names(transformer, targets)`` in
    order); ``alpha_pattern`` (default ``PEFT_ALPHA_PATTERN``) gives some layers their own alpha."""
    import diffusers
    from peft import LoraConfig, get_peft_model_state_dict

    model = copy.deepcopy(transformer)
    pattern = dict(PEFT_ALPHA_PATTERN if alpha_pattern is None else alpha_pattern)
    config = LoraConfig(r=rank, lora_alpha=alpha, alpha_pattern=pattern, target_modules=targets,
                        init_lora_weights=False)
    model.add_adapter(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in target_names(transformer, targets):
            layer = model.get_submodule(name)
            down, up = linear_factors(layer.base_layer, rank, gen)
            layer.lora_A["default"].weight.copy_(down)
            layer.lora_B["default"].weight.copy_(up)
    folder = Path(folder)
    getattr(diffusers, pipeline).save_lora_weights(str(folder),
                                                   transformer_lora_layers=get_peft_model_state_dict(model),
                                                   transformer_lora_adapter_metadata=config.to_dict())
    return folder / "pytorch_lora_weights.safetensors"


def original_factors(transformer: torch.nn.Module, rank: int = 4, seed: int = 0) -> dict[str, tuple]:
    """diffusers module name -> (down, up, alpha) for every ``TARGETS`` layer, where ``to_q/to_k/to_v`` of a block
    share one down and one alpha (what a fused ``qkv`` layer holds); alphas vary from layer to layer."""
    gen = torch.Generator().manual_seed(seed)
    out, shared = {}, {}
    for i, name in enumerate(target_names(transformer)):
        down, up = linear_factors(transformer.get_submodule(name), rank, gen)
        alpha = rank * (0.5, 1.0, 1.5)[i % 3]
        m = QKV.fullmatch(name)
        if m:
            down, alpha = shared.setdefault(m["block"], (down, alpha))
        out[name] = (down, up, alpha)
    return out


def original_state_dict(factors: dict[str, tuple], prefix: str = "diffusion_model.", spelling: str = "lora_down",
                        fused: bool = True, embedders: str = "original") -> dict[str, torch.Tensor]:
    """``factors`` in the model's original key names: ``prefix`` ``diffusion_model.`` (dotted) or ``lora_unet_``
    (kohya underscores); ``spelling`` a key of ``FACTOR_SPELLINGS``; ``fused``: q/k/v as one ``qkv`` layer;
    ``embedders``: ``"original"`` (x_embedder, final_layer), ``"diffusers"`` (all_x_embedder.2-1, ...) or ``"none"``."""
    d_suffix, u_suffix = FACTOR_SPELLINGS[spelling]
    layers: dict[str, tuple] = {}
    for name, (down, up, alpha) in factors.items():
        m = QKV.fullmatch(name)
        if fused and m:  # one layer: the shared down, the ups of q, k, v stacked in that order
            qkv = f"{m['block']}.attention.qkv"
            ups = dict(layers.get(qkv, (down, {}, alpha))[1], **{m["p"]: up})
            layers[qkv] = (down, ups, alpha)
            continue
        embedder = name.startswith(("all_x_embedder", "all_final_layer"))
        if embedder and embedders == "none":
            continue
        if not (embedder and embedders == "diffusers"):
            for diffusers_part, original_part in ORIGINAL:
                name = name.replace(diffusers_part, original_part)
        layers[name] = (down, up, alpha)
    sd = {}
    for name, (down, up, alpha) in layers.items():
        key = prefix + (name.replace(".", "_") if prefix == "lora_unet_" else name)
        sd[key + d_suffix] = down.clone()
        sd[key + u_suffix] = torch.cat([up[p] for p in "qkv"]) if isinstance(up, dict) else up
        sd[key + ".alpha"] = torch.tensor(float(alpha))
    return sd


def write(sd: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.clone().contiguous() for k, v in sd.items()}, str(path))  # copies: no shared storage
    return path


def diffusers_pipeline(folder: str | Path, lora: str | Path, pipeline: str = "ZImagePipeline"):
    """The diffusers ``pipeline`` (default Z-Image's) at ``folder`` after ``load_lora_weights(lora)`` as adapter
    ``"ref"`` (the reference LoRA loader; ``pipe.set_adapters(["ref"], adapter_weights=[strength])`` sets its
    strength)."""
    import diffusers

    pipe = getattr(diffusers, pipeline).from_pretrained(str(folder), local_files_only=True)
    lora = Path(lora)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name, adapter_name="ref")
    return pipe


def peft_layers(transformer: torch.nn.Module) -> int:
    """How many modules peft injected a LoRA layer into (what the reference actually applies)."""
    from peft.tuners.lora import LoraLayer

    return sum(isinstance(m, LoraLayer) for m in transformer.modules())


def dit_inputs(transformer: torch.nn.Module, seed: int = 1, sizes=((6, 10), (8, 4)), caption_lengths=(5, 40)):
    """Inputs of diffusers' forward signature: latents ``[C, 1, H, W]`` per image, timesteps, caption features."""
    g = torch.Generator().manual_seed(seed)
    latents = [torch.randn(transformer.config.in_channels, 1, h, w, generator=g) for h, w in sizes]
    t = torch.rand(len(sizes), generator=g)
    captions = [torch.randn(n, transformer.config.cap_feat_dim, generator=g) for n in caption_lengths]
    return latents, t, captions


def run_dit(dit: torch.nn.Module, inputs) -> list[torch.Tensor]:
    latents, t, captions = inputs
    with torch.no_grad():
        return dit(list(latents), t, list(captions), return_dict=False)[0]
