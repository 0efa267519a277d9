"""Every VRAM policy runs Qwen-Image (CPU, fp32) with the result of ``full``, bit for bit, and ``stream`` really
streams both a 6-block stand-in for the 60-block MMDiT and the Qwen2.5-VL language model (the CUDA path's schedule, copies
synchronous on the CPU); a budget below the working minimum is refused before anything is placed.

Guards issue 44's "stream keeps every stage within vram_budget_gb: the DiT streamed block by block, the Qwen2.5-VL
text encoder's language model decoder layer by decoder layer": the text-to-image loop (``sampling/qwen/loop.py``:
prompt encoding, then the transformer's own forward per guided step), the language model's hidden states (its
multimodal rotary positions computed on the device from the host-looked-up embeddings), and that the streamed
weights really come from the streamers' host copies (zeroing them changes the output).
"""
import pytest
import torch

from leandiffusion.memory.engine import parts_from_components
from leandiffusion.sampling.flow.settings import FlowSettings
from leandiffusion.sampling.qwen.loop import sample_qwen_image
from leandiffusion.sampling.qwen.text import encode_prompts
from leandiffusion.tests.kit.partial_stream import assert_refused_below_minimum, engine_under, removed_to_plain, \
    replace_deeper

POLICIES = ["full", "balanced", "lowvram", "stream", "auto"]
WORKING_SHAPE = (2, 8, 8)
PROMPTS = ["a red cube", "a lighthouse on a cliff at dusk, waves and gulls"]
SETTINGS = FlowSettings("a red cat on a blue sofa", "blurry", seed=3, steps=2, cfg=4.0, width=48, height=32,
                        batch_size=2, acceleration="none")
TEXT_LAYERS, DIT_BLOCKS = 12, 6


def _components(seed: int = 0) -> dict:
    """The tiny Qwen-Image with a deeper DiT (6 joint blocks) and a 12-layer language model whose weights do not
    fit beside the DiT's resident set, so under ``stream`` both stream."""
    from diffusers import QwenImageTransformer2DModel
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel

    from leandiffusion.memory import tiny_qwen_image

    comps = tiny_qwen_image.build_tiny_qwen_image(seed)
    text_config = tiny_qwen_image.text_config(comps["tokenizer"]).text_config
    text_config.num_hidden_layers, text_config.intermediate_size = TEXT_LAYERS, 1024
    text_config.layer_types = ["full_attention"] * TEXT_LAYERS

    def build():
        dit = QwenImageTransformer2DModel(**{**tiny_qwen_image.transformer_config(), "num_layers": DIT_BLOCKS})
        with torch.no_grad():
            torch.nn.init.normal_(dit.proj_out.weight, std=0.2)
        return dit, Qwen2_5_VLTextModel(text_config)

    return replace_deeper(comps, seed + 1, build)


def _parts():
    return parts_from_components(_components(), name="tiny-qwen-deep")


def _engine(policy: str):
    return engine_under(_parts(), policy, WORKING_SHAPE)


def _dit_forward(engine, seed=1):
    """One guided-batch transformer call as the loop makes it (2 rows, 3 x 2 patches, a masked 7-token prompt)."""
    dit = engine.parts.unet
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 6, 64, generator=g)
    embeds = torch.randn(2, 7, dit.config.joint_attention_dim, generator=g)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    with engine.session("unet"), torch.no_grad():
        return dit(hidden_states=x, timestep=torch.tensor([0.7, 0.7]), guidance=None, encoder_hidden_states=embeds,
                   encoder_hidden_states_mask=mask, img_shapes=[[(1, 3, 2)]] * 2, return_dict=False)[0]


@pytest.fixture(scope="module")
def reference():
    engine = _engine("full")
    return dict(dit=_dit_forward(engine), text=encode_prompts(engine, PROMPTS),
                latent=sample_qwen_image(engine, SETTINGS, quiet=True)["samples"])


@pytest.fixture(scope="module")
def streamed():
    return _engine("stream")


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_the_latent_and_text_of_full(reference, policy):
    engine = _engine(policy)
    for _ in range(2):  # a second forward reuses the staging rings
        assert torch.equal(_dit_forward(engine), reference["dit"]), policy
    for got, want in zip(encode_prompts(engine, PROMPTS), reference["text"]):
        assert torch.equal(got, want), policy
    latent = sample_qwen_image(engine, SETTINGS, quiet=True)["samples"]
    assert torch.equal(latent, reference["latent"]), policy
    assert reference["latent"].abs().max().item() > 0.5  # a real latent, not one any output would match
    if policy == "auto":
        assert engine.placement.plan.policy == "full"  # auto on the CPU stays full


def test_the_stream_plan_streams_both_and_keeps_every_stage_within_the_budget(streamed):
    plan = streamed.placement.plan
    assert plan.text_mode == "stream" and plan.unet_mode == "stream"
    assert plan.text_streamed_units == plan.text_total_units == TEXT_LAYERS
    assert 0 < plan.streamed_units < plan.total_units == DIT_BLOCKS
    assert max(plan.peaks.values()) <= plan.budget_bytes
    assert plan.text_tokens == 1058  # the family's longest prompt: 34 template tokens + 1024
    assert f"streamed {TEXT_LAYERS} of {TEXT_LAYERS} blocks" in streamed.plan


def test_the_dit_streams_from_its_host_copies(streamed, reference):
    streamer = streamed.placement.streamer
    sched = streamer.schedule
    issued = streamer.copies_issued
    assert torch.equal(_dit_forward(streamed), reference["dit"])
    assert streamer.copies_issued - issued == len(sched.streamed)  # every streamed block copied once per forward
    saved = streamer.host.tensor.clone()
    streamer.host.tensor.zero_()  # the host copies are the only source of the streamed blocks' weights
    try:
        assert (_dit_forward(streamed) - reference["dit"]).abs().max().item() > 1e-3
    finally:
        streamer.host.tensor.copy_(saved)
    assert torch.equal(_dit_forward(streamed), reference["dit"])


def test_the_language_model_streams_only_while_the_text_stage_runs(streamed, reference):
    (swap,) = streamed.placement._swaps["text"]
    encoder = streamed.parts.text_encoder
    layer_params = [p for layer in encoder.layers for p in layer.parameters()]

    def inside(buffer, p):
        return buffer.data_ptr() <= p.data_ptr() < buffer.data_ptr() + buffer.numel()

    assert swap.arena is None and all(inside(swap.host.tensor, p) for p in layer_params)
    issued = swap.copies_issued
    got = encode_prompts(streamed, PROMPTS)
    assert swap.copies_issued - issued == TEXT_LAYERS * len(PROMPTS)  # one pass per prompt (unpadded, as the pipeline)
    assert swap.arena is None
    for g, want in zip(got, reference["text"]):
        assert torch.equal(g, want)
    embed = encoder.embed_tokens.weight  # on the host, in neither of the streamer's buffers
    assert not inside(swap.resident, embed) and not inside(swap.host.tensor, embed)
    assert swap.resident.numel() == streamed.placement.plan.text_fixed_bytes  # only the final norm is resident
    saved = swap.host.tensor.clone()
    swap.host.tensor.zero_()
    try:
        assert not torch.equal(encode_prompts(streamed, PROMPTS)[0], reference["text"][0])
    finally:
        swap.host.tensor.copy_(saved)


def test_a_budget_below_the_working_minimum_is_refused_before_anything_is_placed(monkeypatch):
    assert_refused_below_minimum(_parts(), WORKING_SHAPE, 1058, monkeypatch)


def test_remove_leaves_plain_modules_with_the_same_outputs(reference):
    plain = removed_to_plain(_engine("stream"))
    assert torch.equal(_dit_forward(plain), reference["dit"])
    for got, want in zip(encode_prompts(plain, PROMPTS), reference["text"]):
        assert torch.equal(got, want)
