"""Stream Scheduler Sampler on Z-Image (tiny random model, fp32 CPU): image n (prompt-major) is the Fused Flow
Sampler's one-image run for its prompt with seed ``seed + n`` (docs/stream.md's seed rule), its IMAGE the plain
diffusers decode of its LATENT, and bad input is refused naming the input.

Guards: per-image noise and captions inside batches that split the prompts unevenly (a batch-wide draw, a row
paired with the wrong prompt or negative, or a caption laid out in the batch's larger bucket with a different
result gives O(1) differences); ComfyUI's cfg meaning (cfg 1 runs without the negative, cfg 4 with it); the raw
LATENT (``/ scaling_factor + shift_factor``: a missing shift moves every value by the shift); the 16-channel
decode, untiled and through the exact tiles. The bound is 1e-4 max abs on latents of magnitude ~10 (batched fp32
DiT calls measured at 1.3e-5). One image per run is also compared with diffusers' ZImagePipeline, independent of
the Fused Flow Sampler.
"""
import pytest
import torch

from leandiffusion.sampling.flow.loop import sample_flow
from leandiffusion.sampling.flow.settings import FlowSettings
from leandiffusion.sampling.graph_runner import GraphRunner
from leandiffusion.sampling.stream.scheduler import run_stream
from leandiffusion.sampling.stream.settings import StreamSettings

from .test_flow_graphs import StandInBackend

TOL = 1e-4
LONG = "a lighthouse on a cliff at dusk, waves, gulls, warm light in the windows, " * 2  # 256-token bucket
PROMPTS = ("a red cat", LONG, "snow on a pine forest")
NEGATIVE = "blurry, dark"
SIZE = dict(width=80, height=64)
SEED = 7


@pytest.fixture(scope="module")
def engine(zimage_models):
    from leandiffusion.memory.load import load_engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LEANDIFFUSION_MODELS", str(zimage_models))
        return load_engine("tiny-zimage", device="cpu")


def _settings(**kw):
    base = dict(negative=NEGATIVE, seed=SEED, steps=2, cfg=1.0, acceleration="none", images_per_prompt=2, **SIZE)
    base.update(kw)
    return StreamSettings(prompts=base.pop("prompts", PROMPTS), **base)


_REFERENCES = {}


def _reference(engine, prompt, seed, cfg, steps=2):
    key = (prompt, seed, cfg, steps)
    if key not in _REFERENCES:
        s = FlowSettings(prompt, NEGATIVE, seed=seed, steps=steps, cfg=cfg, batch_size=1, acceleration="none",
                         **SIZE)
        _REFERENCES[key] = sample_flow(engine, s, quiet=True)["samples"]
    return _REFERENCES[key]


def _check_latents(engine, result, prompts, cfg, images_per_prompt=2):
    assert result.latents.shape == (len(prompts) * images_per_prompt, 16, SIZE["height"] // 8, SIZE["width"] // 8)
    for n in range(result.latents.shape[0]):
        prompt = prompts[n // images_per_prompt]  # prompt-major, written out (not read from the code under test)
        ref = _reference(engine, prompt, SEED + n, cfg)
        err = (result.latents[n:n + 1] - ref).abs().max().item()
        assert err <= TOL, f"image {n} ({prompt[:20]!r}, seed {SEED + n}): max abs diff {err:.3g}"
        assert ref.abs().max().item() > 1.0  # a real latent, not a near-zero one any output would match


def _pipeline_raw(pipe, prompt, seed, cfg):
    latents = pipe(prompt, negative_prompt=NEGATIVE, num_inference_steps=2, guidance_scale=cfg - 1.0,
                   generator=torch.Generator("cpu").manual_seed(seed), output_type="latent", **SIZE).images
    return latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor


def _plain_decode(pipe, raw):
    with torch.no_grad():
        return (pipe.vae.decode(raw).sample / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1)


@pytest.mark.parametrize("cfg,max_batch,tile", [(1.0, 4, 0), (4.0, 3, 128)])
def test_every_image_equals_the_fused_flow_sampler(engine, zimage_pipe, cfg, max_batch, tile):
    """6 images in batches (4, 2) or (3, 3): the second run splits prompt 1 over two batches and mixes the long
    prompt's 256-token caption bucket with 128-token ones; tile 128 decodes through the exact tiled executor."""
    result = run_stream(engine, _settings(cfg=cfg, max_batch=max_batch, decode_tile_size=tile), quiet=True)
    assert result.batch_sizes == ((4, 2) if max_batch == 4 else (3, 3))
    _check_latents(engine, result, PROMPTS, cfg)
    ref = _pipeline_raw(zimage_pipe, PROMPTS[1], SEED + 3, cfg)  # image 3: prompt 1, copy 1
    assert (result.latents[3:4] - ref).abs().max().item() <= TOL
    images = _plain_decode(zimage_pipe, result.latents)
    assert result.images.shape == (6, SIZE["height"], SIZE["width"], 3)
    assert (result.images - images).abs().max().item() <= TOL


def test_cfg_above_one_uses_the_negative_and_at_most_one_does_not(engine):
    """ComfyUI's meaning: cfg 0.5 runs one pass without the negative (the same latent as cfg 1); cfg 4 differs."""
    prompts = ("a red cat",)
    low = run_stream(engine, _settings(prompts=prompts, cfg=0.5, images_per_prompt=1), quiet=True)
    assert torch.equal(low.latents, run_stream(engine, _settings(prompts=prompts, images_per_prompt=1),
                                               quiet=True).latents)
    guided = run_stream(engine, _settings(prompts=prompts, cfg=4.0, images_per_prompt=1), quiet=True)
    assert (guided.latents - low.latents).abs().max().item() > 1e-2


def _qwen3_conditioning(rows):
    """A batched CONDITIONING of ``[L_i, C]`` rows: zero-padded to the longest, padding marked in the mask."""
    longest = max(r.shape[0] for r in rows)
    cond = torch.stack([torch.cat([r, torch.zeros(longest - r.shape[0], r.shape[1])]) for r in rows])
    mask = torch.stack([(torch.arange(longest) < r.shape[0]).long() for r in rows])
    return [[cond, {"attention_mask": mask}]]


def test_conditioning_rows_are_prompts(engine, zimage_pipe):
    """Qwen3 hidden states from diffusers' own encode_prompt, as a 2-row positive_cond and a 1-row shared
    negative_cond, give the images of the prompt lines they encode."""
    prompts = ("a red cat", "snow on a pine forest")
    with torch.no_grad():
        pos, neg = zimage_pipe.encode_prompt(list(prompts), device="cpu", do_classifier_free_guidance=True,
                                             negative_prompt=[NEGATIVE] * len(prompts))
    result = run_stream(engine, _settings(prompts=(), cfg=4.0, max_batch=3, negative="ignored"), quiet=True,
                        positive_cond=_qwen3_conditioning(pos), negative_cond=_qwen3_conditioning(neg[:1]))
    _check_latents(engine, result, prompts, 4.0)


def test_batches_of_one_shape_replay_one_capture(engine):
    """Three batches of 2 (stand-in graph backend): one capture, the same latents as the eager run."""
    runner = GraphRunner(backend=StandInBackend(), max_graphs=4)
    prompts = ("a red cat", "two birds", "snow")
    graphed = run_stream(engine, _settings(prompts=prompts, max_batch=2, acceleration="cuda_graph"), runner=runner,
                         quiet=True)
    assert graphed.batch_sizes == (2, 2, 2)
    assert runner.captures(engine) == 1
    eager = run_stream(engine, _settings(prompts=prompts, max_batch=2), quiet=True)
    assert torch.equal(graphed.latents, eager.latents)


@pytest.mark.parametrize("kwargs,conds,match", [
    (dict(width=72), {}, r"width=72 is not a multiple of 16.*use 64 or 80"),
    (dict(height=88), {}, r"height=88 is not a multiple of 16"),
    (dict(cfg=4.0), {"positive_cond": [[torch.randn(1, 77, 768), {"pooled_output": torch.randn(1, 768)}]]},
     r"positive_cond has shape \(1, 77, 768\); this model needs Qwen3 hidden states"),
    (dict(cfg=4.0), {"negative_cond": [[torch.randn(1, 77, 768), {}]]}, r"negative_cond .*Qwen3"),
    (dict(cfg=4.0), {"negative_cond": [[torch.randn(2, 5, 64), {}]]}, r"negative_cond has 2 rows .* 3 prompts"),
])
def test_bad_input_is_refused_naming_it_before_any_model_runs(engine, monkeypatch, kwargs, conds, match):
    import leandiffusion.sampling.flow.text as flow_text

    def never(*a, **k):
        raise AssertionError("a model ran before the input was checked")

    monkeypatch.setattr(flow_text, "encode_prompts", never)
    monkeypatch.setattr("leandiffusion.sampling.stream.flow.encode_prompts", never)
    monkeypatch.setattr("leandiffusion.sampling.stream.flow.denoise_flow_batch", never)
    with pytest.raises(ValueError, match=match):
        run_stream(engine, _settings(**kwargs), quiet=True, **conds)


def test_the_sd_rule_keeps_multiples_of_8():
    """The 16 px rule is the flow family's: the same settings validate for a UNet family."""
    assert _settings(width=72).validated().width == 72
    with pytest.raises(ValueError, match="width=72 is not a multiple of 16"):
        _settings(width=72, flow=True).validated()
