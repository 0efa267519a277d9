"""Stream Scheduler Sampler on LoRA views carrying LyCORIS (LoHa, LoKr, Tucker LoCon) and DoRA adapters.

Beside the plain LoRA view of ``test_stream_scheduler.test_a_lora_view_streams_like_the_fused_sampler_in_both_stages``.
Guards, on the tiny SD1 model in fp32 (and one SDXL case, both text encoders):
- the Stream Scheduler's contract with each adapter kind, unmerged (every forward the injector runs: LoHa in its
  Khatri-Rao and its dense form, LoKr's Kronecker identity on Linears and 3x3 convs, Tucker LoCon's conv term beside the
  shared-down attention terms, DoRA folded and not folded, on the input and the output axis, with a bias), merged, and
  stacks of two kinds: image n equals the Fused DDIM Sampler's image for its prompt with seed + n and batch 1 --
  bit-exact for the image that runs in a batch of one, within ``BATCHED_REL`` of the latents' magnitude for the batched
  ones (``images_per_prompt`` 2, ``max_batch`` 3: batches of 3 and 1). An adapter whose forward depended on the batch (a
  per-shape cache, a reshape over the batch axis, DoRA's per-channel gain broadcast over the wrong axis) moves the
  batched rows by O(1); the tolerance is the batched fp32 UNet's rounding at ``CFG`` 2. That rounding depends on the
  GEMM blocking, so on the thread count: with 2 threads the worst case is 7.3e-5, with 1 thread the SDXL LoKr + DoRA
  view reaches 1.19e-4 (1.8e-6 of its latents' 65.6), past the absolute 1e-4 bound, which ``test_stream_scheduler``'s
  plain-model runs keep at 1 to 4 threads. The adapters add GEMMs to every layer, so these runs take that file's
  relative bound, 1e-5 of the largest reference latent;
- the adapters' text-encoder part is applied in the stream's text stage: with the text strength set to 0 the
  images move by O(1), and the stream's encodings are made before the references' (the prompt cache is cleared
  in between), so neither side reads the other's;
- a strength change on the injector between two runs on one base leaves nothing stale (strength buffers, DoRA
  gains computed over a merged LoRA underneath, the prompt cache, a cached step of the graph runner): each run
  equals the same view injected into a fresh copy of the model, and afterwards the base model is its untouched
  self (weights, hooks, instance attributes; its stream output equals an untouched model's bit-for-bit);
- an out-of-memory error raised inside the UNet in the middle of a run (between two sibling attention layers
  whose LoRA downs are shared) halves the batch and retries: every image once, equal to its reference; an
  interrupt stops the run; either way the model is left unpatched and the next run is right.
"""
import pytest
import torch

from leandiffusion import bridge
from leandiffusion.lora import inject_lora
from leandiffusion.sampling.graph_runner import GraphRunner
from leandiffusion.sampling.loop import sample
from leandiffusion.sampling.prompt_encoder import PROMPT_CACHE
from leandiffusion.sampling.settings import SamplerSettings
from leandiffusion.sampling.stream.scheduler import run_stream
from leandiffusion.sampling.stream.settings import StreamSettings
from leandiffusion.tests.kit import tiny_engine
from leandiffusion.tests.lora import lorafiles as lf
from leandiffusion.tests.lora.test_lycoris import _file as lycoris_file
from leandiffusion.tests.sampling.test_stream_scheduler import StandInBackend

OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
PROMPTS = ("a red boat", "snowy forest")
CFG = 2.0
BATCHED_REL = 1e-5  # of max|reference|, as test_stream_scheduler's high-cfg case (module docstring)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``(family, case) -> path`` of a ``LYCORIS_CASES`` file on the UNet's attention, feed-forward and conv layers
    and on every text encoder (made once per module)."""
    folder = tmp_path_factory.mktemp("lycoris")
    made = {}

    def get(family: str, case: str):
        if (family, case) not in made:
            made[(family, case)] = lycoris_file(folder, family, case, seed=2)[1]
        return made[(family, case)]

    return get


def _settings(**kw) -> StreamSettings:
    base = dict(negative="blurry", seed=7, steps=2, cfg=CFG, width=64, height=64, acceleration="none",
                images_per_prompt=2, max_batch=3)
    base.update(kw)
    return StreamSettings.from_text("\n".join(PROMPTS), **base)


def _stream(view, s: StreamSettings, fresh: bool = True, **kw):
    """``run_stream``; ``fresh``: with the prompt cache cleared first, so the run's text stage encodes its prompts
    itself (a cached encoding would hide it)."""
    if fresh:
        PROMPT_CACHE.clear()
    return run_stream(view, s, quiet=True, **kw)


def _references(view, s: StreamSettings, fresh: bool = True) -> torch.Tensor:
    """The Fused DDIM Sampler's run of each image: prompt-major, seed + n, batch 1 (written out here, not read from
    the code under test); ``fresh``: encoding its prompts afresh."""
    if fresh:
        PROMPT_CACHE.clear()
    k = s.images_per_prompt
    return torch.cat([sample(view, SamplerSettings(positive=PROMPTS[n // k], negative=s.negative, seed=s.seed + n,
                                                   steps=s.steps, cfg=s.cfg, width=s.width, height=s.height,
                                                   batch_size=1, acceleration="none"), quiet=True)["samples"]
                      for n in range(len(PROMPTS) * k)])


def _check(result, refs, singles=()) -> None:
    """Every image within ``BATCHED_REL`` of the references' magnitude; the images in ``singles`` (run in a batch of
    one) bit-exact."""
    assert result.latents.shape == refs.shape
    batched_bound = BATCHED_REL * refs.abs().max().item()
    for n in range(refs.shape[0]):
        err = (result.latents[n] - refs[n]).abs().max().item()
        bound = 0.0 if n in singles else batched_bound
        assert err <= bound, f"image {n}: max abs diff {err:.3g} from the Fused DDIM Sampler's (bound {bound:g})"


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _base(family: str = "sd1"):
    """A fresh tiny engine and a snapshot of its modules, taken after transformers installed its output-capturing
    hooks (at a text encoder's first call)."""
    base = tiny_engine(family)
    lf.run_text(base.parts)
    return base, lf.snapshot(base.parts.unet, base.parts.text_encoder, base.parts.text_encoder_2)


def _untouched_and_like_a_fresh_model(base, before, s: StreamSettings) -> torch.Tensor:
    """Assert that ``base`` holds its weights, hooks and instance attributes of ``before`` and streams what an
    untouched copy of the model streams, bit-for-bit; return its latents."""
    lf.assert_untouched(before, base.parts.unet, base.parts.text_encoder, base.parts.text_encoder_2)
    plain = _stream(base, s).latents
    assert torch.equal(plain, _stream(tiny_engine(base.family), s).latents)
    return plain


# name -> (family, [(case, mode), ...] stacked in this order)
VIEWS = {
    "loha_khatri_rao": ("sd1", [("loha_lowrank", "unmerged")]),
    "loha_dense": ("sd1", [("loha_dense", "unmerged")]),
    "lokr_tucker": ("sd1", [("lokr_tucker", "unmerged")]),
    "locon_tucker": ("sd1", [("locon_tucker", "unmerged")]),
    "dora_in": ("sd1", [("dora_in", "unmerged")]),
    "dora_out_bias": ("sd1", [("dora_out", "unmerged")]),
    "loha_dora_out": ("sd1", [("loha_dora_out", "unmerged")]),
    "lokr_dora_in": ("sd1", [("lokr_dora_in", "unmerged")]),
    "dora_out_merged": ("sd1", [("dora_out", "merged")]),
    "lokr_dora_in_merged": ("sd1", [("lokr_dora_in", "merged")]),
    "loha_then_dora": ("sd1", [("loha_lowrank", "unmerged"), ("dora_out", "unmerged")]),
    "lokr_merged_then_locon_dora": ("sd1", [("lokr_tucker", "merged"), ("locon_tucker_dora_in", "unmerged")]),
    "sdxl_lokr_dora_in": ("sdxl", [("lokr_dora_in", "unmerged")]),
}


def _inject(base, files, layers, strengths):
    view = base
    for (case, mode), (s_unet, s_text) in zip(layers, strengths):
        view = inject_lora(view, files(base.family, case), s_unet, s_text, mode=mode)
    return view


@pytest.mark.parametrize("name", list(VIEWS))
def test_each_image_is_the_fused_samplers_and_the_text_part_is_applied(files, name):
    family, layers = VIEWS[name]
    base, before = _base(family)
    strengths = [(0.8, 0.9), (-0.6, 1.1)][:len(layers)]
    view = _inject(base, files, layers, strengths)
    s = _settings()
    result = _stream(view, s)
    assert result.batch_sizes == (3, 1)
    _check(result, _references(view, s), singles=(3,))
    without_text = _inject(base, files, layers, [(u, 0.0) for u, _ in strengths])
    assert _diff(result.latents, _stream(without_text, s).latents) > 1e-2, "the text-encoder part was dropped"
    plain = _untouched_and_like_a_fresh_model(base, before, s)
    assert _diff(result.latents, plain) > 1.0, "the adapters must change the images for the test to mean anything"


@pytest.mark.parametrize("layers", [
    [("lokr_tucker", "merged"), ("loha_dora_out", "unmerged")],  # DoRA gains over a merged LoRA that changes
    [("locon_tucker", "unmerged"), ("dora_in", "merged")],
], ids=["merged_lokr_under_unmerged_dora", "unmerged_locon_under_merged_dora"])
def test_a_strength_change_between_runs_leaves_nothing_stale(files, layers):
    base, before = _base()
    PROMPT_CACHE.clear()
    runner = GraphRunner(backend=StandInBackend())
    s = _settings(acceleration="cuda_graph")
    runs = []
    for strengths in ([(0.8, 0.9), (-0.6, 1.1)], [(-0.4, 0.3), (1.2, -0.5)], [(0.8, 0.9), (-0.6, 1.1)]):
        view = _inject(base, files, layers, strengths)
        got = _stream(view, s, fresh=False, runner=runner)  # the third run may reuse the first run's prompts
        # the same view, injected into a fresh copy of the model: no binding, gain or cached prompt with a history
        # (the prompt cache keys on the model)
        want = _references(_inject(tiny_engine("sd1"), files, layers, strengths), s, fresh=False)
        _check(got, want, singles=(3,))
        runs.append(got.latents)
    assert _diff(runs[0], runs[1]) > 1.0, "the two strengths must give different images for the test to mean anything"
    assert runner.captures(base) == 2  # one step per batch shape, reused across strengths (strength is data)
    _untouched_and_like_a_fresh_model(base, before, s)


@pytest.mark.parametrize("mode", ["unmerged", "merged"])
def test_oom_and_interrupt_mid_run_lose_nothing_and_leave_the_model_unpatched(files, mode):
    base, before = _base()
    view = _inject(base, files, [("locon_tucker", "unmerged"), ("lokr_dora_in", mode)], [(0.8, 0.9), (-0.6, 1.1)])
    s = _settings(images_per_prompt=3, max_batch=3)
    refs = _references(view, s)
    # to_k of the mid block's self-attention: after to_q computed the down shared by to_q/to_k/to_v
    to_k = base.parts.unet.mid_block.attentions[0].transformer_blocks[0].attn1.to_k
    rows = []

    def second_batch_second_step(module, args):
        rows.append(args[0].shape[0])
        if len(rows) == 4:  # UNet calls: batch 0 steps 1, 2; batch 1 step 1, then this one
            raise OOM("injected: CUDA out of memory")

    handle = to_k.register_forward_pre_hook(second_batch_second_step)
    try:
        result = _stream(view, s)
    finally:
        handle.remove()
    assert result.oom_retries == 1 and result.batch_sizes == (3, 1, 1, 1)
    assert rows[:4] == [6, 6, 6, 6]  # the failure was inside the UNet of the second batch of 3 (CFG: 2 rows each)
    _check(result, refs, singles=(3, 4, 5))
    lf.assert_untouched(before, base.parts.unet, base.parts.text_encoder, base.parts.text_encoder_2)

    checks = {"n": 0}

    def cancel_in_the_second_batch():
        checks["n"] += 1
        if checks["n"] == 6:
            raise bridge.Interrupted("user pressed cancel")

    bridge.set_interrupt_hook(cancel_in_the_second_batch)
    try:
        with pytest.raises(bridge.Interrupted) as info:
            _stream(view, s)
    finally:
        bridge.set_interrupt_hook(None)
    assert "nothing was returned" in "".join(getattr(info.value, "__notes__", []))
    lf.assert_untouched(before, base.parts.unet, base.parts.text_encoder, base.parts.text_encoder_2)
    _check(_stream(view, s), refs)
    _untouched_and_like_a_fresh_model(base, before, s)
