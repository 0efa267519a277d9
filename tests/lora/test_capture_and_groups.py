"""CPU guards for the unmerged fast path: shared down projections of sibling Linears are exact (also when a
sibling is fed another input), leave no cached tensor behind, are recomputed after a forward that raised between
two siblings (the static context buffer is the same tensor next time), and the forward adds no host-built tensor;
strength writes are refused while a CUDA-graph capture is (faked as) running, leaving nothing attached.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from leandiffusion.lora import inject_lora, unmerged
from leandiffusion.lora.formats import LoraLayer
from leandiffusion.lora.keymap import Target
from leandiffusion.lora.unmerged import STRATEGIES, UnmergedBinding
from leandiffusion.memory.engine import engine_from_parts, parts_from_components
from leandiffusion.tests.kit import tiny_components
from leandiffusion.tests.lora import lorafiles as lf


class _Attn(torch.nn.Module):
    def __init__(self, c=24, ctx=24):
        super().__init__()
        self.to_q, self.to_k, self.to_v = (torch.nn.Linear(c, c), torch.nn.Linear(ctx, c), torch.nn.Linear(ctx, c))
        self.to_out = torch.nn.Linear(c, c)

    def forward(self, x, context=None):
        ctx = x if context is None else context
        return self.to_q(x), self.to_k(ctx), self.to_v(ctx), self.to_out(x)


def _targets(attn, ranks=(3, 5, 2, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for (name, m), r in zip(attn.named_children(), ranks):
        layer = LoraLayer("unet", name, "dotted", torch.randn(r, m.in_features, generator=g),
                          torch.randn(m.out_features, r, generator=g), 1.0, name)
        out.append(Target("unet", f"blk.{name}", m, layer))
    return out


def _plain(attn, targets, s, x, context=None):
    ctx = x if context is None else context
    ins = {"to_q": x, "to_k": ctx, "to_v": ctx, "to_out": x}
    return [F.linear(ins[n], t.module.weight, t.module.bias) + s * F.linear(F.linear(ins[n], t.layer.down), t.layer.up)
            for n, t in zip(("to_q", "to_k", "to_v", "to_out"), targets)]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("cross", [False, True])
@torch.no_grad()
def test_shared_down_is_exact_and_leaves_no_cache(cross, strategy):
    torch.manual_seed(0)
    attn = _Attn()
    targets = _targets(attn)
    binding = UnmergedBinding(("k",), targets, "t", strategy=strategy)
    assert len(binding._shared) == 1 and binding._shared[0].size == 3  # to_q/k/v share one down GEMM
    x, ctx = torch.randn(2, 7, 24), torch.randn(2, 5, 24)
    binding.attach({"unet": 0.7})
    try:
        got = attn(x, ctx if cross else None)
        assert all(g.x is None and g.h is None for g in binding._shared)  # nothing outlives the call
    finally:
        binding.detach({"unet": 0.7})
    want = _plain(attn, targets, 0.7, x, ctx if cross else None)
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() <= 1e-5
    base = attn(x)
    assert all(torch.equal(a, b) for a, b in zip(base, [F.linear(x, m.weight, m.bias) for m in attn.children()]))


@torch.no_grad()
def test_forward_raising_between_siblings_leaves_no_stale_down():
    """A k/v-only cross-attention LoRA (Custom Diffusion style): ``to_k`` computes the shared down GEMM of the
    context, then the forward raises before ``to_v`` reads it (out of memory in a CUDA-graph capture, which the
    sampler answers by running the step eagerly in the same session). The context is the sampler's static buffer,
    the same tensor object on the next forward with new contents (reloaded; after a capture, values never
    computed), so the next forward must compute the down GEMM again instead of reading the leftover."""
    torch.manual_seed(0)
    attn = _Attn()
    targets = [t for t in _targets(attn) if t.module_name in ("blk.to_k", "blk.to_v")]
    binding = UnmergedBinding(("k",), targets, "t")
    assert len(binding._shared) == 1 and binding._shared[0].size == 2
    x, ctx = torch.randn(2, 7, 24), torch.randn(2, 5, 24)
    failing = [True]

    def fail_once(module, args):
        if failing.pop() if failing else False:
            raise torch.OutOfMemoryError("injected")

    attn.to_v.register_forward_pre_hook(fail_once)
    binding.attach({"unet": 0.7})
    try:
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            attn(x, ctx)
        ctx.copy_(torch.randn(2, 5, 24))  # the same buffer, loaded with the next run's conditioning
        _, k, v, _ = attn(x, ctx)
    finally:
        binding.detach({"unet": 0.7})
    for got, t in zip((k, v), targets):
        want = F.linear(ctx, t.module.weight, t.module.bias) + 0.7 * F.linear(F.linear(ctx, t.layer.down), t.layer.up)
        err = (got - want).abs().max().item()
        assert err <= 1e-5, f"{t.module_name}: max abs diff {err:.3g}"


class _HostTensors(TorchDispatchMode):
    """Records ops that build a tensor from host data (on a GPU: a host->device copy)."""

    HOST = {"lift_fresh", "lift_fresh_copy", "scalar_tensor", "_to_copy", "_local_scalar_dense"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.HOST:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("strategy", STRATEGIES)
@torch.no_grad()
def test_lora_forward_builds_no_host_tensor(tmp_path, strategy):
    """The hooks add only device-side GEMMs: the UNet issues the same host-built tensors with and without them."""
    c = tiny_components("sdxl")
    engine = engine_from_parts(parts_from_components(c))
    sd = lf.kohya_state_dict({"unet": c["unet"]}, {"unet": lf.ATTN_FF}, rank=4)
    view = inject_lora(engine, lf.write(sd, tmp_path / "a.safetensors"), 0.8, 1.0, strategy=strategy)
    inputs = lf.unet_inputs("sdxl")
    inputs["timestep"] = torch.tensor(10)  # a device tensor in the sampler (StepProgram.timestep)
    seen = {}
    for label, v in (("base", engine), ("lora", view)):
        with v.session("unet"):
            lf.run_unet(v.parts.unet, inputs)  # warm (lazy init)
            with _HostTensors() as mode:
                lf.run_unet(v.parts.unet, inputs)
            seen[label] = sorted(mode.seen)
    assert seen["lora"] == seen["base"]


@pytest.mark.parametrize("mode,strategy", [("unmerged", "hook"), ("unmerged", "geglu"), ("merged", "hook")])
def test_strength_write_refused_while_capturing(tmp_path, monkeypatch, mode, strategy):
    c = tiny_components("sd1")
    engine = engine_from_parts(parts_from_components(c))
    sd = lf.kohya_state_dict({"unet": c["unet"]}, {"unet": lf.ATTN_FF}, rank=4)
    path = lf.write(sd, tmp_path / "a.safetensors")
    view = inject_lora(engine, path, 0.5, 1.0, mode=mode, strategy=strategy)
    before = lf.snapshot(engine.parts.unet)
    monkeypatch.setattr(unmerged.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(unmerged.torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="captur"):
        with view.session("unet"):
            pass
    assert lf.injected(engine.parts.unet) == 0  # nothing half-attached (no hook, no forward override)
    lf.assert_untouched(before, engine.parts.unet)
    monkeypatch.undo()
    with view.session("unet"):  # entered outside a capture it works, and a capture inside it writes nothing
        monkeypatch.setattr(unmerged.torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(unmerged.torch.cuda, "is_current_stream_capturing", lambda: True)
        with view.session("unet"):  # nested, same strength: no write, allowed
            pass
