"""bench/suite_lora.py: what ``merged_session_ms`` times.

The record's notes say "save touched weights + merge at attach": the clock starts after ``inject_lora`` (cached
load, key resolution, adapter building), so building the view is not part of the session, as for the unmerged
strength change, whose views are built before its timing. A fake clock advances 50 ms in ``inject_lora`` and 2 ms
in the session's attach: only the 2 ms may count.
"""
import contextlib

import pytest

from leandiffusion.bench import suite_lora


def test_merged_session_times_the_attach_alone(monkeypatch):
    clock = [0.0]
    events = []

    class View:
        @contextlib.contextmanager
        def session(self, stage):
            events.append(("attach", stage))
            clock[0] += 0.002
            yield self
            clock[0] += 0.030  # the detach (restore) is not part of the record
            events.append(("detach", stage))

    def inject_lora(engine, path, strength, strength_text_encoder, mode):
        events.append(("inject", mode, strength))
        clock[0] += 0.050
        return View()

    monkeypatch.setattr("leandiffusion.lora.inject_lora", inject_lora)
    monkeypatch.setattr(suite_lora.time, "perf_counter", lambda: clock[0])
    session_ms, inject_ms = suite_lora._merged_session_ms("engine", "file", 0.6, lambda: events.append(("sync",)))
    assert session_ms == pytest.approx(2.0) and inject_ms == pytest.approx(50.0)  # not 52: the view's build is left out
    assert events == [("inject", "merged", 0.6), ("sync",), ("attach", "unet"), ("sync",), ("detach", "unet")]
