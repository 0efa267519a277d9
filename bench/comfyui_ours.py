"""Our side of the ComfyUI comparison: the pack's nodes called through their public contract (node IDs and input
names), engines over full-size random parts, and moving our weights off the GPU while ComfyUI measures."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .models import SCHEDULER, full_text_encoder, full_unet, full_vae


def node_fn(node_id: str) -> Optional[Callable]:
    """Our node's FUNCTION as a callable taking the node's inputs, or None when this build lacks the node."""
    from ..nodes import NODE_CLASS_MAPPINGS

    cls = NODE_CLASS_MAPPINGS.get(node_id)
    if cls is None:
        return None
    return lambda **kw: getattr(cls(), cls.FUNCTION)(**kw)


def make_parts(kind: str, comfy, device, dtype, unet: Optional[torch.nn.Module] = None):
    """Full-size random ModelParts (UNet, SD VAE, CLIP-L [+ CLIP-G]) with the CLIP tokenizer bundled in the
    checkout of ``comfy`` (a ``comfyui_peer.Comfy``)."""
    from transformers import CLIPTokenizer

    from ..memory.engine import ModelParts

    tok_dir = str(comfy.path / "comfy" / "sd1_tokenizer")  # its config says 8192 tokens: CLIP takes 77
    tokenizer = CLIPTokenizer.from_pretrained(tok_dir, local_files_only=True, model_max_length=77)
    tokenizer_2 = CLIPTokenizer.from_pretrained(tok_dir, local_files_only=True, model_max_length=77, pad_token="!")
    unet = full_unet(kind, device=device, dtype=dtype) if unet is None else unet
    vae = full_vae(device=device, dtype=dtype)
    te = full_text_encoder("clip_l", device=device, dtype=dtype)
    te2 = full_text_encoder("clip_g", device=device, dtype=dtype) if kind == "sdxl" else None
    family = "sdxl" if kind == "sdxl" else "sd1"
    return ModelParts(family=family, unet=unet, vae=vae, text_encoder=te, tokenizer=tokenizer,
                      scheduler_config=dict(SCHEDULER), text_encoder_2=te2, tokenizer_2=tokenizer_2 if te2 else None,
                      name=f"random-{kind}")


def make_engine(parts, policy: str, budget_gb: float, device, dtype):
    """Our engine over ``parts``: the loader's ``build_engine`` when this build has it, else a resident engine
    (``full`` only; other policies return None)."""
    try:
        from ..memory.load import build_engine
    except ImportError:
        build_engine = None
    if build_engine is not None:
        name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
        return build_engine(parts, policy, budget_gb, name, name, device=device)
    if policy != "full":
        return None
    from ..memory.engine import LeanEngine

    for m in (parts.unet, parts.vae, parts.text_encoder, parts.text_encoder_2):
        if m is not None:
            m.to(device=device, dtype=dtype)
    return LeanEngine(parts=parts, device=torch.device(device), dtype=dtype, vae_dtype=dtype)


def drop_engine(engine) -> None:
    """Undo an engine's placement for good (the loader's ``remove``: hooks off, modules back on the CPU)."""
    remove = getattr(getattr(engine, "placement", None), "remove", None)
    if callable(remove):
        remove()


def park_on_cpu(*modules) -> None:
    """Move our modules off the GPU (then ``free_cuda``) before ComfyUI runs: ComfyUI's peaks are read from the
    same process's allocator, so weights of ours left resident would count in ComfyUI's numbers."""
    for m in modules:
        if m is not None:
            m.to("cpu")
    free_cuda()


def free_cuda() -> None:
    """Collect dropped objects and return the CUDA cache (call after ``del`` of the last references)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def vae_only_parts(vae):
    """ModelParts whose VAE is ``vae`` (the decode node only touches the VAE; the rest are tiny stand-ins)."""
    from ..memory.engine import ModelParts

    return ModelParts(family="sd1", unet=torch.nn.Identity(), vae=vae, text_encoder=torch.nn.Identity(),
                      tokenizer=None, scheduler_config=dict(SCHEDULER), name="random-sd-vae")
