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

