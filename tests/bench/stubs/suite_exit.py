"""Stub suite (tests only): dies hard (no exception, no result), as a segfault would."""
import os

SUITE = "exit"
SMOKE_BUDGET_S = 10


def run(ctx):
    os._exit(3)
