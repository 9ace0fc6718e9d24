"""Small helpers shared by the host-side objects."""
from __future__ import annotations

import sys

import numpy as np
import torch

#: where the requirement ids that messages cite (``CFG-1``, ``STO-4``, ...) are defined
REQUIREMENTS = "docs/REQUIREMENTS.md"


def cite(message: str) -> str:
    """A user-facing message that cites requirement ids, with where they are defined appended;
    every error message that cites one goes through here."""
    return f"{message} (see {REQUIREMENTS})"


def refuse_during_capture(device: torch.device, what: str) -> None:
    """Host-side calls change tables a captured graph would silently bake in: refuse them while
    the current CUDA stream is capturing (BAT-4, SAFE-3). Outside a capture (and a trace), the
    releases that met one run here (``outside_capture``)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what} is a host-side call and cannot run during CUDA stream "
                           f"capture")
    if _deferred:
        release_deferred()


#: finalizer calls that met a CUDA stream capture, in order, with what they hold
_deferred: list = []


def _capturing() -> bool:
    try:
        return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
    except Exception:  # noqa: BLE001 -- a finalizer at interpreter exit, or a lost context
        return False


def _tracing() -> bool:
    """A trace is under way on this thread: a torch dispatch mode is active (make_fx and
    AOTAutograd, under torch.compile or opcheck: proxy, fake and functional tensor modes), or
    dynamo is compiling. An op called now would be traced into the graph being built, not run
    (a finalizer's ``host_register`` recorded into a graph mid-codegen fails FX's code generation
    with ``KeyError: host_register``)."""
    for active in (lambda: torch._C._len_torch_dispatch_stack() > 0,
                   lambda: torch._ops._len_torch_dispatch_stack_pre_dispatch() > 0,
                   torch.compiler.is_compiling):
        try:
            if active():
                return True
        except Exception:  # noqa: BLE001 -- a torch without the probe, or interpreter exit
            continue
    return False


def _held() -> bool:
    """A finalizer's calls must wait: a CUDA stream capture or a trace is under way."""
    return _capturing() or _tracing()


def outside_capture(fn):
    """``fn`` as a finalizer whose CUDA calls (an event's wait, host-memory unregistration) must
    not run while a CUDA stream captures: garbage collection runs finalizers at any allocation,
    so also inside a caller's ``torch.cuda.graph`` capture (torch no longer collects before
    one), where such a call invalidates the caller's capture and fails itself. During a capture
    on this thread the call is kept, and with it everything it holds (the memory it would
    release stays mapped and registered), until ``release_deferred``: the next host-side call of
    the library outside a capture (``refuse_during_capture``). The same holds during a trace
    (``_tracing``), where the call would be traced into the graph being built instead of run."""
    def run(*args):
        if _held():
            _deferred.append((fn, args))
        else:
            fn(*args)
    return run


def release_deferred() -> None:
    """Make the finalizer calls that met a capture, unless one is still under way. One that
    raises is reported as a finalizer's error is (``sys.excepthook``) and the rest still run:
    the host call that happens to release them is not the one that failed."""
    while _deferred and not _held():
        fn, args = _deferred.pop(0)
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 -- as weakref.finalize reports its callback's errors
            sys.excepthook(*sys.exc_info())


def check_int(name: str, value, minimum: int = 0) -> int:
    """``value`` as a Python int (numpy integers accepted), at least ``minimum``."""
    if isinstance(value, np.integer):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)



def has_cuda_kernels() -> bool:
    """True when this build of the extension registered CUDA kernels for its ops."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("torch_kvcm2::resolve", "CUDA")


def missing_for(device) -> list[str]:
    """What this process lacks to run a manager on ``device`` (a torch device or its name), one
    phrase each; empty when nothing is missing. A CPU device lacks nothing. A CUDA device needs
    a CUDA build of torch, an extension built with CUDA kernels and a visible GPU of that index."""
    device = torch.device(device)
    if device.type != "cuda":
        return []
    missing = []
    if torch.version.cuda is None:
        missing.append(f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)")
    if not has_cuda_kernels():
        missing.append("the torch_kvcm2 extension was built without CUDA kernels "
                       "(torch_kvcm2.has_cuda_kernels() is False: build it with a CUDA torch and "
                       "toolkit, TORCH_KVCM2_CUDA=1)")
    if torch.version.cuda is not None:
        if not torch.cuda.is_available():
            missing.append("no CUDA device is visible (torch.cuda.is_available() is False)")
        elif device.index is not None and device.index >= torch.cuda.device_count():
            missing.append(f"there is no device cuda:{device.index} "
                           f"({torch.cuda.device_count()} CUDA device(s) visible)")
    return missing


def require_device(device: torch.device, what: str) -> None:
    """RuntimeError naming everything ``missing_for(device)`` finds, before anything is opened
    on it (a config names its device without opening it, so that it can be built on a host
    without one)."""
    missing = missing_for(device)
    if missing:
        raise RuntimeError(f"{what}: the config's device {str(device)!r} cannot be used in this "
                           f"process: {'; '.join(missing)}. Build the config with "
                           f"device=\"cpu\" to run on the CPU")
