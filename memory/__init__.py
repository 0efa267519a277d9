"""Model loading, VRAM policies, weight streaming, buffer pool and memory plans (the ``LeanEngine``)."""
