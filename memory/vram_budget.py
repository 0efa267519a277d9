"""The typed budget a placement exposes: what stays on the device, what streams, the hard byte limit and the room
it leaves for activations.

Invariants
- A ``VramBudget`` is frozen and made once per placement by the planner (``memory/planner.py``); samplers, the VAE
  and the Stream Scheduler read it instead of comparing policy or mode names or redoing the plan's arithmetic.
- ``limit_bytes`` is set exactly under the ``stream`` policy: there the budget is a hard limit on what the process
  holds in every stage (``memory/budget.py`` enforces it on CUDA). Other policies have no limit (``None``).
- ``activation_room_bytes = limit_bytes - resident_bytes - headroom_bytes``: what the limit leaves for the UNet's
  activations beside the weights the UNet stage keeps on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

# Share of the stream budget kept free beyond the activation/workspace estimate: 0, because the estimate carries
# its own margin and the allocator cap (``memory.cap``) holds the budget; budget left idle would stream weights
# that could stay resident.
HEADROOM = 0.0


class StageMode(str, Enum):
    """Where a stage's weights live: always on the device, on it only while the stage runs, on the CPU, or (under
    ``stream``) streamed block by block from pinned host memory: the denoiser beside its resident blocks, a text
    encoder through a staging ring that exists only while its stage runs (``memory/text_units.py``)."""

    RESIDENT = "resident"
    WHILE_USED = "while used"
    CPU = "cpu"
    STREAM = "stream"


@dataclass(frozen=True)
class VramBudget:
    """Device bytes of one placement (zeros where a placement makes no plan, such as the plain resident one)."""

    limit_bytes: Optional[int] = None  # hard limit on what the process holds in every stage; None: no limit
    headroom_bytes: int = 0  # share of the limit kept free beyond the activation estimate (``HEADROOM``)
    resident_bytes: int = 0  # weights on the device while the UNet stage runs (stream: fixed + blocks + ring + text's)
    streamed_bytes: int = 0  # UNet block weights copied from pinned host memory each step
    activation_bytes: int = 0  # the plan's UNet activation + workspace estimate at its working shape
    text_bytes: int = 0  # text encoder weights in the text dtype
    text_arena_bytes: int = 0  # a streamed text encoder's staging ring (on the device while the text stage runs)
    text_activation_bytes: int = 0  # the plan's text stage activation + workspace estimate (Qwen3-like encoders)
    vae_bytes: int = 0  # VAE weights in the VAE dtype
    text: StageMode = StageMode.RESIDENT
    vae: StageMode = StageMode.RESIDENT
    unet: StageMode = StageMode.RESIDENT

    @property
    def hard(self) -> bool:
        """True when ``limit_bytes`` caps every stage (the ``stream`` policy)."""
        return self.limit_bytes is not None

    @property
    def streams_unet(self) -> bool:
        return self.unet is StageMode.STREAM

    @property
    def supports_compile(self) -> bool:
        """torch.compile traces the UNet; a streamed UNet's hooks fork side-stream copies per block, which a CUDA
        graph captures but dynamo should not trace through."""
        return not self.streams_unet

    @property
    def text_on_device(self) -> bool:
        """False when the text encoders run on the CPU (only their embeddings move)."""
        return self.text is not StageMode.CPU

    @property
    def activation_room_bytes(self) -> Optional[int]:
        """What the hard limit leaves for UNet activations (module docstring); ``None`` without a limit."""
        if self.limit_bytes is None:
            return None
        return self.limit_bytes - self.resident_bytes - self.headroom_bytes

    def entering_bytes(self, stage: str, text_activation_bytes: Optional[int] = None) -> int:
        """Bytes ``stage`` brings onto the device when it is entered: the weights of a stage placed only while used,
        or a streamed text encoder's staging ring; for the text stage also its activations: the plan's estimate
        (0 where the plan makes none: CLIP encoders), or ``text_activation_bytes`` where the caller sized them for
        the prompts at hand (never more than the plan's estimate)."""
        activations = self.text_activation_bytes
        if text_activation_bytes is not None and self.text_activation_bytes:
            activations = min(activations, int(text_activation_bytes))
        if stage == "vae" and self.vae is StageMode.WHILE_USED:
            return self.vae_bytes
        if stage == "text" and self.text is StageMode.WHILE_USED:
            return self.text_bytes + activations
        if stage == "text" and self.text is StageMode.STREAM:
            return self.text_arena_bytes + activations
        return 0


UNBUDGETED = VramBudget()
