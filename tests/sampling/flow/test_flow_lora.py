"""The Fused Flow Sampler through the Dynamic LoRA Injector equals diffusers' ZImagePipeline after
``load_lora_weights`` at the same scale (issue contract, 1e-4 max abs on the raw LATENT), for a PEFT file written by
diffusers itself and for the original ``diffusion_model.*`` layout with fused qkv; a strength change reuses the one
captured step."""
import pytest
import torch
from safetensors.torch import load_file

from leandiffusion.nodes.lora import LeanLoraInjector
from leandiffusion.sampling.flow.loop import sample_flow
from leandiffusion.sampling.flow.settings import FlowSettings
from leandiffusion.sampling.graph_runner import GraphRunner
from leandiffusion.tests.kit import zimage_lora as kit
from leandiffusion.tests.kit.graph_backend import StandInBackend

TOL = 1e-4


@pytest.fixture(scope="module")
def lora_files(zimage_models, tmp_path_factory):
    from diffusers import ZImageTransformer2DModel

    folder = zimage_models / "diffusers" / "tiny-zimage"
    dit = ZImageTransformer2DModel.from_pretrained(str(folder / "transformer"), local_files_only=True)
    loras = zimage_models / "loras"
    peft = kit.save_peft_lora(dit, tmp_path_factory.mktemp("peft"), seed=3)
    kit.write(load_file(str(peft)), loras / "peft.safetensors")
    # diffusers skips the original names of the patch embedder and final layer (we apply them): leave them out so
    # both sides apply the same layers
    factors = {k: v for k, v in kit.original_factors(dit, seed=5).items()
               if not k.startswith(("all_x_embedder", "all_final_layer"))}
    original = kit.original_state_dict(factors, prefix="diffusion_model.", spelling="lora.down")
    kit.write(original, loras / "original.safetensors")
    return folder, loras


def _reference(folder, lora, strength, settings):
    pipe = kit.diffusers_pipeline(folder, lora)
    pipe.set_adapters(["ref"], adapter_weights=[strength])
    latents = pipe(settings.positive, negative_prompt=settings.negative, num_inference_steps=settings.steps,
                   guidance_scale=settings.cfg - 1.0, width=settings.width, height=settings.height,
                   num_images_per_prompt=settings.batch_size, generator=torch.Generator("cpu").manual_seed(settings.seed),
                   output_type="latent").images
    return latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor


@pytest.mark.parametrize("name,strength,cfg", [("peft.safetensors", 0.8, 1.0), ("original.safetensors", -0.6, 3.0)])
def test_lora_latent_equals_the_pipeline(lora_files, zimage_engine, name, strength, cfg):
    folder, loras = lora_files
    settings = FlowSettings("a red cat", "blurry", seed=9, steps=3, cfg=cfg, width=48, height=32, batch_size=2,
                            acceleration="none")
    view = LeanLoraInjector().inject(zimage_engine, name, strength, 1.0, "", "unmerged")[0]
    out = sample_flow(view, settings)["samples"]
    ref = _reference(folder, loras / name, strength, settings)
    assert (out - ref).abs().max().item() <= TOL
    plain = sample_flow(zimage_engine, settings)["samples"]
    assert (out - plain).abs().max().item() > 1e-2  # the LoRA moved the latent


def test_strength_change_reuses_the_captured_step(lora_files, zimage_engine):
    runner = GraphRunner(backend=StandInBackend(), max_graphs=4)
    settings = FlowSettings("a red cat", seed=2, steps=2, width=32, height=32, acceleration="cuda_graph")
    outs = []
    for strength in (0.5, 1.0):
        view = LeanLoraInjector().inject(zimage_engine, "peft.safetensors", strength, 1.0, "", "unmerged")[0]
        outs.append(sample_flow(view, settings, runner=runner)["samples"])
        eager = sample_flow(view, FlowSettings("a red cat", seed=2, steps=2, width=32, height=32,
                                               acceleration="none"))["samples"]
        assert torch.equal(outs[-1], eager)
    assert runner.captures(zimage_engine) == 1
    assert (outs[0] - outs[1]).abs().max().item() > 1e-3
