"""Reference-counted attach/detach shared by the merged and unmerged LoRA bindings.

Invariant: per model component ("unet", "text_encoder", ...) a binding is either inactive (depth 0) or active
with exactly one strength. Nested sessions of views with the same strength share one activation (depth counts
them); a view with a different strength while active is refused, because one set of shared modules cannot run
two strengths at once. ``attach`` is atomic: when any component fails, the ones already activated are undone
before the error propagates, so a failed attach leaves the model exactly as it was.
"""
from __future__ import annotations

from typing import Iterable, Mapping


class RefCountedBinding:
    """Subclasses implement ``_activate(comp, strength)`` and ``_deactivate(comp)``; ``verb`` names the activation."""

    verb = "attached to"
    label = ""

    def _init_refcounts(self, components: Iterable[str]) -> None:
        self._depth: dict[str, int] = {c: 0 for c in components}
        self._active: dict[str, float] = {}

    def _activate(self, comp: str, strength: float) -> None:
        raise NotImplementedError

    def _deactivate(self, comp: str) -> None:
        raise NotImplementedError

    def attach(self, strengths: Mapping[str, float]) -> None:
        """Activate each known component of ``strengths`` at its strength (atomic: all or nothing)."""
        done = []
        try:
            for comp, s in strengths.items():
                if comp not in self._depth:
                    continue
                if self._depth[comp] > 0:
                    if self._active[comp] != s:
                        raise RuntimeError(
                            f"LoRA {self.label!r} is already {self.verb} the {comp} with strength "
                            f"{self._active[comp]}; two views of one LoRA cannot run at once with different "
                            f"strengths (finish one session before starting the other)")
                    self._depth[comp] += 1
                    done.append(comp)
                    continue
                self._activate(comp, s)
                self._active[comp] = s
                self._depth[comp] = 1
                done.append(comp)
        except BaseException:
            self.detach({c: 0.0 for c in done})
            raise

    def detach(self, strengths: Mapping[str, float]) -> None:
        """Undo one ``attach`` of each component named in ``strengths``; the last one deactivates it."""
        for comp in strengths:
            if self._depth.get(comp, 0) == 0:
                continue
            self._depth[comp] -= 1
            if self._depth[comp] == 0:
                self._active.pop(comp, None)
                self._deactivate(comp)
