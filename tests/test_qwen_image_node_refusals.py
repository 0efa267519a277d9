"""A Qwen-Image LEAN_MODEL (family ``qwen_image``) loads; the Fused Flow Sampler, the Fused KSampler, the Dynamic
LoRA Injector and the Tiled VAE nodes (``tests/vae/test_qwen_vae.py``) run it, while the Stream Scheduler Sampler
refuses it with one error naming ``lean_model``, the family and what to do instead, before any stage opens (the
family's ``nodes_not_yet`` row in ``families.json``). The Fused DDIM Sampler refuses it as a flow-matching DiT."""
import pytest
import torch

from leandiffusion.memory.load import load_engine
from leandiffusion.memory.tiny_qwen_image import build_tiny_qwen_image, save_qwen_image_folder

NOT_YET = r"lean_model is a qwen_image model \(Qwen-Image \(MMDiT\)\); the {node} does not run it yet: {fix}"


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    return save_qwen_image_folder(build_tiny_qwen_image(seed=0),
                                  tmp_path_factory.mktemp("models") / "diffusers" / "tiny-qwen")


@pytest.fixture
def engine(qwen_folder, monkeypatch):
    monkeypatch.setenv("LEANDIFFUSION_MODELS", str(qwen_folder.parent.parent))
    return load_engine(qwen_folder.name, "full", device="cpu")


def test_the_stream_scheduler_refuses_it(engine, opened_sessions):
    from leandiffusion.sampling.stream.scheduler import run_stream

    with pytest.raises(ValueError, match=NOT_YET.format(node="Stream Scheduler Sampler",
                                                        fix="sample it with the Fused Flow Sampler")):
        run_stream(engine, None)
    assert opened_sessions == []




def test_the_fused_ddim_sampler_refuses_it_as_a_flow_dit(engine, opened_sessions):
    from leandiffusion.sampling.loop import sample
    from leandiffusion.sampling.settings import SamplerSettings

    with pytest.raises(ValueError, match=r"lean_model is a qwen_image model \(a flow-matching DiT\)"):
        sample(engine, SamplerSettings("a cat"))
    assert opened_sessions == []
