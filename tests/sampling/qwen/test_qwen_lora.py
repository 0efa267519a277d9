"""The Qwen-Image loop through the Dynamic LoRA Injector equals diffusers' QwenImagePipeline after
``load_lora_weights`` + ``set_adapters`` at the same scale (issue contract, 1e-4 max abs on the raw LATENT), for every
layout the injector accepts (diffusers/PEFT as ``save_lora_weights`` writes it, the few-step "Lightning" files'
bare names with alphas, ComfyUI's ``diffusion_model.*`` in both factor spellings, kohya's ``lora_unet_*``,
DiffSynth's ``lora_A.default``); a strength change gives the new result through the same binding and buffers (no
re-injection, nothing to recapture); the LoRA'd view leaves the upstream model exactly as it was."""
import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from leandiffusion.nodes.lora import LeanLoraInjector
from leandiffusion.sampling.flow.settings import FlowSettings
from leandiffusion.sampling.qwen.loop import sample_qwen_image
from leandiffusion.tests.kit import qwen_image_lora as kit
from leandiffusion.tests.lora import lorafiles as lf
from leandiffusion.tests.sampling.qwen.test_loop_vs_diffusers import NEGATIVE, _pipeline_raw

TOL = 1e-4
LAYOUTS = ("peft", *kit.LAYOUTS)


@pytest.fixture(scope="module")
def loras(qwen_folder):
    """``<models>/loras/<layout>.safetensors`` for the tiny Qwen-Image of ``qwen_folder``, each with other factors."""
    dit = QwenImageTransformer2DModel.from_pretrained(str(qwen_folder / "transformer"), local_files_only=True)
    root = qwen_folder.parent.parent / "loras"
    for seed, layout in enumerate(LAYOUTS):
        kit.write_layout(dit, layout, root / f"{layout}.safetensors", seed=seed)
    return root


def _settings(cfg: float, batch: int = 1, seed: int = 3) -> FlowSettings:
    return FlowSettings("a red cat", NEGATIVE, seed=seed, steps=3, cfg=cfg, width=32, height=48, batch_size=batch,
                        acceleration="none")


def _reference(pipe, strength: float, s: FlowSettings) -> torch.Tensor:
    pipe.set_adapters(["ref"], adapter_weights=[strength])
    return _pipeline_raw(pipe, s.positive, s.cfg, s.steps, s.width, s.height, s.batch_size, s.seed)


def _inject(engine, layout: str, strength: float):
    return LeanLoraInjector().inject(engine, f"{layout}.safetensors", strength, 1.0, "", "unmerged")[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_latent_equals_the_pipeline(qwen_folder, loras, qwen_engine, layout):
    """Every layout at a strength of its own, guided and not; the reference applies every layer of the file."""
    i = LAYOUTS.index(layout)
    strength, s = (0.8, -0.6, 1.3)[i % 3], _settings(cfg=(1.0, 4.0)[i % 2], batch=1 + i % 2, seed=i)
    pipe = kit.diffusers_pipeline(qwen_folder, loras / f"{layout}.safetensors")
    assert kit.peft_layers(pipe.transformer) == len(kit.target_names(qwen_engine.parts.unet))
    out = sample_qwen_image(_inject(qwen_engine, layout, strength), s)["samples"]
    ref = _reference(pipe, strength, s)
    assert (out - ref).abs().max().item() <= TOL
    plain = sample_qwen_image(qwen_engine, s)["samples"]
    assert (out - plain).abs().max().item() > 1e-2, "the LoRA must move the latent for the comparison to mean anything"


def test_a_strength_change_reuses_the_binding_and_gives_the_new_result(qwen_folder, loras, qwen_engine):
    """Each strength's LATENT is the pipeline's at that scale, and every view shares one binding, one graph key and
    the same scaled buffers (rewritten in place): nothing is re-injected or re-captured."""
    pipe = kit.diffusers_pipeline(qwen_folder, loras / "lightning.safetensors")
    s = _settings(cfg=4.0)
    views, pointers = [], []
    for strength in (0.5, 1.0, -0.7):
        views.append(_inject(qwen_engine, "lightning", strength))
        out = sample_qwen_image(views[-1], s)["samples"]
        assert (out - _reference(pipe, strength, s)).abs().max().item() <= TOL, strength
        binding = views[-1].adapters[-1].binding
        pointers.append([t.data_ptr() for t in binding._up_s["unet"]])
    assert len({id(v.adapters[-1].binding) for v in views}) == 1
    assert len({v.adapters[-1].graph_key for v in views}) == 1 and pointers[0] == pointers[1] == pointers[2]


def test_the_view_leaves_the_upstream_model_untouched(loras, qwen_engine):
    s = _settings(cfg=1.0)
    plain = sample_qwen_image(qwen_engine, s)["samples"]
    before = lf.snapshot(qwen_engine.parts.unet, qwen_engine.parts.text_encoder)
    view = _inject(qwen_engine, "kohya", 1.0)
    sample_qwen_image(view, s)
    lf.assert_untouched(before, qwen_engine.parts.unet, qwen_engine.parts.text_encoder)
    assert qwen_engine.adapters == () and len(view.adapters) == 1
    assert torch.equal(sample_qwen_image(qwen_engine, s)["samples"], plain)
