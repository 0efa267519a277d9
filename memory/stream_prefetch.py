"""Next-forward prefetch for a run of eager streamed forwards (``BlockStreamer.prefetch_next``).

Invariant: inside ``next_forward_prefetch(engine, eager)`` every forward computes on the same bytes as without it:
a head unit's copy lands in the same ring slice, only during the previous forward, after the last block that
reads that slice; the latent is bit-identical. On exit nothing copied ahead is relied on (the next forward copies
all of its units again).

Why: a copy-bound streamed step otherwise leaves the copy engine idle from the previous forward's last copy to the
next forward's start, every step. Eager forwards only: a captured graph must be self-contained.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator


@contextlib.contextmanager
def next_forward_prefetch(engine, eager: bool) -> Iterator[Callable[[bool], None]]:
    """Prefetch across the run's forwards of ``engine``'s streamed denoiser when ``eager``; yields the switch the
    loop sets before each forward: whether another forward follows it (the last one copies nothing ahead)."""
    streamer = getattr(engine.placement, "streamer", None)
    if not eager or streamer is None:
        yield lambda follows: None
        return
    try:
        yield streamer.prefetch_next
    finally:
        streamer.drop_prefetched()
