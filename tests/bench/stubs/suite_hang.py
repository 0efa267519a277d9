"""Stub suite (tests only): records once, then sleeps past its budget (the CLI must kill it)."""
import time

SUITE = "hang"
SMOKE_BUDGET_S = 5


def run(ctx):
    ctx.record("before_hang", "time_ms", 1.0, unit="ms")
    time.sleep(600)
