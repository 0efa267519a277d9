"""A stand-in CUDA-graph capture backend for the graph runner's bookkeeping on the CPU (test helper)."""


class StandInBackend:
    """Captures by keeping the callable (replay = call it), after one warm-up call as the CUDA backend runs."""

    name = "stand-in"

    def capture(self, fn, device):
        fn()
        return fn
