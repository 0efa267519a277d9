"""Qwen-Image LoRAs on the MMDiT: what the injector refuses and how it selects (the sampler-level equality with
``QwenImagePipeline.load_lora_weights`` per layout is ``tests/sampling/qwen/test_qwen_lora.py``).

Guards: a Z-Image or SD LoRA into a Qwen-Image model, and a Qwen-Image LoRA into a Z-Image or SD model, refused by
``lora_name`` with both families named and the model untouched; layers the MMDiT does not have (a Flux LoRA's
``ff`` / ``norm1`` layers) listed, never skipped; merged mode equal to unmerged with the weights restored;
``target_blocks`` selecting joint blocks by diffusers' names, a typo answered with the DiT's blocks.
"""
import pytest
import torch

from leandiffusion.lora import inject_lora
from leandiffusion.memory.engine import parts_from_components
from leandiffusion.memory.load import build_engine
from leandiffusion.memory.tiny_qwen_image import build_tiny_qwen_image
from leandiffusion.memory.tiny_zimage import build_tiny_zimage
from leandiffusion.nodes.lora import NODE_CLASS_MAPPINGS
from leandiffusion.tests.kit import qwen_image_lora as kit
from leandiffusion.tests.kit import tiny_components, tiny_engine
from leandiffusion.tests.kit import zimage_lora as zl
from leandiffusion.tests.lora import lorafiles as lf

TOL = 1e-5


@pytest.fixture(scope="module")
def engine():
    return build_engine(parts_from_components(build_tiny_qwen_image(seed=0)), "full", device="cpu")


@pytest.fixture(scope="module")
def inputs():
    """Keyword inputs of ``QwenImageTransformer2DModel.forward``: 2 images of 4x6 patches, 7 text tokens (the
    second prompt's last 2 masked out)."""
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    return dict(hidden_states=torch.randn(2, 24, 64, generator=g), timestep=torch.tensor([0.7, 0.3]),
                encoder_hidden_states=torch.randn(2, 7, 32, generator=g), encoder_hidden_states_mask=mask,
                img_shapes=[[(1, 4, 6)]] * 2, guidance=None, attention_kwargs={}, return_dict=False)


def _run(view, inputs) -> torch.Tensor:
    with view.session("unet"), torch.no_grad():
        return view.parts.unet(**inputs)[0]


@pytest.fixture()
def loras(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(tmp_path))
    return tmp_path / "loras"


def test_a_lora_of_another_architecture_is_refused_by_name_either_way(engine, loras):
    node = NODE_CLASS_MAPPINGS["LeanLoraInjector"]()
    sd1 = tiny_components("sd1")
    lf.write(lf.kohya_state_dict({"unet": sd1["unet"], "text_encoder": sd1["text_encoder"]},
                                 {"unet": lf.ATTN_FF, "text_encoder": lf.TE_LINEARS}), loras / "sd.safetensors")
    zimage = build_tiny_zimage(seed=0)
    zl.write(zl.original_state_dict(zl.original_factors(zimage["transformer"])), loras / "z.safetensors")
    kit.write_layout(engine.parts.unet, "comfy_down", loras / "qwen.safetensors")
    before = lf.snapshot(engine.parts.unet, engine.parts.text_encoder)
    for name, made_for, example in (("sd.safetensors", "SD1.x / SD2.x / SDXL", "lora_(unet|te)_"),
                                    ("z.safetensors", "Z-Image", r"diffusion_model\.")):
        with pytest.raises(ValueError, match=rf"lora_name='{name}': a {made_for} LoRA \(layers such as {example}.*"
                                             rf"the model is qwen_image \(Qwen-Image \(MMDiT\)\).*pick a Qwen-Image "
                                             rf"LoRA for this model, or load a {made_for} model for this LoRA"):
            node.inject(engine, name, 1.0, 1.0, "", "unmerged")
    lf.assert_untouched(before, engine.parts.unet, engine.parts.text_encoder)
    assert engine.adapters == ()
    for other, family in ((build_engine(parts_from_components(zimage), "full", device="cpu"), "zimage"),
                          (tiny_engine("sd1"), "sd1")):
        before = lf.snapshot(other.parts.unet, other.parts.text_encoder)
        with pytest.raises(ValueError, match=r"lora_name='qwen.safetensors': a Qwen-Image LoRA \(layers such as "
                                             rf"diffusion_model\.(transformer_blocks|img_in|txt_in|proj_out|norm_out|"
                                             rf"time_text).*the model is {family} "):
            node.inject(other, "qwen.safetensors", 1.0, 1.0, "", "unmerged")
        lf.assert_untouched(before, other.parts.unet, other.parts.text_encoder)


def test_layers_the_mmdit_does_not_have_are_listed(engine, tmp_path):
    """A Flux-style file (same joint-attention names, but ``ff`` / ``norm1`` where Qwen-Image has ``img_mlp`` /
    ``img_mod``) is not half applied: every layer without a module is named."""
    sd = kit.state_dict(kit.factors(engine.parts.unet, rank=2), "comfy_down")
    for key, (out, inp) in {"diffusion_model.transformer_blocks.0.ff.net.0.proj": (256, 64),
                            "diffusion_model.transformer_blocks.1.norm1.linear": (384, 64)}.items():
        sd.update({key + ".lora_down.weight": torch.zeros(2, inp), key + ".lora_up.weight": torch.zeros(out, 2)})
    before = lf.snapshot(engine.parts.unet)
    with pytest.raises(ValueError, match=r"2 of \d+ layers match no module of the qwen_image model.*"
                                         r"transformer_blocks\.0\.ff\.net\.0\.proj.*transformer_blocks\.1\.norm1"):
        inject_lora(engine, zl.write(sd, tmp_path / "flux_like.safetensors"))
    lf.assert_untouched(before, engine.parts.unet)


def test_merged_mode_equals_unmerged_and_restores_the_weights(engine, inputs, tmp_path):
    path = kit.write_layout(engine.parts.unet, "lightning", tmp_path / "lightning.safetensors", seed=4)
    before = lf.snapshot(engine.parts.unet)
    base = _run(engine, inputs)
    unmerged = _run(inject_lora(engine, path, 0.8), inputs)
    merged = _run(inject_lora(engine, path, 0.8, mode="merged"), inputs)
    assert (unmerged - base).abs().max().item() > 0.05
    assert (merged - unmerged).abs().max().item() <= TOL
    lf.assert_untouched(before, engine.parts.unet)
    assert torch.equal(_run(engine, inputs), base)


def test_target_blocks_select_joint_blocks_by_diffusers_names(engine, inputs, tmp_path):
    path = kit.write_layout(engine.parts.unet, "kohya", tmp_path / "kohya.safetensors", seed=6)
    view = inject_lora(engine, path, 1.0, target_blocks="transformer_blocks.1, proj_out")
    names = {t.module_name for t in view.adapters[-1].binding.targets}
    assert {"transformer_blocks.1.attn.to_add_out", "transformer_blocks.1.txt_mod.1", "proj_out"} <= names
    assert all(n.startswith("transformer_blocks.1.") or n == "proj_out" for n in names)
    assert (_run(view, inputs) - _run(engine, inputs)).abs().max().item() > 0.01
    with pytest.raises(ValueError, match=r"target_blocks: 'transformer_block\.1' names no module of the unet; valid "
                                         r"choices: img_in, norm_out, .*proj_out, .*transformer_blocks\.0-1, txt_in"):
        inject_lora(engine, path, 1.0, target_blocks="transformer_block.1")
