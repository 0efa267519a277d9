"""A stand-in for ``bridge.ProgressBar`` that records what a run shows, for tests of progress over a batch.

Invariant: like ComfyUI's ``comfy.utils.ProgressBar`` it has ``update(n)`` and the re-plan ``set(value, total)``
(ComfyUI's ``update_absolute``); ComfyUI clamps a value past its total to the total, so a run that overshoots sits
at 100% while work remains. ``seen`` lists every (value, total) shown, so a test can check none passed its total.
"""
from contextlib import contextmanager


class ComfyLikeBar:
    def __init__(self, total, desc="", quiet=False):
        self.total, self.value, self.seen = total, 0, []

    def update(self, n=1):
        self.value += n
        self.seen.append((self.value, self.total))

    def set(self, value, total):
        self.value, self.total = value, total
        self.seen.append((value, total))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@contextmanager
def cancelled_at_check(n: int):
    """Inside the block, the ``n``-th interruption check raises ``bridge.Interrupted`` (the user pressed Cancel);
    yields the list of checks made. The hook is removed on exit."""
    from ...bridge import Interrupted, set_interrupt_hook

    checks = []

    def hook():
        checks.append(1)
        if len(checks) == n:
            raise Interrupted("cancel")

    set_interrupt_hook(hook)
    try:
        yield checks
    finally:
        set_interrupt_hook(None)
