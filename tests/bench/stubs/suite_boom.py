"""Stub suite (tests only): records once, then raises."""
SUITE = "boom"
SMOKE_BUDGET_S = 10


def run(ctx):
    ctx.record("before_crash", "time_ms", 1.0, 2.0, "peer", unit="ms")
    raise RuntimeError("stub suite exploded on purpose")
