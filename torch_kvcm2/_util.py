"""Small helpers shared by the host-side objects."""
from __future__ import annotations

import torch


def refuse_during_capture(device: torch.device, what: str) -> None:
    """Host-side calls change tables a captured graph would silently bake in: refuse them while
    the current CUDA stream is capturing (BAT-4, SAFE-3)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what} is a host-side call and cannot run during CUDA stream capture")


def check_int(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def bound_like(t: torch.Tensor, shape: tuple, device: torch.device) -> bool:
    """``t`` is like the batch's own tensor of ``shape`` on ``device`` (Batch's eager path,
    which then calls the op without Python-side checks): int32, that shape, that device,
    contiguous."""
    return (t.dtype is torch.int32 and t.shape == shape and t.device == device
            and t.is_contiguous())
