"""GPU benchmarks against peers (``python -m leandiffusion.bench``): suites ``suite_<name>.py``, harness, report."""
