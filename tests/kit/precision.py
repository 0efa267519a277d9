"""``strict_fp32()``: cuBLAS matmuls and cuDNN convolutions in IEEE fp32 (no TF32) inside the block, every setting
restored exactly after it.

Uses PyTorch's ``fp32_precision`` API where it exists (the pack writes TF32 only through it, and PyTorch refuses
to read the legacy ``allow_tf32`` flags once the new API has been written); the legacy flags on older torch.
Restoring through the legacy setter would leave the new API's "not set" (``none``) as an explicit ``ieee``.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def strict_fp32():
    b = torch.backends
    if hasattr(b.cuda.matmul, "fp32_precision"):
        owners = [b.cuda.matmul, b.cudnn.conv]
        old = [o.fp32_precision for o in owners]
        try:
            for o in owners:
                o.fp32_precision = "ieee"
            yield
        finally:
            for o, value in zip(owners, old):
                o.fp32_precision = value
        return
    old = b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32
    try:
        b.cuda.matmul.allow_tf32 = b.cudnn.allow_tf32 = False
        yield
    finally:
        b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32 = old
