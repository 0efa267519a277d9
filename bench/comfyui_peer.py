"""ComfyUI's own implementations as benchmark peers, driven from a ComfyUI checkout in this process.

Only ComfyUI's library modules are imported (``comfy.sd``, ``comfy.sample``, ``comfy.model_management``,
``comfy.utils``), from the checkout prepended to ``sys.path``. Its ``nodes`` / ``comfy_extras`` modules import PyAV
(video types) through ``comfy_api``, which a GPU machine may lack, so each node's body is called directly:
``KSampler`` -> ``comfy.sample.sample`` with ``prepare_noise`` (``nodes.common_ksampler``), ``VAEDecodeTiled`` ->
``VAE.decode_tiled(tile_x=tile//8, tile_y=tile//8, overlap=overlap//8)``, ``ImageUpscaleWithModel`` ->
``comfy.utils.tiled_scale(tile 512, overlap 32)``. A smaller card is emulated by replacing
``comfy.model_management.get_free_memory`` (in this process only) with "budget minus what torch has reserved, plus
torch's own free cache", which is the formula ComfyUI applies to the driver's free memory; ComfyUI then decides its
partial load exactly as on that card.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from typing import Optional

import torch


class Comfy:
    """ComfyUI's library modules, imported from a checkout (see the module docstring)."""

    def __init__(self, path: Path, cpu: bool):
        path = Path(path)
        if not (path / "comfy" / "sd.py").is_file():
            raise ValueError(f"--comfyui={str(path)!r} is not a ComfyUI checkout (no comfy/sd.py there)")
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
        from comfy.cli_args import args

        if cpu:
            args.cpu = True  # smoke mode: GPUs are hidden, ComfyUI must not ask CUDA for a device
        import comfy.model_management as mm
        import comfy.sample
        import comfy.samplers
        import comfy.sd
        import comfy.utils

        self.path, self.mm, self.sd, self.sample, self.utils = path, mm, comfy.sd, comfy.sample, comfy.utils
        try:
            from comfyui_version import __version__ as version
        except ImportError:
            version = "unknown"
        self.version = version

    def unet_patcher(self, unet: torch.nn.Module, dtype: torch.dtype):
        """A ComfyUI ModelPatcher over a copy of ``unet``'s weights (diffusers keys; ComfyUI converts them)."""
        sd = {k: v.detach().to("cpu", copy=True) for k, v in unet.state_dict().items()}
        with quiet_root_logger():  # ComfyUI warns once per optional diffusers key the UNet does not have
            patcher = self.sd.load_diffusion_model_state_dict(sd, model_options={"dtype": dtype})
        if patcher is None:
            raise RuntimeError("ComfyUI did not recognise the UNet state dict (load_diffusion_model_state_dict)")
        return patcher

    def vae(self, vae: torch.nn.Module, dtype: torch.dtype):
        sd = {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in vae.state_dict().items()}
        return self.sd.VAE(sd=sd, dtype=dtype)

    def ksampler(self, patcher, positive, negative, latent: torch.Tensor, steps: int, cfg: float, seed: int,
                 sampler: str = "ddim", scheduler: str = "ddim_uniform"):
        """``nodes.common_ksampler`` (default sampler ``ddim`` / scheduler ``ddim_uniform``), progress bar off."""
        latent = self.sample.fix_empty_latent_channels(patcher, latent)
        noise = self.sample.prepare_noise(latent, seed, None)
        return self.sample.sample(patcher, noise, steps, cfg, sampler, scheduler, positive, negative, latent,
                                  denoise=1.0, disable_pbar=True, seed=seed)

    def vae_decode_tiled(self, vae, latent: torch.Tensor, tile_size: int = 512, overlap: int = 64):
        """``VAEDecodeTiled.decode`` for an image VAE (the node's own overlap clamp included)."""
        if tile_size < overlap * 4:
            overlap = tile_size // 4
        c = vae.spacial_compression_decode()
        return vae.decode_tiled(latent, tile_x=tile_size // c, tile_y=tile_size // c, overlap=overlap // c)

    def upscale_with_model(self, model, image: torch.Tensor, device: torch.device, tile: int = 512, overlap: int = 32):
        """``ImageUpscaleWithModel.execute``: free memory for the model, move it to the device, tiled_scale with the
        node's tile/overlap (OOM halving included), and move the model back to the CPU, as the node does every call
        (the weights' upload and download are part of ComfyUI's time, as ours' are of LeanESRGANUpscale's)."""
        required = self.mm.module_size(model.model)
        required += (512 * 512 * 3) * image.element_size() * max(model.scale, 1.0) * 384.0  # the node's estimate
        required += image.nelement() * image.element_size()
        self.mm.free_memory(required, device)
        model.to(device)
        in_img = image.movedim(-1, -3).to(device)
        while True:
            try:
                out = self.utils.tiled_scale(in_img, lambda a: model(a), tile_x=tile, tile_y=tile, overlap=overlap,
                                             upscale_amount=model.scale)
                break
            except self.mm.OOM_EXCEPTION:
                tile //= 2
                if tile < 128:
                    raise
        model.to("cpu")
        return torch.clamp(out.movedim(-3, -1), min=0, max=1.0)

    def unload_all(self) -> None:
        self.mm.unload_all_models()
        self.mm.soft_empty_cache()

    @contextlib.contextmanager
    def card_of(self, budget_bytes: int, device: torch.device):
        """Make ComfyUI plan its loads as on a card of ``budget_bytes`` (see the module docstring)."""
        real = self.mm.get_free_memory

        def free_on_budget(dev=None, torch_free_too=False):
            dev = self.mm.get_torch_device() if dev is None else dev
            if getattr(dev, "type", None) != "cuda":
                return real(dev, torch_free_too)
            stats = torch.cuda.memory_stats(dev)
            reserved = stats["reserved_bytes.all.current"]
            torch_free = reserved - stats["active_bytes.all.current"]
            total = max(budget_bytes - reserved, 0) + torch_free
            return (total, torch_free) if torch_free_too else total

        self.mm.get_free_memory = free_on_budget
        try:
            yield
        finally:
            self.mm.get_free_memory = real


@contextlib.contextmanager
def quiet_root_logger(level: int = logging.ERROR):
    """Raise the root logger's level for a block (ComfyUI logs through the root logger); restored on exit."""
    root = logging.getLogger()
    old = root.level
    root.setLevel(level)
    try:
        yield
    finally:
        root.setLevel(old)


def sd_cond(kind: str, context: torch.Tensor, pooled: Optional[torch.Tensor], hw: int) -> list:
    """ComfyUI CONDITIONING for a prompt embedding (SDXL: pooled output and size conditioning)."""
    if kind == "sdxl":
        return [[context, {"pooled_output": pooled, "width": hw, "height": hw, "crop_w": 0, "crop_h": 0,
                           "target_width": hw, "target_height": hw}]]
    return [[context, {}]]
