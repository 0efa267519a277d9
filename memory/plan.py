"""Memory plans: how many bytes each stage needs under a policy, the estimates behind it, and its text report.

Estimates (bytes, in the run dtype):
- weights: exact (parameter counts x element size, with the 512-byte alignment of flat buffers); fp8-stored
  weights (``memory/fp8_weights.py``: uint8 storage, which flat layouts never cast) count 1 byte per element;
- UNet activations at the working shape (default: batch 2 for classifier-free guidance, the family's native
  latent size), from the ``meta`` trace of the UNet's blocks: the skip tensors the down path keeps
  (every down-path block output) plus the largest transient inside one block (a transformer block peaks in its
  GEGLU feed-forward at ~18x its output, a resnet at ~6x with the skip concatenation), times ``FRAGMENTATION``
  for the allocator, plus ``WORKSPACE_CUDA`` on CUDA (0 on the CPU) for cuBLAS/cuDNN workspaces and the caching
  allocator's reserved-over-allocated slack. The sum errs high of the reserved memory a UNet step takes above its
  weights, so a ``stream`` plan keeps no further headroom (``vram_budget.HEADROOM``);
- DiT activations (Z-Image) at the working shape: no skips; the largest block transient, a main block over the
  image tokens (4096 at 1024 px) and the largest caption bucket (``dit_units.CAPTION_TOKENS``): factor ``"dit"``;
- text activations: a streamable text encoder's at a 512-token prompt batch (``memory/text_units.py``: its hidden
  states, key/value cache and MLP transient); other text encoders' (CLIP, 77 tokens) are small next to their
  weights and not counted; the VAE stage's working memory belongs to the decode node (tiling), so the plan counts
  VAE weights only.

The *working minimum* of ``stream`` is activations + always-resident weights + the minimum staging arena
(3 x the largest block); a budget under it is refused with that number in the message.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .hostmem import FlatLayout

GiB = 2 ** 30
WORKSPACE_CUDA = 576 * 2 ** 20  # library workspaces + reserved-over-allocated slack of one UNet step (docstring)
FRAGMENTATION = 1.3
# "dit": inside a DiT block's SwiGLU feed-forward: three hidden-width tensors (8/3 x dim each: w1's output after
# SiLU, w3's, their product) = 8, beside the block input, its modulated copy and the glue's image/caption tokens
# (3); attention peaks lower (q, k, v, one float32 RoPE temporary of 2, input, kept tokens: ~9); 5 more for a step
# captured in a CUDA graph, whose private pool holds the step's activations beside the eager warm-up's (a guided
# 1024 px step with a 512-token caption ran out of memory under the 6 GB cap at 11 and at 16; 20 holds)
TRANSIENT_FACTOR = {"transformer": 18, "resnet": 6, "downsample": 2, "upsample": 3, "dit": 20}


def module_bytes(module: Optional[torch.nn.Module], dtype: torch.dtype) -> int:
    if module is None:
        return 0
    params = list(module.parameters())
    return FlatLayout.of(params, dtype).nbytes if params else 0


def activation_bytes(units, elem_size: int, device_type: str) -> int:
    """UNet activation + workspace estimate at the traced working shape (see the module docstring)."""
    skips = sum(u.out_numel for u in units if u.name.startswith("down_blocks.") and u.kind in ("resnet", "downsample"))
    transient = max((TRANSIENT_FACTOR.get(u.kind, 4) * u.out_numel for u in units), default=0)
    workspace = WORKSPACE_CUDA if device_type == "cuda" else 0
    return int(FRAGMENTATION * (skips + transient) * elem_size) + workspace


def gb(n: Optional[float]) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:.2f} GB" if n >= 0.1 * GiB else f"{n / 2 ** 20:.2f} MB"


@dataclass(frozen=True)
class MemoryPlan:
    """What a policy keeps where, and the estimated peak device bytes per stage."""

    policy: str
    requested: str
    device: str
    model: str
    family: str
    dtype: str
    vae_dtype: str
    text_dtype: str
    budget_bytes: Optional[int]
    working_shape: tuple
    text_mode: str  # "resident", "while used", "cpu", "stream"
    vae_mode: str
    unet_mode: str  # "resident", "stream"
    text_bytes: int
    unet_bytes: int
    vae_bytes: int
    unet_activation_bytes: int
    unet_fixed_bytes: int = 0  # always-resident (non-block) weights under stream
    unet_resident_bytes: int = 0  # resident block weights under stream
    unet_streamed_bytes: int = 0
    arena_bytes: int = 0
    packed_slot_bytes: int = 0  # of ``arena_bytes``: the packed staging slot (streamed bf16 weights cross packed)
    streamed_units: int = 0
    total_units: int = 0
    est_step_ms: Optional[float] = None
    est_compute_ms: Optional[float] = None
    notes: tuple = ()
    peaks: dict = field(default_factory=dict)  # stage -> estimated peak device bytes
    text_activation_bytes: int = 0  # a streamable text encoder's estimate at ``text_tokens`` (else 0)
    text_tokens: int = 0
    text_fixed_bytes: int = 0  # streamed text encoder: always on the device (final norm)
    text_host_bytes: int = 0  # streamed text encoder: embedding table, looked up on the host
    text_arena_bytes: int = 0  # streamed text encoder: staging ring, on the device while the text stage runs
    text_packed_slot_bytes: int = 0  # of ``text_arena_bytes``: its packed staging slot
    text_streamed_units: int = 0
    text_total_units: int = 0
    unet_storage: str = ""  # how the denoiser's weights are stored when not in ``dtype`` ("fp8_e4m3fn", ...)

    @property
    def peak_bytes(self) -> int:
        return max(self.peaks.values()) if self.peaks else 0

    def _text_lines(self, where: dict, batch: int) -> list[str]:
        if self.text_mode != "stream":
            lines = [f"  text : {gb(self.text_bytes)} weights, {where[self.text_mode]}"]
        else:
            lines = [f"  text : {gb(self.text_bytes)} weights: streamed {self.text_streamed_units} of "
                     f"{self.text_total_units} blocks per encoder forward through a {gb(self.text_arena_bytes)} staging "
                     f"ring{_packed(self.text_packed_slot_bytes)} held only while the text stage runs; embedding "
                     f"table {gb(self.text_host_bytes)} on the host (lookup there), resident "
                     f"{self.text_fixed_bytes / 2 ** 10:.1f} KB"]
        if self.text_activation_bytes:
            lines.append(f"         activations+workspace estimate {gb(self.text_activation_bytes)} at "
                         f"{self.text_tokens} tokens, batch {batch}")
        return lines

    def render(self, measured: Optional[dict] = None) -> str:
        """The memory plan as the loader's STRING output (and the log)."""
        b, hw = self.working_shape[0], self.working_shape[1:]
        head = f"Memory plan: {self.model} ({self.family}) on {self.device}, policy {self.policy}"
        if self.requested != self.policy:
            head += f" (chosen by {self.requested})"
        if self.budget_bytes is not None and self.policy == "stream":
            head += f", budget {gb(self.budget_bytes)}"
        unet = f"{self.unet_storage} (computes in {self.dtype})" if self.unet_storage else self.dtype
        lines = [head, f"  dtypes: UNet {unet}, text {self.text_dtype}, VAE {self.vae_dtype}"]
        where = {"resident": "resident on the device", "while used": "on the device only while used",
                 "cpu": "on the CPU (only embeddings move)"}
        lines.extend(self._text_lines(where, b))
        if self.unet_mode == "stream":
            lines.append(f"  unet : {gb(self.unet_bytes)} weights: resident {gb(self.unet_fixed_bytes + self.unet_resident_bytes)}"
                         f", streamed {gb(self.unet_streamed_bytes)} per step ({self.streamed_units} of "
                         f"{self.total_units} blocks) through a {gb(self.arena_bytes)} staging ring"
                         f"{_packed(self.packed_slot_bytes)} from pinned host memory")
            if self.est_step_ms is not None:
                lines.append(f"         model estimate: step ~{self.est_step_ms:.0f} ms vs ~{self.est_compute_ms:.0f} ms "
                             f"compute (50 GB/s H2D, 200 TFLOPS assumed)")
        else:
            lines.append(f"  unet : {gb(self.unet_bytes)} weights, resident on the device")
        lines.append(f"         activations+workspace estimate {gb(self.unet_activation_bytes)} at latent "
                     f"{hw[0]}x{hw[1]}, batch {b}")
        lines.append(f"  vae  : {gb(self.vae_bytes)} weights, {where[self.vae_mode]}")
        est = ", ".join(f"{s} {gb(v)}" for s, v in self.peaks.items())
        lines.append(f"  estimated peak per stage: {est}")
        if measured:
            parts = []
            for stage, (value, exact) in measured.items():
                parts.append(f"{stage} {'' if exact else '<= '}{gb(value)}")
            lines.append(f"  measured peak reserved per stage: {', '.join(parts)}")
        else:
            lines.append("  measured peak per stage: (after the first run; see engine.placement.report())")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _packed(slot_bytes: int) -> str:
    """The plan's words for a ring with a packed staging slot (``memory/packed_weights.py``)."""
    if not slot_bytes:
        return ""
    return f" (with a {gb(slot_bytes)} slot: bf16 weights cross packed losslessly, ~70% of their bytes)"
