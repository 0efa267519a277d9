"""Guards that one contender's memory never counts in another contender's peak.

No GPU here: ``torch.cuda``'s allocator statistics are replaced by a small model of the caching allocator
(active blocks, cached free blocks, the peak since the last reset), and the suites' models by stand-ins that only
remember where ``.to()`` put them. The promises these tests guard:

- the stream suite's peak returns the cache to the driver before it resets the peak, so the prompt-by-prompt
  peer's ``peak_reserved_gb`` does not start at everything ours' batched runs left cached (``max_memory_reserved``
  right after a reset is the memory reserved at that moment);
- ``suite_comfyui``'s KSampler and VAEDecodeTiled cases run ComfyUI with none of our full-size models resident on
  the GPU (they are built there for speed), so ComfyUI's peaks hold none of our UNet, text encoders and VAE;
- ``suite_vae``'s ``--comfyui`` contenders run with our VAE off the GPU, and ``suite_comfyui``'s
  ImageUpscaleWithModel peer moves its model to the GPU and back on every call, as the node does.
"""
import contextlib
import types

import pytest
import torch

from leandiffusion.bench import comfyui_peer, stream_contenders, suite_comfyui

GiB = 2 ** 30


class FakeAllocator:
    """Caching-allocator arithmetic: freed blocks stay reserved (cached) until ``empty_cache``."""

    def __init__(self):
        self.active = 0
        self.cached = 0
        self.peak = 0

    @property
    def reserved(self) -> int:
        return self.active + self.cached

    def alloc(self, n: int) -> None:
        reuse = min(self.cached, n)
        self.cached -= reuse
        self.active += n
        self.peak = max(self.peak, self.reserved)

    def free(self, n: int) -> None:
        self.active -= n
        self.cached += n

    def install(self, monkeypatch) -> "FakeAllocator":
        def empty_cache():
            self.cached = 0

        def reset_peak_memory_stats(device=None):
            self.peak = self.reserved

        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset_peak_memory_stats)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.peak)
        return self


def test_stream_peak_does_not_count_what_an_earlier_contender_left_cached(monkeypatch):
    mem = FakeAllocator().install(monkeypatch)
    mem.alloc(10 * GiB)  # ours' batched runs: activations and staging for a batch of eight ...
    mem.free(10 * GiB)  # ... freed, but kept in the allocator's cache
    with stream_contenders.ReservedPeak(torch.device("cuda")) as peer_peak:
        mem.alloc(1 * GiB)  # the prompt-by-prompt peer needs 1 GiB
        mem.free(1 * GiB)
    assert peer_peak["reserved_gb"] == pytest.approx(1.0)  # not 10.0: ours' leftovers do not count


def test_stream_releases_ours_graphs_and_pool_before_the_peer(monkeypatch):
    calls = []
    runner = types.SimpleNamespace(clear=lambda engine=None: calls.append(("clear", engine)))
    monkeypatch.setattr("leandiffusion.sampling.graph_runner.default_runner", lambda: runner)
    engine = types.SimpleNamespace(pool=types.SimpleNamespace(release=lambda: calls.append(("release",))))
    stream_contenders.release_run_memory(engine)
    assert calls == [("clear", engine), ("release",)]


# --------------------------------------------------------------------------------------------- suite_comfyui
class Where:
    """A model stand-in that remembers where ``.to()`` put it (built on the GPU, like models.full_*)."""

    def __init__(self, name: str):
        self.name = name
        self.device = "cuda"

    def to(self, *args, **kwargs):
        dev = kwargs.get("device", args[0] if args else None)
        if dev is not None and not isinstance(dev, torch.dtype):
            self.device = torch.device(dev).type
        return self

    def state_dict(self):
        return {}

    def parameters(self):
        return iter(())


class FakeCtx:
    def __init__(self):
        self.device = torch.device("cuda")
        self.smoke, self.quick = False, True
        self.records, self.skipped = [], []

    def record(self, case, metric, ours, *args, **kwargs):
        self.records.append((case, metric, ours))

    def skip(self, case, reason):
        self.skipped.append((case, reason))

    def has_time(self, seconds):
        return True


def _patch_measuring(monkeypatch):
    monkeypatch.setattr(suite_comfyui, "time_ms", lambda fn, warmup=0, repeat=1, device=None: (fn(), 1.0)[1])

    @contextlib.contextmanager
    def peak_memory(device):
        yield {"reserved_gb": 1.0, "allocated_gb": 1.0}

    monkeypatch.setattr(suite_comfyui, "peak_memory", peak_memory)


def test_ksampler_peer_runs_with_none_of_our_models_on_the_gpu(monkeypatch):
    _patch_measuring(monkeypatch)
    parts = types.SimpleNamespace(unet=Where("unet"), vae=Where("vae"), text_encoder=Where("te"),
                                  text_encoder_2=Where("te2"))
    ours = [parts.unet, parts.vae, parts.text_encoder, parts.text_encoder_2]
    monkeypatch.setattr(suite_comfyui, "make_parts", lambda kind, comfy, dev, dtype: parts)
    seen = {"comfy": [], "ours": []}

    class Comfy:
        version = "fake"

        def unet_patcher(self, unet, dtype):
            return object()

        def ksampler(self, *args, **kwargs):
            seen["comfy"].append({m.name: m.device for m in ours})

        def unload_all(self):
            pass

    def make_engine(parts_, policy, budget_gb, device, dtype):  # the ``full`` placement puts everything back
        for m in ours:
            m.to(device)
        return types.SimpleNamespace()

    monkeypatch.setattr(suite_comfyui, "make_engine", make_engine)
    monkeypatch.setattr(suite_comfyui, "node_fn",
                        lambda node_id: lambda **kw: seen["ours"].append({m.name: m.device for m in ours}))
    suite_comfyui.case_ksampler(FakeCtx(), Comfy(), "sdxl")
    assert seen["comfy"] and seen["ours"]
    for where in seen["comfy"]:  # none of our four models may sit in ComfyUI's peak
        assert set(where.values()) == {"cpu"}, where
    for where in seen["ours"]:
        assert set(where.values()) == {"cuda"}, where


def test_vae_tiled_peer_runs_without_our_vae_on_the_gpu(monkeypatch):
    _patch_measuring(monkeypatch)
    vae = Where("vae")
    monkeypatch.setattr(suite_comfyui, "full_vae", lambda device=None, dtype=None: vae)
    seen = []

    class Comfy:
        version = "fake"

        def vae(self, vae_, dtype):
            return "comfy-vae"

        def vae_decode_tiled(self, cvae, latent, tile, overlap):
            seen.append(("comfyui", vae.device))

        def unload_all(self):
            pass

    def decode(**kw):
        seen.append(("ours_vae" if "lean_model" in kw else "comfy_vae", vae.device))

    monkeypatch.setattr(suite_comfyui, "node_fn", lambda node_id: decode)
    suite_comfyui.case_vae(FakeCtx(), Comfy())
    assert {s for s, _ in seen} == {"comfyui", "ours_vae", "comfy_vae"}
    for source, where in seen:
        # ComfyUI's number (and ours run on ComfyUI's VAE object) must not hold our VAE's weights; ours on our VAE
        # needs it on the GPU.
        assert where == ("cuda" if source == "ours_vae" else "cpu"), (source, where)


class _SmokeClockCtx:
    """A smoke-mode context on a fake clock: ``budget_s`` seconds in all; each case advances the clock."""

    smoke, quick = True, False

    def __init__(self, clock, budget_s):
        self.clock, self.deadline_s, self.skipped = clock, budget_s, []

    def has_time(self, seconds):
        return self.deadline_s - self.clock[0] >= seconds

    def skip(self, case, reason):
        self.skipped.append(case)


@pytest.mark.parametrize("case_s, ran, skipped", [(2.0, ["sd15_512", "sdxl_1024"], []),
                                                  (6.0, ["sd15_512"], ["sdxl_1024"])])
def test_stream_smoke_starts_a_case_only_with_room_for_it(monkeypatch, case_s, ran, skipped):
    """On a loaded CI host the tiny cases run slower: the next one starts only when about as much time as the
    last one took is left (a fixed 1-second check would start it and the process would be killed past its
    share)."""
    from leandiffusion.bench import suite_stream

    clock, calls = [0.0], []

    def fake_case(ctx, case, *args):
        calls.append(case)
        clock[0] += case_s

    monkeypatch.setattr(suite_stream, "_case", fake_case)
    monkeypatch.setattr(suite_stream.time, "perf_counter", lambda: clock[0])
    ctx = _SmokeClockCtx(clock, budget_s=10.0)
    suite_stream.run(ctx)
    assert calls == ran and ctx.skipped == skipped


def test_comfyui_upscale_peer_moves_the_model_as_the_node_does_on_every_call():
    """ComfyUI's ImageUpscaleWithModel frees memory for the model, moves it to the device, tiles, and moves it back
    to the CPU on every call (comfy_extras/nodes_upscale_model.py). A peer that left the model on the GPU after its
    first call would skip in its timed calls the weights' upload and download that the node (and ours) pays."""
    events = []

    class Model:  # a spandrel ImageModelDescriptor stand-in: x4, remembers where it is
        scale = 4
        model = "module"
        device = "cpu"

        def to(self, dev):
            events.append(("to", torch.device(dev).type))
            self.device = torch.device(dev).type
            return self

        def __call__(self, a):
            events.append(("run", self.device))
            return a

    mm = types.SimpleNamespace(module_size=lambda module: 1000, OOM_EXCEPTION=torch.cuda.OutOfMemoryError,
                               free_memory=lambda required, device: events.append(("free", required > 1000)))
    utils = types.SimpleNamespace(tiled_scale=lambda img, fn, **kw: fn(img))
    comfy = object.__new__(comfyui_peer.Comfy)
    comfy.mm, comfy.utils = mm, utils
    model = Model()
    image = torch.rand(1, 8, 8, 3)
    for _ in range(2):  # the warm-up and a timed call; "meta" stands in for the GPU
        out = comfy.upscale_with_model(model, image, torch.device("meta"))
        assert out.shape == image.shape
    call = [("free", True), ("to", "meta"), ("run", "meta"), ("to", "cpu")]
    assert events == call * 2


def test_vae_suite_measures_comfyuis_contenders_with_our_vae_off_the_gpu(monkeypatch):
    """bench/suite_vae.py with ``--comfyui``: ``comfyui_tiled`` and ``exact_comfy_vae`` decode with ComfyUI's own
    VAE object; with our full-size VAE resident, their peaks would hold two sets of weights where ours' rows hold
    one. ``_measure`` runs a contender inside ``peak_memory``: whatever sits on
    the GPU then counts in its peak."""
    from leandiffusion.bench import suite_vae

    vae = Where("vae")
    where = []

    def measure(ctx, fn, repeat):
        where.append(vae.device)
        return 1.0, torch.zeros(1), {"allocated_gb": 0.5, "reserved_gb": 0.5}

    monkeypatch.setattr(suite_vae, "_measure", measure)
    monkeypatch.setattr(suite_vae, "_comfy_vae", lambda ctx, vae_, dtype: object())
    monkeypatch.setattr("leandiffusion.vae.targets.from_module", lambda ae, device=None, dtype=None: "ours")
    monkeypatch.setattr("leandiffusion.vae.targets.from_comfy", lambda comfy_vae: "comfy")
    ctx = FakeCtx()
    ctx.comfyui = "/comfyui"
    suite_vae._case(ctx, vae, 2048, torch.float16, repeat=1)
    labels = [case.split("/", 1)[1] for case, metric, _ in ctx.records if metric == "time_ms"]
    assert labels == ["exact", "exact_auto", "blend", "diffusers_tiled", "comfyui_tiled", "exact_comfy_vae"]
    # the untiled reference and ours need our VAE on the GPU; ComfyUI's two must not hold it
    assert where == ["cuda"] * 5 + ["cpu"] * 2
    assert vae.device == "cuda"  # back on the GPU for the next size
