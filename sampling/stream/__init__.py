"""Stream Scheduler Sampler: many prompts pipelined over text encoding, denoising and decoding.

Public entry point: ``scheduler.run_stream``; the node is ``nodes/stream.py``. See ``docs/stream.md``.
"""
