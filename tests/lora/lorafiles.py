"""Write random LoRA files for tiny models, in the layouts real trainers produce (test helper, not a test).

kohya: ``lora_unet_<name with _>`` (diffusers naming) or the LDM naming kohya's SDXL trainer uses (derived here
from a hand-written table of the LDM block layout, independent of ``lora.keymap``), ``lora_te*_``, with
``lora_down``/``lora_up``/``alpha``. PEFT: ``<component>.<name>.lora_A/lora_B.weight`` plus diffusers'
``lora_adapter_metadata`` header (``lora_alpha``, ``alpha_pattern``).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

ATTN_FF = re.compile(r"(attn[12]\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))$")
TE_LINEARS = re.compile(r"(self_attn\.(q_proj|k_proj|v_proj|out_proj)|mlp\.(fc1|fc2))$")
LOCON = re.compile(r"(resnets\.\d+\.(conv1|conv2|conv_shortcut|time_emb_proj)|(down|up)samplers\.0\.conv|proj_in|proj_out)$")


def module_names(root: torch.nn.Module, pattern: re.Pattern) -> list[str]:
    return [n for n, m in root.named_modules()
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) and pattern.search(n)]


def file_name(root: torch.nn.Module, name: str) -> str:
    """The module name as files spell it: CLIP text models keep transformers 4's ``text_model.`` prefix (real
    kohya/diffusers files do; transformers 5 dropped the attribute)."""
    is_clip = type(root).__name__.startswith("CLIPText")
    return "text_model." + name if is_clip and not hasattr(root, "text_model") and name != "text_projection" else name


def random_factors(module: torch.nn.Module, rank: int, gen: torch.Generator, conv_kernel: bool = True):
    """down [r, in(, k, k)], up [out, r(, 1, 1)]: ``up @ down`` has entries ~0.25/sqrt(fan_in), i.e. about 0.4x
    the scale of the default-initialised base weight (a strong LoRA; real ones change weights by less). Larger
    deltas push fp32 rounding of *any* two correct implementations past 1e-5 on the tiny UNet (a delta 1.7x the
    weight puts both unmerged and merged about 1e-5 from an fp64 reference)."""
    if isinstance(module, torch.nn.Linear):
        fan_in, out = module.in_features, module.out_features
        down = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
        up = 0.25 * torch.randn(out, rank, generator=gen) / rank ** 0.5
    else:
        k = tuple(module.kernel_size) if conv_kernel else (1, 1)
        fan_in = module.in_channels * k[0] * k[1]
        down = torch.randn(rank, module.in_channels, *k, generator=gen) / fan_in ** 0.5
        up = 0.25 * torch.randn(module.out_channels, rank, 1, 1, generator=gen) / rank ** 0.5
    return down, up


def kohya_layers(roots: dict, patterns: dict, ldm_names: dict | None = None):
    """``(kohya key prefix, module, index within its component)`` of every module ``patterns`` cover: ``roots``:
    component -> module; ``patterns``: component -> regex of module names; UNet modules spelled by ``ldm_names``
    when given (kohya's SDXL trainers), else diffusers names."""
    prefixes = {"unet": "lora_unet_", "text_encoder": "lora_te1_" if "text_encoder_2" in roots else "lora_te_",
                "text_encoder_2": "lora_te2_"}
    for comp, pattern in patterns.items():
        root = roots[comp]
        for i, name in enumerate(module_names(root, pattern)):
            spelled = ldm_names[name] if (comp == "unet" and ldm_names is not None) else file_name(root, name)
            yield prefixes[comp] + spelled.replace(".", "_"), root.get_submodule(name), i


def kohya_state_dict(roots: dict, patterns: dict, rank: int = 4, seed: int = 0, ldm_names: dict | None = None,
                     with_alpha: bool = True, varied_alpha: bool = False) -> dict[str, torch.Tensor]:
    """``roots``: component -> module; ``patterns``: component -> regex of module names to cover."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for key, module, i in kohya_layers(roots, patterns, ldm_names):
        down, up = random_factors(module, rank, gen)
        sd[key + ".lora_down.weight"] = down
        sd[key + ".lora_up.weight"] = up
        if with_alpha:
            sd[key + ".alpha"] = torch.tensor(float(rank) * (0.5 + (i % 3) * 0.5) if varied_alpha else rank / 2.0)
    return sd


def peft_state_dict(roots: dict, patterns: dict, rank: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for comp, pattern in patterns.items():
        root = roots[comp]
        for name in module_names(root, pattern):
            down, up = random_factors(root.get_submodule(name), rank, gen)
            sd[f"{comp}.{file_name(root, name)}.lora_A.weight"] = down
            sd[f"{comp}.{file_name(root, name)}.lora_B.weight"] = up
    return sd


def peft_metadata(roots: dict, patterns: dict, rank: int, alpha: float, alpha_pattern: dict) -> dict[str, str]:
    """diffusers' ``lora_adapter_metadata`` header: ``<component>.<LoraConfig field>`` -> value."""
    meta = {}
    for comp, pattern in patterns.items():
        names = sorted(module_names(roots[comp], pattern))
        meta.update({f"{comp}.r": rank, f"{comp}.lora_alpha": alpha, f"{comp}.target_modules": names,
                     f"{comp}.alpha_pattern": alpha_pattern.get(comp, {}), f"{comp}.rank_pattern": {},
                     f"{comp}.init_lora_weights": True, f"{comp}.use_dora": False, f"{comp}.lora_bias": False})
    return {"format": "pt", "lora_adapter_metadata": json.dumps(meta)}


def write(sd: dict, path: Path, metadata: dict | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata=metadata)
    return path


# LDM (sgm) names for the tiny SDXL UNet, written out by hand from the LDM layout (not derived by lora.keymap):
# down_blocks.0 = DownBlock2D (1 resnet + downsampler), down_blocks.1 = CrossAttnDownBlock2D (1 resnet+attn);
# up_blocks.0 = CrossAttnUpBlock2D (2 resnets+attns + upsampler), up_blocks.1 = UpBlock2D (2 resnets).
TINY_SDXL_LDM_BLOCKS = {
    "down_blocks.0.resnets.0": "input_blocks.1.0", "down_blocks.0.downsamplers.0": "input_blocks.2.0",
    "down_blocks.1.resnets.0": "input_blocks.3.0", "down_blocks.1.attentions.0": "input_blocks.3.1",
    "mid_block.resnets.0": "middle_block.0", "mid_block.attentions.0": "middle_block.1",
    "mid_block.resnets.1": "middle_block.2",
    "up_blocks.0.resnets.0": "output_blocks.0.0", "up_blocks.0.attentions.0": "output_blocks.0.1",
    "up_blocks.0.resnets.1": "output_blocks.1.0", "up_blocks.0.attentions.1": "output_blocks.1.1",
    "up_blocks.0.upsamplers.0": "output_blocks.1.2",
    "up_blocks.1.resnets.0": "output_blocks.2.0", "up_blocks.1.resnets.1": "output_blocks.3.0",
}
RESNET_LDM = {"conv1": "in_layers.2", "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
              "conv_shortcut": "skip_connection"}


def tiny_sdxl_ldm_names(unet: torch.nn.Module) -> dict[str, str]:
    out = {}
    for name, m in unet.named_modules():
        if not isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
            continue
        for prefix, ldm in TINY_SDXL_LDM_BLOCKS.items():
            if name.startswith(prefix + "."):
                rest = name[len(prefix) + 1:]
                rest = RESNET_LDM.get(rest, rest) if ".resnets." in prefix else rest
                rest = "op" if prefix.endswith("downsamplers.0") and rest == "conv" else rest
                out[name] = f"{ldm}.{rest}"
    return out


def diffusers_pipeline(components: dict):
    """A diffusers pipeline over ``components`` (the reference LoRA loader lives on pipelines)."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

    sched = DDIMScheduler(**components["scheduler_config"])
    if "text_encoder_2" in components:
        return StableDiffusionXLPipeline(vae=components["vae"], text_encoder=components["text_encoder"],
                                         text_encoder_2=components["text_encoder_2"],
                                         tokenizer=components["tokenizer"], tokenizer_2=components["tokenizer_2"],
                                         unet=components["unet"], scheduler=sched)
    return StableDiffusionPipeline(vae=components["vae"], text_encoder=components["text_encoder"],
                                   tokenizer=components["tokenizer"], unet=components["unet"], scheduler=sched,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def unet_inputs(family: str, batch: int = 2, seed: int = 1, device="cpu", dtype=torch.float32) -> dict:
    """Random inputs for one tiny UNet call (SDXL adds the text_time conditioning), drawn on the CPU and then moved
    to ``device`` / ``dtype`` (the same values everywhere)."""
    g = torch.Generator().manual_seed(seed)
    ctx = 64 + 128 if family == "sdxl" else (128 if family.startswith("sd2") else 64)
    out = {"latents": torch.randn(batch, 4, 8, 8, generator=g).to(device, dtype), "timestep": 10,
           "context": torch.randn(batch, 77, ctx, generator=g).to(device, dtype)}
    if family == "sdxl":
        out["added_cond_kwargs"] = {"text_embeds": torch.randn(batch, 128, generator=g).to(device, dtype),
                                    "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * batch).to(device, dtype)}
    return out


def run_unet(unet: torch.nn.Module, inputs: dict) -> torch.Tensor:
    kwargs = {"added_cond_kwargs": inputs["added_cond_kwargs"]} if "added_cond_kwargs" in inputs else {}
    with torch.no_grad():
        return unet(inputs["latents"], inputs["timestep"], encoder_hidden_states=inputs["context"],
                    return_dict=False, **kwargs)[0]


def run_text(parts, prompts=("a photo of a cat", "x")) -> list[torch.Tensor]:
    """Last and penultimate hidden states of every text encoder (what the pipelines consume)."""
    outs = []
    with torch.no_grad():
        for tok, te in ((parts.tokenizer, parts.text_encoder), (parts.tokenizer_2, parts.text_encoder_2)):
            if te is None:
                continue
            ids = tok(list(prompts), padding="max_length", max_length=tok.model_max_length, truncation=True,
                      return_tensors="pt").input_ids
            res = te(ids, output_hidden_states=True)
            outs += [res[0], res.hidden_states[-2]]
    return outs


def view_outputs(view) -> list[torch.Tensor]:
    """A view's UNet output (``unet_inputs``) and its text encoders' hidden states, each inside its session."""
    inputs = unet_inputs(view.family)
    with view.session("unet"):
        u = run_unet(view.parts.unet, inputs)
    with view.session("text"):
        t = run_text(view.parts)
    return [u] + t


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _hooks(m: torch.nn.Module) -> dict:
    """Per module: its forward hooks, pre-hooks and the names in its instance ``__dict__`` (an instance-level
    ``forward`` override left behind shows up as a ``forward`` key)."""
    return {n: (tuple(sub._forward_hooks.values()), tuple(sub._forward_pre_hooks.values()), tuple(sorted(sub.__dict__)))
            for n, sub in m.named_modules()}


def injected(root: torch.nn.Module, own: dict | None = None) -> int:
    """How many LoRA terms are injected under ``root`` now: forward hooks (minus ``own[id(module)]``, hooks the
    model keeps itself) plus the terms of instance-level overrides (a GEGLU's override sits beside its bound
    ``forward`` under ``unet_patches.STATE``)."""
    from leandiffusion.memory.unet_patches import STATE

    own = own or {}
    n = 0
    for sub in root.modules():
        n += len(sub._forward_hooks) - own.get(id(sub), 0)
        n += len(getattr(sub.__dict__.get(STATE, sub.__dict__.get("forward")), "terms", ()))
    return n


def snapshot(*modules: torch.nn.Module) -> list:
    """(name, data_ptr, copy) of every parameter and buffer, and every module's hooks, to prove a model was left
    untouched (transformers' CLIP keeps hooks of its own, so hooks are compared, not required absent)."""
    out = []
    for i, m in enumerate(modules):
        if m is None:
            continue
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            out.append((f"{i}.{name}", t.data_ptr(), t.detach().clone()))
        out.append((f"{i}.<hooks>", 0, _hooks(m)))
    return out


def assert_untouched(before, *modules: torch.nn.Module) -> None:
    after = {}
    for i, m in enumerate(modules):
        if m is None:
            continue
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            after[f"{i}.{name}"] = t
        after[f"{i}.<hooks>"] = _hooks(m)
    assert len(after) == len(before)
    for name, ptr, copy in before:
        t = after[name]
        if name.endswith("<hooks>"):
            assert t == copy, "hooks were left on the model"
            continue
        assert t.data_ptr() == ptr, f"{name} was reallocated"
        assert torch.equal(t, copy), f"{name} changed"


# ------------------------------------------------------------------------------------------ LyCORIS (LoHa / LoKr)
def split_dim(n: int) -> tuple[int, int]:
    """``n = a * b`` with ``a <= b`` as close to sqrt(n) as divisors allow (LyCORIS' ``factor=-1`` split)."""
    a = max(d for d in range(1, int(n ** 0.5) + 1) if n % d == 0)
    return a, n // a


def _fan(module: torch.nn.Module) -> tuple[int, int, tuple]:
    """(out, in, kernel) of a Linear / Conv2d (kernel () for Linear)."""
    if isinstance(module, torch.nn.Linear):
        return module.out_features, module.in_features, ()
    return module.out_channels, module.in_channels, tuple(module.kernel_size)


def loha_factors(module: torch.nn.Module, rank: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """hada_w1_a [out, r], hada_w1_b [r, in*kh*kw], hada_w2_a, hada_w2_b: the delta's entries come out ~0.25/sqrt(fan_in)
    (like ``random_factors``)."""
    out, fan_in, kernel = _fan(module)
    n = fan_in
    for k in kernel:
        n *= k
    return {"hada_w1_a": 0.25 * torch.randn(out, rank, generator=gen) / (rank * n) ** 0.5,
            "hada_w1_b": torch.randn(rank, n, generator=gen),
            "hada_w2_a": torch.randn(out, rank, generator=gen) / rank ** 0.5,
            "hada_w2_b": torch.randn(rank, n, generator=gen)}


LOKR_VARIANTS = ("full", "w2_lowrank", "both_lowrank", "tucker")


def lokr_factors(module: torch.nn.Module, rank: int, gen: torch.Generator, variant: str) -> dict[str, torch.Tensor]:
    """LoKr factors in the layouts LyCORIS writes: ``full`` (lokr_w1 + lokr_w2, W2 carrying a conv's kernel),
    ``w2_lowrank`` (lokr_w1 + lokr_w2_a/b, conv W2 flattened [o2, i2*kh*kw]), ``both_lowrank`` (lokr_w1_a/b +
    lokr_w2_a/b), ``tucker`` (conv with a kernel > 1 only: lokr_w1 + lokr_t2 [r, r, kh, kw] + lokr_w2_a [r, o2] +
    lokr_w2_b [r, i2]; other modules fall back to ``w2_lowrank``)."""
    out, fan_in, kernel = _fan(module)
    (o1, o2), (i1, i2) = split_dim(out), split_dim(fan_in)
    taps = 1
    for k in kernel:
        taps *= k
    small = 0.25 / (fan_in * taps) ** 0.5  # kron entries ~ small
    sd = {}
    if variant == "both_lowrank":
        sd["lokr_w1_a"] = torch.randn(o1, rank, generator=gen) / rank ** 0.5
        sd["lokr_w1_b"] = torch.randn(rank, i1, generator=gen)
    else:
        sd["lokr_w1"] = torch.randn(o1, i1, generator=gen)
    if variant == "tucker" and taps == 1:
        variant = "w2_lowrank"
    if variant == "full":
        sd["lokr_w2"] = small * torch.randn(o2, i2, *kernel, generator=gen)
    elif variant == "tucker":
        sd["lokr_t2"] = torch.randn(rank, rank, *kernel, generator=gen) / rank
        sd["lokr_w2_a"] = small * torch.randn(rank, o2, generator=gen)
        sd["lokr_w2_b"] = torch.randn(rank, i2, generator=gen)
    else:
        sd["lokr_w2_a"] = small * torch.randn(o2, rank, generator=gen) / rank ** 0.5
        sd["lokr_w2_b"] = torch.randn(rank, i2 * taps, generator=gen)
    return sd


def locon_tucker_factors(module: torch.nn.Conv2d, rank: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """LyCORIS' ``use_tucker`` LoCon of a kxk conv: lora_down [r, in, 1, 1], lora_mid [r, r, kh, kw], lora_up
    [out, r, 1, 1]."""
    k = tuple(module.kernel_size)
    return {"lora_down.weight": torch.randn(rank, module.in_channels, 1, 1, generator=gen) / module.in_channels ** 0.5,
            "lora_mid.weight": torch.randn(rank, rank, *k, generator=gen) / (rank * k[0] * k[1]) ** 0.5,
            "lora_up.weight": 0.25 * torch.randn(module.out_channels, rank, 1, 1, generator=gen) / rank ** 0.5}


def dora_scale(module: torch.nn.Module, delta: torch.Tensor, axis: str, gen: torch.Generator) -> torch.Tensor:
    """A DoRA magnitude near the norm of ``W + delta`` (as a trained one is), ``[1, in(,1,1)]`` (axis "in") or
    ``[out, 1(,1,1)]`` (axis "out"), fp32."""
    w = module.weight.detach().double() + delta.double().reshape(module.weight.shape)
    dims = (0,) + tuple(range(2, w.ndim)) if axis == "in" else tuple(range(1, w.ndim))
    norm = w.square().sum(dim=dims, keepdim=True).sqrt()
    return (norm * (1 + 0.3 * torch.randn(norm.shape, generator=gen, dtype=torch.float64))).float()


def lycoris_state_dict(roots: dict, patterns: dict, kind: str, rank: int = 2, seed: int = 0,
                       variant: str = "w2_lowrank", alpha: float | None = 1.5, dora: str = "",
                       ldm_names: dict | None = None) -> dict[str, torch.Tensor]:
    """A kohya-layout LyCORIS file: ``kind`` "loha" | "lokr" | "lora" (plain, for DoRA) | "locon_tucker" (kxk convs
    with lora_mid, the rest plain), ``dora`` "" | "in" | "out"
    adds a ``dora_scale`` per layer. Names as ``kohya_state_dict``."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for key, module, _ in kohya_layers(roots, patterns, ldm_names):
        if kind == "loha":
            factors = loha_factors(module, rank, gen)
        elif kind == "lokr":
            factors = lokr_factors(module, rank, gen, variant)
        elif kind == "locon_tucker" and isinstance(module, torch.nn.Conv2d) and module.kernel_size != (1, 1):
            factors = locon_tucker_factors(module, rank, gen)
        else:
            down, up = random_factors(module, rank, gen)
            factors = {"lora_down.weight": down, "lora_up.weight": up}
        sd.update({f"{key}.{k}": v for k, v in factors.items()})
        if alpha is not None:
            sd[key + ".alpha"] = torch.tensor(alpha)
        if dora:
            sd[key + ".dora_scale"] = dora_scale(module, reference_delta(sd, key, module), dora, gen)
    return sd


# name -> (kind, variant, rank, dora): rank-2 LoHa runs as a rank-4 LoRA (Khatri-Rao), rank 6 builds its delta densely
# on the tiny models' 32/64-wide layers; LoKr in each layout LyCORIS writes; DoRA on both axes and on each kind.
LYCORIS_CASES = {
    "loha_lowrank": ("loha", "", 2, ""), "loha_dense": ("loha", "", 6, ""),
    "lokr_full": ("lokr", "full", 2, ""), "lokr_w2_lowrank": ("lokr", "w2_lowrank", 2, ""),
    "lokr_both_lowrank": ("lokr", "both_lowrank", 2, ""), "lokr_tucker": ("lokr", "tucker", 2, ""),
    "dora_in": ("lora", "", 2, "in"), "dora_out": ("lora", "", 2, "out"),
    "lokr_dora_in": ("lokr", "tucker", 2, "in"), "loha_dora_out": ("loha", "", 2, "out"),
    "locon_tucker": ("locon_tucker", "", 3, ""), "locon_tucker_dora_in": ("locon_tucker", "", 3, "in"),
}


def lycoris_case(roots: dict, patterns: dict, case: str, seed: int = 0, ldm_names: dict | None = None) -> dict:
    """``lycoris_state_dict`` for one of ``LYCORIS_CASES``."""
    kind, variant, rank, dora = LYCORIS_CASES[case]
    return lycoris_state_dict(roots, patterns, kind, rank=rank, seed=seed, variant=variant or "w2_lowrank",
                              dora=dora, ldm_names=ldm_names)


def reference_delta(sd: dict, key: str, module: torch.nn.Module) -> torch.Tensor:
    """The layer's delta at strength 1 in fp64, straight from the published formulas (LyCORIS; ComfyUI
    ``weight_adapter``), written independently of ``lora/``: LoRA ``alpha/r * up @ down``; LoHa
    ``alpha/r * (w1_a @ w1_b) * (w2_a @ w2_b)``; LoKr ``scale * kron(W1, W2)`` with ``scale = alpha/r`` when a factor is
    low-rank, else 1; no alpha = scale 1. Shaped like the module's weight."""
    g = {k[len(key) + 1:]: v.double() for k, v in sd.items() if k.startswith(key + ".")}
    shape = module.weight.shape
    alpha = g["alpha"].item() if "alpha" in g else None
    if "lora_down.weight" in g:
        down, up = g["lora_down.weight"], g["lora_up.weight"]
        scale = alpha / down.shape[0] if alpha is not None else 1.0
        if "lora_mid.weight" in g:  # up(mid(down(x))): kernel[o, c, k, l] = sum_ab up[o, a] mid[a, b, k, l] down[b, c]
            mid, u, d = g["lora_mid.weight"], up.flatten(1), down.flatten(1)
            kernel = (u[:, :, None, None, None, None] * mid[None, :, :, None, :, :] *
                      d[None, None, :, :, None, None]).sum(dim=(1, 2))
            return scale * kernel.reshape(shape)
        return scale * (up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1)).reshape(shape)
    if "hada_w1_a" in g:
        scale = alpha / g["hada_w1_b"].shape[0] if alpha is not None else 1.0
        d = (g["hada_w1_a"] @ g["hada_w1_b"]) * (g["hada_w2_a"] @ g["hada_w2_b"])
        return scale * d.reshape(shape)
    rank = None
    if "lokr_w1" in g:
        w1 = g["lokr_w1"]
    else:
        w1, rank = g["lokr_w1_a"] @ g["lokr_w1_b"], g["lokr_w1_b"].shape[0]
    if "lokr_w2" in g:
        w2 = g["lokr_w2"]
    elif "lokr_t2" in g:  # W2[p, q, k, l] = sum_ij t[i, j, k, l] a[i, p] b[j, q]
        t, a, b = g["lokr_t2"], g["lokr_w2_a"], g["lokr_w2_b"]
        w2 = torch.zeros(a.shape[1], b.shape[1], *t.shape[2:], dtype=torch.float64)
        for i in range(t.shape[0]):
            for j in range(t.shape[1]):
                w2 += a[i][:, None, None, None] * b[j][None, :, None, None] * t[i, j][None, None]
        rank = b.shape[0]
    else:
        w2, rank = g["lokr_w2_a"] @ g["lokr_w2_b"], g["lokr_w2_b"].shape[0]
    scale = alpha / rank if (alpha is not None and rank is not None) else 1.0
    o1, i1 = w1.shape
    w2 = w2.reshape(w2.shape[0], -1)  # [o2, i2 * taps]
    o2, n2 = w2.shape
    kron = (w1[:, None, :, None] * w2[None, :, None, :]).reshape(o1 * o2, i1 * n2)  # kron[a*o2+b, c*n2+d]
    return scale * kron.reshape(shape)


def dora_reference_weight(weight: torch.Tensor, delta: torch.Tensor, magnitude: torch.Tensor,
                          strength: float) -> torch.Tensor:
    """fp64 ``W + s * ((W + dW) * m / ||W + dW|| - W)``, the norm per input channel for ``[1, in..]`` magnitudes and per
    output channel for ``[out, 1..]`` (DoRA paper; ComfyUI's weight_decompose input-axis branch; LyCORIS)."""
    w, a, m = weight.double(), weight.double() + delta.double(), magnitude.double()
    dims = (0,) + tuple(range(2, w.ndim)) if m.shape[0] == 1 else tuple(range(1, w.ndim))
    norm = a.square().sum(dim=dims, keepdim=True).sqrt() + torch.finfo(torch.float32).eps
    return w + strength * (a * (m.reshape(norm.shape) / norm) - w)
