"""The Qwen-Image step through the graph runner on the CPU (a stand-in capture backend, ``tests/kit/graph_backend``),
tiny random model, fp32.

Guards: the captured step reading anything but its buffers (a different prompt of the same text bucket, or another
seed, replaying the first capture must give its own eager latent, exactly); a prompt of a larger bucket recapturing;
true CFG taking more than ONE transformer call per step (weights must cross once per step when streamed); the
regional compile path (dynamo with the ``aot_eager`` backend, no C++ compiler needed) changing the result; and the
edit seam: ``reference`` tokens through the loop give what a plain two-call loop over the module's own forward
gives (``cat([noise, reference])``, ``img_shapes`` with the reference grids, prediction sliced to the noise)."""
import pytest
import torch

from leandiffusion.sampling.flow.schedule import flow_sigmas
from leandiffusion.sampling.flow.settings import FlowSettings
from leandiffusion.sampling.graph_runner import GraphRunner
from leandiffusion.sampling.qwen import accel
from leandiffusion.sampling.qwen.forward import QwenReference
from leandiffusion.sampling.qwen.latents import pack
from leandiffusion.sampling.qwen.loop import _denoise, sample_qwen_image
from leandiffusion.sampling.qwen.text import encode_prompts
from leandiffusion.tests.kit.graph_backend import StandInBackend

LONG = "a very long prompt about a harbour at night with lanterns and boats and fog " * 2


@pytest.fixture(scope="module")
def engine(load_qwen):
    return load_qwen()


def _settings(prompt="a red cat", seed=1, acceleration="cuda_graph", cfg=4.0, **kw):
    return FlowSettings(prompt, "bad", seed=seed, steps=2, cfg=cfg, width=32, height=48, batch_size=2,
                        acceleration=acceleration, **kw)


def _run(engine, runner=None, **kw):
    return sample_qwen_image(engine, _settings(**kw), runner=runner, quiet=True)["samples"]


def test_one_capture_serves_every_prompt_of_a_bucket(engine):
    assert len(encode_prompts(engine, [LONG])[0]) > 64 >= len(encode_prompts(engine, ["two green birds on a wire"])[0])
    runner = GraphRunner(backend=StandInBackend(), max_graphs=4)
    for prompt, seed in (("a red cat", 1), ("two green birds on a wire", 2), ("a red cat", 3)):
        out = _run(engine, runner, prompt=prompt, seed=seed)
        assert torch.equal(out, _run(engine, prompt=prompt, seed=seed, acceleration="none"))
    assert runner.captures(engine) == 1
    _run(engine, runner, prompt=LONG)
    assert runner.captures(engine) == 2


@pytest.mark.parametrize("cfg,rows", [(4.0, 4), (1.0, 2)])
def test_one_transformer_call_per_step(engine, cfg, rows):
    calls = []
    hook = engine.parts.unet.img_in.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    try:
        _run(engine, acceleration="none", cfg=cfg)
    finally:
        hook.remove()
    assert calls == [rows, rows]  # 2 steps, batch 2: [prompt x 2, negative x 2] in one call when guided


def test_compiled_blocks_equal_eager(engine, monkeypatch):
    monkeypatch.setattr(accel, "compile_options", lambda mode: {"backend": "aot_eager"})
    eager = _run(engine, acceleration="none")
    out = _run(engine, GraphRunner(backend=StandInBackend()), acceleration="compile+cuda_graph")
    assert engine.parts in accel._COMPILED  # the compiled regions ran, not an eager fallback
    assert ((out - eager).norm() / eager.norm()).item() <= 1e-6


def _plain_edit_loop(dit, text_rows, x, sigmas, reference, cfg):
    """The edit pipelines' loop written plainly: two module calls per step, reference tokens concatenated."""
    b, n = x.shape[:2]
    shapes = [[(1, 3, 2), *reference.shapes]] * b
    tokens = reference.tokens.expand(b, -1, -1)
    for i in range(sigmas.shape[0] - 1):
        t = (sigmas[i] * 1000).expand(b) / 1000
        preds = [dit(hidden_states=torch.cat([x, tokens], 1), timestep=t, encoder_hidden_states=torch.stack(rows),
                     encoder_hidden_states_mask=None, img_shapes=shapes, return_dict=False)[0][:, :n]
                 for rows in (text_rows[:b], text_rows[b:])]
        cond, uncond = preds
        combined = uncond + cfg * (cond - uncond)
        v = combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x


def test_reference_seam_equals_a_plain_edit_loop_and_replays(engine):
    s = _settings(seed=4)
    reference = QwenReference(torch.randn(1, 4 * 3 + 2 * 2, 64, generator=torch.Generator().manual_seed(9)),
                              ((1, 4, 3), (1, 2, 2)))
    noise = pack(torch.randn(2, 16, 6, 4, generator=torch.Generator().manual_seed(4)))
    sigmas = flow_sigmas(engine.parts.scheduler_config, 2, 6, 4)
    text_rows = [r for r in encode_prompts(engine, ["a red cat", "bad"]) for _ in range(2)]
    runner = GraphRunner(backend=StandInBackend())
    with engine.session("unet"), torch.no_grad():
        ref = _plain_edit_loop(engine.parts.unet, text_rows, noise, sigmas, reference, s.cfg)
        eager = _denoise(engine, text_rows, noise, sigmas, (6, 4), FlowSettings(**{**s.__dict__, "acceleration":
                                                                                   "none"}), True, reference)
        graph = _denoise(engine, text_rows, noise, sigmas, (6, 4), s, True, reference, runner)
        without = _denoise(engine, text_rows, noise, sigmas, (6, 4), s, True, None, runner)
    assert (eager - ref).abs().max().item() <= 1e-4
    assert torch.equal(graph, eager)
    assert (without - eager).abs().max().item() > 1e-2  # the reference conditions the result
    assert runner.captures(engine) == 2  # with and without a reference: two keys
