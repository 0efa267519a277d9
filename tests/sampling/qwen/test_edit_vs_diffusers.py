"""The Fused Edit Sampler's LATENT equals diffusers' QwenImageEditPlusPipeline (the fidelity contract): one and two
reference images, true_cfg_scale 1 (one pass) and 4 (true CFG with its norm rescale), under ``full`` (and
``lowvram`` and ``stream`` for one reference), with the pipeline's own sizes at megapixels 1 and with its area constant scaled for a smaller run; a
batch of images is that many edits, each the pipeline's run with its noise row. The pipeline's packed latent is
unpacked by diffusers' own helper and converted to raw VAE space with the VAE config's per-channel statistics."""
import pytest
import torch
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus

from leandiffusion.nodes.edit import LeanEditSampler
from leandiffusion.sampling.qwen.edit import EditSettings, sample_qwen_edit
from leandiffusion.tests.kit.qwen_edit import image_batch, pictures

TOL = 1e-4
NEGATIVE = "blurry, dark"
SMALL = 0.0625  # megapixels: a 256x256-area run


def _raw(pipe, packed, width, height):
    latents = QwenImageEditPlusPipeline._unpack_latents(packed, height, width, pipe.vae_scale_factor)[:, :, 0]
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1)
    return latents * std + mean


def _pipeline_raw(pipe, monkeypatch, images, instruction, cfg, steps, seed, megapixels, latents=None):
    """The pipeline on the pictures of one edit; at ``megapixels`` != 1 its VAE area constant is scaled and the
    output size (the first image's aspect ratio at that area) passed in."""
    monkeypatch.setattr(edit_plus, "VAE_IMAGE_SIZE", int(1024 * 1024 * megapixels))
    w, h = images[0].size
    width, height = edit_plus.calculate_dimensions(1024 * 1024 * megapixels, w / h)
    width, height = width // 16 * 16, height // 16 * 16
    size = {} if megapixels == 1.0 else {"width": width, "height": height}
    packed = pipe(image=images, prompt=instruction, negative_prompt=NEGATIVE, true_cfg_scale=cfg,
                  num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(seed), latents=latents,
                  output_type="latent", **size).images
    return _raw(pipe, packed, width, height)


@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_one_reference_equals_the_pipeline(edit_pipe, edit_engine, monkeypatch, cfg, opened_sessions):
    image = image_batch(0, 1, 72, 104)
    ref = _pipeline_raw(edit_pipe, monkeypatch, pictures(image), "make it red", cfg, 3, 7, SMALL)
    out = sample_qwen_edit(edit_engine, EditSettings("make it red", NEGATIVE, seed=7, steps=3, true_cfg=cfg,
                                                     megapixels=SMALL), image)["samples"]
    assert out.shape == ref.shape and out.shape[:2] == (1, 16) and out.dtype == torch.float32
    assert (out - ref).abs().max().item() <= TOL
    assert ref.abs().max().item() > 1.0
    assert opened_sessions == ["text", "vae", "unet"]


@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_two_references_equal_the_pipeline(edit_pipe, edit_full, monkeypatch, cfg):
    """image2 of another aspect ratio: its own VAE size and RoPE grid; the output follows image."""
    image, image2 = image_batch(1, 1, 96, 80), image_batch(2, 1, 64, 128)
    ref = _pipeline_raw(edit_pipe, monkeypatch, pictures(image) + pictures(image2), "put Picture 2 on Picture 1",
                        cfg, 2, 3, SMALL)
    out = sample_qwen_edit(edit_full, EditSettings("put Picture 2 on Picture 1", NEGATIVE, seed=3, steps=2,
                                                     true_cfg=cfg, megapixels=SMALL), image, image2)["samples"]
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= TOL
    one = sample_qwen_edit(edit_full, EditSettings("put Picture 2 on Picture 1", NEGATIVE, seed=3, steps=2,
                                                     true_cfg=cfg, megapixels=SMALL), image)["samples"]
    assert (one - out).abs().max().item() > 1e-2  # the second reference is seen


def test_the_node_at_the_pipelines_own_sizes(edit_pipe, edit_full, monkeypatch):
    """megapixels 1: the pipeline unchanged (its 1024x1024 area, its output size from the image)."""
    engine = edit_full
    image = image_batch(4, 1, 64, 80)
    ref = _pipeline_raw(edit_pipe, monkeypatch, pictures(image), "a hat", 4.0, 2, 11, 1.0)
    (out,) = LeanEditSampler().run(engine, image, "a hat", NEGATIVE, 11, 2, 4.0, 1.0, "cuda_graph")
    assert out["samples"].shape == ref.shape == (1, 16, 928 // 8, 1152 // 8)
    assert (out["samples"] - ref).abs().max().item() <= TOL


def test_a_batch_is_that_many_edits(edit_pipe, edit_full, monkeypatch):
    """Two images with one shared image2: row b is the pipeline on row b's pictures with noise row b of the one
    batch-wide draw."""
    image, image2 = image_batch(5, 2, 80, 80), image_batch(6, 1, 80, 80)
    settings = EditSettings("swap colours", NEGATIVE, seed=21, steps=2, true_cfg=4.0, megapixels=SMALL)
    out = sample_qwen_edit(edit_full, settings, image, image2)["samples"]
    h, w = out.shape[2:]
    noise = torch.randn((2, 16, h, w), generator=torch.Generator("cpu").manual_seed(21))
    for b in range(2):
        latents = QwenImageEditPlusPipeline._pack_latents(noise[b:b + 1], 1, 16, h, w)
        ref = _pipeline_raw(edit_pipe, monkeypatch, pictures(image[b:b + 1]) + pictures(image2), "swap colours",
                            4.0, 2, 0, SMALL, latents=latents)
        assert (out[b:b + 1] - ref).abs().max().item() <= TOL
    assert (out[0] - out[1]).abs().max().item() > 1e-2
