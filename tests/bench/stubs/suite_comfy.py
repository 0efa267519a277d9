"""Stub suite (tests only): needs --comfyui, so it is skipped without one."""
SUITE = "comfy"
REQUIRES_COMFYUI = True


def run(ctx):
    ctx.record("x", "time_ms", 1.0, unit="ms")
