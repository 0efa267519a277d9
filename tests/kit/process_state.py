"""A snapshot of the process-wide state a node pack could change behind other nodes' backs, and the diff of two.

The pack runs inside a user's ComfyUI process next to other packs and ComfyUI's own samplers. Whatever it sets
process-wide outlives the node call and changes other nodes' pictures (TF32, reduced-precision reductions, SDPA
backends, deterministic algorithms, default dtype, autocast, grad/inference mode), their speed (cuDNN benchmark,
thread counts, compiler settings) or the host program (environment variables, ``sys.path``, the working folder,
signal handlers, other loggers' levels and handlers, warnings filters). ``SWITCHES`` lists each such setting with
how to read it and, where PyTorch or Python offers one, how to put it back; ``snapshot()`` reads them all,
``changes(before, after)`` names what differs and ``restore(before)`` puts back what can be.

Reads never raise: PyTorch refuses some reads in some states (the legacy ``allow_tf32`` flags once the new
``fp32_precision`` API has set TF32 globally), and such a read is recorded as ``Unreadable(message)``, so a call
that turns a readable flag unreadable is a change too (it would make the next reader in the process raise).

Importable without the package (the import audit loads this file by path into a bare interpreter): standard
library and torch only.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch


@dataclass(frozen=True)
class Unreadable:
    message: str


def _read(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except (RuntimeError, AttributeError, TypeError, ValueError) as exc:
        return Unreadable(str(exc).split(".")[0][:120])


def _attr(owner: Any, name: str) -> tuple[Callable, Callable]:
    return (lambda: getattr(owner, name)), (lambda v: setattr(owner, name, v))


def _maybe(owner: Any, name: str) -> Optional[Callable]:
    """``owner.name`` where this PyTorch has it (the floor, 2.4, lacks some of the newer switches), else None."""
    return getattr(owner, name, None)


def _torch_switches() -> dict[str, tuple[Callable, Optional[Callable]]]:
    b = torch.backends
    s: dict[str, tuple[Callable, Optional[Callable]]] = {
        "grad_enabled": (torch.is_grad_enabled, torch.set_grad_enabled),
        "inference_mode": (torch.is_inference_mode_enabled, None),
        "default_dtype": (torch.get_default_dtype, torch.set_default_dtype),
        "default_device": (torch.get_default_device, torch.set_default_device),
        "anomaly_mode": (lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()), None),
        "deterministic_algorithms": (lambda: (torch.are_deterministic_algorithms_enabled(),
                                              torch.is_deterministic_algorithms_warn_only_enabled()),
                                     lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
        "num_threads": (torch.get_num_threads, torch.set_num_threads),
        "num_interop_threads": (torch.get_num_interop_threads, None),
        "autocast_cache": (torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled),
        "sdp.flash": (b.cuda.flash_sdp_enabled, b.cuda.enable_flash_sdp),
        "sdp.mem_efficient": (b.cuda.mem_efficient_sdp_enabled, b.cuda.enable_mem_efficient_sdp),
        "sdp.math": (b.cuda.math_sdp_enabled, b.cuda.enable_math_sdp),
        "sdp.cudnn": (_maybe(b.cuda, "cudnn_sdp_enabled"), _maybe(b.cuda, "enable_cudnn_sdp")),
        "sdp.fp16_bf16_reduction_math": (_maybe(b.cuda, "fp16_bf16_reduction_math_sdp_allowed"),
                                         _maybe(b.cuda, "allow_fp16_bf16_reduction_math_sdp")),
        "cuda.preferred_linalg_library": (_maybe(b.cuda, "preferred_linalg_library"), None),
        "cuda.preferred_blas_library": (_maybe(b.cuda, "preferred_blas_library"), None),
    }
    for device in ("cpu", "cuda"):
        s[f"autocast.{device}"] = (lambda d=device: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)), None)
    other = [("cudnn.enabled", b.cudnn, "enabled"), ("cudnn.benchmark", b.cudnn, "benchmark"),
             ("cudnn.benchmark_limit", b.cudnn, "benchmark_limit"), ("cudnn.deterministic", b.cudnn, "deterministic"),
             ("matmul.fp16_reduced", b.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
             ("matmul.bf16_reduced", b.cuda.matmul, "allow_bf16_reduced_precision_reduction"),
             ("mkldnn.enabled", b.mkldnn, "enabled"), ("mkldnn.deterministic", b.mkldnn, "deterministic"),
             ("opt_einsum.enabled", _maybe(b, "opt_einsum"), "enabled"),
             ("opt_einsum.strategy", _maybe(b, "opt_einsum"), "strategy")]
    other += [(f"matmul.{name}", b.cuda.matmul, name) for name in ("fp16_accumulation", "allow_fp16_accumulation")
              if hasattr(b.cuda.matmul, name)]
    # TF32: the legacy flags first, so ``restore`` writes them before the new API's values (PyTorch >= 2.9 keeps both;
    # a legacy write resets the new API's per-operator values, and once only the new API has written, the legacy reads
    # raise until a legacy write); the legacy setters alone would leave the new API's "none" as an explicit value
    s["float32_matmul_precision"] = (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision)
    attributes = [("matmul.allow_tf32", b.cuda.matmul, "allow_tf32"), ("cudnn.allow_tf32", b.cudnn, "allow_tf32")]
    attributes += other
    if hasattr(b.cuda.matmul, "fp32_precision"):
        attributes += [("fp32_precision", b, "fp32_precision"),
                       ("matmul.fp32_precision", b.cuda.matmul, "fp32_precision"),
                       ("cudnn.fp32_precision", b.cudnn, "fp32_precision"),
                       ("cudnn.conv.fp32_precision", b.cudnn.conv, "fp32_precision"),
                       ("cudnn.rnn.fp32_precision", b.cudnn.rnn, "fp32_precision"),
                       ("mkldnn.fp32_precision", b.mkldnn, "fp32_precision"),
                       ("mkldnn.matmul.fp32_precision", b.mkldnn.matmul, "fp32_precision"),
                       ("mkldnn.conv.fp32_precision", b.mkldnn.conv, "fp32_precision")]
    for name, owner, attr in attributes:
        if owner is not None:  # an attribute this PyTorch lacks reads as Unreadable, the same before and after
            s[name] = _attr(owner, attr)
    s["deterministic.fill_uninitialized_memory"] = _attr(torch.utils.deterministic, "fill_uninitialized_memory")
    if torch.cuda.is_available():
        s["cuda.current_device"] = (torch.cuda.current_device, torch.cuda.set_device)
        s["cuda.current_stream"] = (lambda: torch.cuda.current_stream().cuda_stream, None)
        if hasattr(torch.cuda, "get_per_process_memory_fraction"):
            s["cuda.memory_fraction"] = (torch.cuda.get_per_process_memory_fraction,
                                         torch.cuda.set_per_process_memory_fraction)
    return {name: entry for name, entry in s.items() if entry[0] is not None}


def _compiler_configs() -> dict[str, tuple[Callable, Optional[Callable]]]:
    """dynamo's and inductor's global config, where already imported (importing them here would take seconds and
    is itself no change a user sees)."""
    s = {}
    for module in ("torch._dynamo.config", "torch._inductor.config"):
        config = sys.modules.get(module)
        if config is not None and hasattr(config, "get_config_copy"):
            s[module] = (lambda c=config: {k: repr(v) for k, v in c.get_config_copy().items()}, None)
    return s


def _own_handlers(logger: logging.Logger) -> tuple:
    """The handlers of ``logger`` other than pytest's capture handlers (pytest swaps those per test phase)."""
    return tuple(h for h in logger.handlers if not type(h).__module__.startswith("_pytest"))


def _logger_state(logger: logging.Logger) -> tuple:
    return logger.level, logger.propagate, logger.disabled, _own_handlers(logger)


def _set_logger_state(logger: logging.Logger, state: tuple) -> None:
    logger.level, logger.propagate, logger.disabled, handlers = state
    for h in _own_handlers(logger):
        if h not in handlers:
            logger.removeHandler(h)
    for h in handlers:
        if h not in logger.handlers:
            logger.addHandler(h)


# torch's structured-trace logger: torch's own lazy handler removes itself at the first record when no trace folder
# is configured (``torch._logging._internal.LazyTraceHandler``); torch owns that change, no caller does
_SELF_MANAGED_LOGGERS = frozenset({"torch.__trace"})


def _loggers() -> dict[str, logging.Logger]:
    named = {name: lg for name, lg in logging.root.manager.loggerDict.items()
             if isinstance(lg, logging.Logger) and name not in _SELF_MANAGED_LOGGERS}
    return {"<root>": logging.root, **named}


_PYTEST_ENV = "PYTEST_CURRENT_TEST"  # pytest rewrites it at each test phase


def _environ() -> dict:
    return {k: v for k, v in os.environ.items() if k != _PYTEST_ENV}


def _restore_env(old: dict) -> None:
    for key in set(_environ()) - set(old):
        del os.environ[key]
    os.environ.update(old)


def _signals() -> dict:
    out = {}
    for sig in signal.valid_signals():
        try:
            out[sig] = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
    return out


def _restore_signals(old: dict) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, handler in old.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)


_PYTEST_HOOK = "<pytest's per-test hook>"


def _hook(owner: Any, name: str) -> tuple[Callable, Callable]:
    """(read, restore) of an exception hook; pytest (8.0-8.x) installs its own per test, which reads as one marker."""
    def read():
        hook = getattr(owner, name)
        bound_to = getattr(hook, "__self__", None)
        return _PYTEST_HOOK if type(bound_to).__module__.startswith("_pytest") else hook

    def restore(value):
        if value != _PYTEST_HOOK:
            setattr(owner, name, value)
    return read, restore


def _is_dynamo_distributed_filter(entry: tuple) -> bool:
    """PyTorch 2.4's dynamo adds ('ignore', UserWarning, module 'torch.distributed') at every frame it converts
    (``TorchPatcher.suppress_torch_distributed_warnings``): torch's own doing on any compile, so not watched."""
    action, message, category, module, _ = entry
    return (action == "ignore" and message is None and category is UserWarning
            and getattr(module, "pattern", None) == "torch.distributed")


def _warnings_filters() -> list:
    return [entry for entry in warnings.filters if not _is_dynamo_distributed_filter(entry)]


def _restore_filters(old: list) -> None:
    warnings.filters[:] = old
    warnings._filters_mutated()


def _process_switches() -> dict[str, tuple[Callable, Optional[Callable]]]:
    s: dict[str, tuple[Callable, Optional[Callable]]] = {
        "os.environ": (_environ, _restore_env),
        "cwd": (os.getcwd, os.chdir),
        "sys.path": (lambda: list(sys.path), lambda v: sys.path.__setitem__(slice(None), v)),
        "signal_handlers": (_signals, _restore_signals),
        "warnings.filters": (_warnings_filters, _restore_filters),
        "warnings.showwarning": (lambda: warnings.showwarning, lambda v: setattr(warnings, "showwarning", v)),
        "logging.disable": (lambda: logging.root.manager.disable, logging.disable),
        "logging.record_factory": (logging.getLogRecordFactory, logging.setLogRecordFactory),
        "logging.logger_class": (logging.getLoggerClass, logging.setLoggerClass),
        "sys.excepthook": _hook(sys, "excepthook"),
        "threading.excepthook": _hook(threading, "excepthook"),
        "sys.recursionlimit": (sys.getrecursionlimit, sys.setrecursionlimit),
        "sys.switchinterval": (sys.getswitchinterval, sys.setswitchinterval),
        "socket.default_timeout": (socket.getdefaulttimeout, socket.setdefaulttimeout),
        "gc": (lambda: (gc.isenabled(), gc.get_threshold()), None),
    }
    for name, logger in _loggers().items():
        s[f"logger[{name}]"] = (lambda lg=logger: _logger_state(lg), lambda v, lg=logger: _set_logger_state(lg, v))
    return s


def switches() -> dict[str, tuple[Callable, Optional[Callable]]]:
    """name -> (read, restore) for every setting this module watches (``restore`` None: only reported)."""
    return {**_torch_switches(), **_compiler_configs(), **_process_switches()}


def snapshot() -> dict[str, Any]:
    return {name: _read(read) for name, (read, _) in switches().items()}


def _short(old: Any, new: Any) -> tuple:
    """(old, new) cut down to what differs: the keys of dict-valued settings (the environment, compiler configs),
    the entries only one side has of list-valued ones (sys.path, warnings filters; a reorder shows whole)."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted((k for k in old.keys() | new.keys() if old.get(k, "<unset>") != new.get(k, "<unset>")), key=str)
        return {k: old.get(k, "<unset>") for k in keys}, {k: new.get(k, "<unset>") for k in keys}
    if isinstance(old, list) and isinstance(new, list):
        gone, added = [v for v in old if v not in new], [v for v in new if v not in old]
        if gone or added:
            return gone, added
    return old, new


def changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple]:
    """name -> (before, after) for each setting read in both snapshots whose value differs (a logger or compiler
    config that first appeared in between is no change of a setting someone else had)."""
    return {name: _short(before[name], after[name]) for name in before.keys() & after.keys()
            if before[name] != after[name]}


def restore(before: dict[str, Any]) -> None:
    """Put back each changed setting that has a restore and was readable before, in ``switches()`` order (one write
    can move another setting: TF32's legacy and new APIs), until nothing restorable is left changed."""
    for _ in range(3):
        table = switches()
        changed = [name for name in changes(before, snapshot()) if table.get(name, (None, None))[1] is not None
                   and not isinstance(before[name], Unreadable)]
        if not changed:
            return
        for name in changed:
            table[name][1](before[name])


@contextlib.contextmanager
def preserved() -> Iterator[None]:
    """Inside the block a test may set process-wide state (a user's TF32 choice, say); after it, every setting that
    has a restore is back as it was."""
    before = snapshot()
    try:
        yield
    finally:
        restore(before)
