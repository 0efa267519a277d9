"""bench/suite_vae.py with ``--comfyui``: ComfyUI's contenders run without our VAE on the GPU (bench audit, s23).

No GPU here: the measurement is replaced by a stand-in that notes where our VAE is while each contender is measured
(``_measure`` runs the contender inside ``peak_memory``, so whatever sits on the GPU then counts in its peak). The
defect guarded: ``comfyui_tiled`` and ``exact_comfy_vae`` decode with ComfyUI's own VAE object while our full-size
VAE stayed resident, so their ``peak_alloc_gb`` held two sets of weights (ours 0.16 GiB in fp16) where ours' rows
hold one. Suite_comfyui's VAEDecodeTiled case already parks ours (tests/bench/test_peak_isolation.py).
"""
import torch

from leandiffusion.bench import suite_vae


class Where:
    """Our VAE stand-in: remembers where ``.to()`` put it (built on the GPU, like models.full_vae)."""

    device = "cuda"

    def to(self, *args, **kwargs):
        dev = kwargs.get("device", args[0] if args else None)
        if dev is not None and not isinstance(dev, torch.dtype):
            self.device = torch.device(dev).type
        return self

    def parameters(self):
        return iter(())


class FakeCtx:
    device = torch.device("cuda")
    smoke, quick, comfyui = False, False, "/comfyui"

    def __init__(self):
        self.records = []

    def record(self, case, metric, ours, *args, **kwargs):
        self.records.append((case, metric))

    def has_time(self, seconds):
        return True


def test_comfyui_contenders_are_measured_with_our_vae_off_the_gpu(monkeypatch):
    vae = Where()
    where = []

    def measure(ctx, fn, repeat):
        where.append(vae.device)
        return 1.0, torch.zeros(1), {"allocated_gb": 0.5, "reserved_gb": 0.5}

    monkeypatch.setattr(suite_vae, "_measure", measure)
    monkeypatch.setattr(suite_vae, "_comfy_vae", lambda ctx, vae_, dtype: object())
    monkeypatch.setattr("leandiffusion.vae.targets.from_module", lambda ae, device=None, dtype=None: "ours")
    monkeypatch.setattr("leandiffusion.vae.targets.from_comfy", lambda comfy_vae: "comfy")
    ctx = FakeCtx()
    suite_vae._case(ctx, vae, 2048, torch.float16, repeat=1)
    labels = [case.split("/", 1)[1] for case, metric in ctx.records if metric == "time_ms"]
    assert labels == ["exact", "exact_auto", "blend", "diffusers_tiled", "comfyui_tiled", "exact_comfy_vae"]
    # the untiled reference, then each contender: ours need our VAE on the GPU, ComfyUI's must not hold it
    # (the old suite measured all seven with it resident)
    assert where == ["cuda"] * 5 + ["cpu"] * 2
    assert vae.device == "cuda"  # back on the GPU for the next size
