"""Bad input to the Fused Edit Sampler is one clear error naming the input, raised before any stage opens: no
image, an image under 64 px, a reference batch that fits neither 1 nor image's, a model that is not Qwen-Image-Edit
(SD, Z-Image) or a Qwen-Image whose text stage has no vision tower; and the nodes that do not run an edit model yet
refuse it by name (families.json ``nodes_not_yet``), the Fused DDIM Sampler as a flow-matching DiT."""
import pytest
import torch

from leandiffusion.nodes.edit import LeanEditSampler
from leandiffusion.tests.kit import tiny_engine
from leandiffusion.tests.kit.qwen_edit import image_batch

NOT_YET = (r"lean_model is a qwen_image_edit model \(Qwen-Image-Edit \(MMDiT\)\); the {node} does not run it yet: "
           r"{fix}")


def _engine(family):
    if family == "zimage":
        from leandiffusion.memory.engine import engine_from_parts, parts_from_components
        from leandiffusion.memory.tiny_zimage import build_tiny_zimage

        return engine_from_parts(parts_from_components(build_tiny_zimage(seed=0)))
    return tiny_engine(family)


def _run(engine, image, image2=None, **kw):
    args = dict(instruction="x", negative="", seed=0, steps=1, true_cfg=1.0, megapixels=0.0625, acceleration="none")
    args.update(kw)
    return LeanEditSampler().run(engine, image, image2=image2, **args)


@pytest.mark.parametrize("image,image2,message", [
    (None, None, r"image: no image connected"),
    (torch.zeros(1, 48, 96, 3), None, r"image: 96x48 px is smaller than 64 px on a side"),
    (torch.zeros(1, 96, 96, 3), torch.zeros(1, 96, 40, 3), r"image2: 40x96 px is smaller than 64 px"),
    (torch.zeros(2, 96, 96, 3), torch.zeros(3, 96, 96, 3), r"image2: batch of 3 images, but image has 2"),
])
def test_bad_images_are_named(edit_full, image, image2, message, opened_sessions):
    with pytest.raises(ValueError, match=message):
        _run(edit_full, image, image2)
    assert opened_sessions == []


def test_a_non_image_is_a_type_error(edit_full, opened_sessions):
    with pytest.raises(TypeError, match=r"image: expected an IMAGE"):
        _run(edit_full, torch.zeros(96, 96, 3))
    assert opened_sessions == []


@pytest.mark.parametrize("family", ["sd1", "zimage"])
def test_an_sd_or_zimage_model_is_refused(family, opened_sessions):
    with pytest.raises(ValueError, match=rf"lean_model: expected a Qwen-Image-Edit model \(family qwen_image_edit\), "
                                         rf"got {family}"):
        _run(_engine(family), image_batch(0, 1, 64, 64))
    assert opened_sessions == []


def test_a_qwen_image_without_vision_tower_is_refused(qwen_engine, opened_sessions):
    with pytest.raises(ValueError, match=r"lean_model: this qwen_image model's text encoder has no vision tower.*"
                                         r"qwen_2\.5_vl_7b\.safetensors, with its visual\.\* tensors"):
        _run(qwen_engine, image_batch(0, 1, 64, 64))
    assert opened_sessions == []


def test_the_folder_loads_as_qwen_image_edit_with_the_whole_vl_encoder(edit_full):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    assert edit_full.family == "qwen_image_edit"
    assert isinstance(edit_full.parts.text_encoder, Qwen2_5_VLModel)  # vision tower + language model, no LM head
    assert edit_full.parts.image_processor.merge_size == 2


def test_the_fused_ddim_sampler_refuses_it_as_a_flow_dit(edit_full, opened_sessions):
    from leandiffusion.sampling.loop import sample
    from leandiffusion.sampling.settings import SamplerSettings

    with pytest.raises(ValueError, match=r"lean_model is a qwen_image_edit model \(a flow-matching DiT\)"):
        sample(edit_full, SamplerSettings("a cat"))
    assert opened_sessions == []


def test_the_fused_flow_sampler_refuses_it(edit_full, opened_sessions):
    from leandiffusion.nodes.flow import LeanFlowSampler

    with pytest.raises(ValueError, match=NOT_YET.format(node="Fused Flow Sampler",
                                                        fix="edit images with the Fused Edit Sampler")):
        LeanFlowSampler().run(edit_full, "a cat", "", 0, 2, 1.0, 32, 32, 1, "none")
    assert opened_sessions == []


def test_the_fused_ksampler_refuses_it(edit_full, opened_sessions):
    from leandiffusion.nodes.ksampler import LeanKSampler

    with pytest.raises(ValueError, match=NOT_YET.format(node="Fused KSampler",
                                                        fix="edit images with the Fused Edit Sampler")):
        LeanKSampler().run(edit_full, 0, 2, 1.0, "euler", "simple", {"samples": torch.zeros(1, 16, 4, 4)}, 1.0,
                           "none")
    assert opened_sessions == []


def test_tiled_vae_decodes_its_latent(edit_full):
    """The edit family shares Qwen-Image's VAE, so the Tiled VAE nodes run it (not refused)."""
    from leandiffusion.nodes.vae import LeanTiledVAEDecode

    latent = torch.randn(1, 16, 6, 8, generator=torch.Generator().manual_seed(0))
    (image,) = LeanTiledVAEDecode().decode({"samples": latent}, 0, 64, "exact", lean_model=edit_full)
    with torch.no_grad():
        ref = edit_full.parts.vae.decode(latent[:, :, None]).sample[:, :, 0]
    ref = ((ref.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1)
    assert image.shape == ref.shape and (image - ref).abs().max().item() < 1e-4


def test_one_step_is_refused_naming_steps(edit_full, opened_sessions):
    """Qwen's terminal-stretched schedule is 0 / 0 at one step (the pipelines return NaN): refused, not NaN."""
    with pytest.raises(ValueError, match=r"steps=1: this model's schedule \(a terminal shift\) needs at least 2 steps"):
        _run(edit_full, image_batch(0, 1, 64, 64), steps=1)
    assert opened_sessions == []
