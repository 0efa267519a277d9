"""Tiled VAE Decode / Encode nodes (declarations only; the work is in ``vae/``)."""
from __future__ import annotations

from ..vae.targets import resolve_target
from ..vae.tiled import SEAM_MODES, tiled_decode, tiled_encode

_TILING = {
    "tile_size": ("INT", {"default": 0, "min": 0, "max": 4096, "step": 32,
                          "tooltip": "Tile size in image pixels. 0 = auto: the largest tile that fits the free VRAM "
                                     "(and the loader's budget). Otherwise 128-4096. On out-of-memory the tile is "
                                     "halved and retried down to 128 px; later images of the batch keep it."}),
    "overlap": ("INT", {"default": 64, "min": 0, "max": 512, "step": 8,
                        "tooltip": "Not used: both modes compute exactly the halo their tiles need, so nothing is "
                                   "cross-faded. Kept so saved workflows load (it was 'blend' mode's cross-fade "
                                   "width when 'blend' cross-faded tiles)."}),
}


def _seam_mode(op: str) -> tuple:
    """The ``seam_mode`` widget of the node that does ``op`` ("decode" or "encode"): its tooltip names that op."""
    return (list(SEAM_MODES), {"default": "exact",
                               "tooltip": "exact: every GroupNorm uses whole-image statistics, so the result equals "
                                          f"an untiled {op} (no seams, no tone shifts). blend: the same seamless "
                                          "tiles with the statistics of the GroupNorm inside each ResNet block "
                                          "estimated (exact means, variances from a subset of columns): about a "
                                          "fifth less work, a small diffuse difference from the untiled "
                                          f"{op}. Qwen-Image's VAE normalises each pixel on its own: it has no "
                                          "statistics to estimate, so both modes are exact there."})


_MODELS = {
    "lean_model": ("LEAN_MODEL", {"tooltip": "The Memory Pool Loader's model; its VAE runs in the loader's "
                                             "vae_dtype inside its VRAM policy. Connect this or 'vae', not both."}),
    "vae": ("VAE", {"tooltip": "A ComfyUI VAE (e.g. from Load Checkpoint or Load VAE). Connect this or "
                               "'lean_model', not both."}),
}


class LeanTiledVAEDecode:
    DESCRIPTION = ("Decode latents to an image in tiles with bounded VRAM. 'exact' mode matches an untiled decode "
                   "(whole-image GroupNorm statistics gathered across tiles); 'blend' estimates part of those "
                   "statistics for less work (approximate, seamless).")
    CATEGORY = "LeanDiffusion/vae"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("IMAGE",)
    OUTPUT_TOOLTIPS = ("The decoded images (IMAGE [batch, 8h, 8w, 3], 0..1), for Save Image, upscalers or any image "
                       "node.",)
    FUNCTION = "decode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT", {"tooltip": "The latent to decode (raw VAE latent space)."}),
                             **_TILING, "seam_mode": _seam_mode("decode")},
                "optional": dict(_MODELS)}

    def decode(self, samples, tile_size=0, overlap=64, seam_mode="exact", lean_model=None, vae=None):
        target = resolve_target(lean_model, vae)
        if not isinstance(samples, dict) or "samples" not in samples:
            raise ValueError(f"samples: expected a LATENT (a dict with a 'samples' tensor), got "
                             f"{type(samples).__name__}; connect a sampler's or VAE Encode's LATENT output")
        return (tiled_decode(target, samples["samples"], tile_size, overlap, seam_mode),)


class LeanTiledVAEEncode:
    DESCRIPTION = ("Encode an image to latents in tiles with bounded VRAM. 'exact' mode matches an untiled encode; "
                   "'blend' estimates part of its statistics for less work (approximate, seamless). Returns the "
                   "latent distribution's mean, as ComfyUI's VAE Encode does.")
    CATEGORY = "LeanDiffusion/vae"
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("LATENT",)
    OUTPUT_TOOLTIPS = ("The image's latents (the distribution mean, raw VAE latent space), e.g. for a sampler's "
                       "latent_image.",)
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"pixels": ("IMAGE", {"tooltip": "The image to encode (cropped to multiples of 8; an alpha "
                                                             "channel is dropped, as VAE Encode does)."}),
                             **_TILING, "seam_mode": _seam_mode("encode")},
                "optional": dict(_MODELS)}

    def encode(self, pixels, tile_size=0, overlap=64, seam_mode="exact", lean_model=None, vae=None):
        target = resolve_target(lean_model, vae)
        return ({"samples": tiled_encode(target, pixels, tile_size, overlap, seam_mode)},)


NODE_CLASS_MAPPINGS = {"LeanTiledVAEDecode": LeanTiledVAEDecode, "LeanTiledVAEEncode": LeanTiledVAEEncode}
NODE_DISPLAY_NAME_MAPPINGS = {"LeanTiledVAEDecode": "Tiled VAE Decode", "LeanTiledVAEEncode": "Tiled VAE Encode"}
