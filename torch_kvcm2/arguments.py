"""Checks of the arguments of a batch's calls (the tensors and sequences callers pass), so every
refusal reads the same whichever part of the batch makes it. Each check raises TypeError or
ValueError naming the argument and changes nothing; the ops' native checks run again on what
reaches them (metadata only), these give the message in the caller's terms first.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ._util import cite
from .config import INT32_MAX

INT32 = torch.int32


def check_not_meta(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device (it has no values); pass a tensor on "
                         f"{device}")


def check_index_tensor(name: str, t, device: torch.device, shape: tuple) -> None:
    """An int32 tensor on ``device``, contiguous, of ``shape`` (``()`` checks everything but the
    shape)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    where = t.device
    if where.type == "meta":
        check_not_meta(name, t, device)
    if t.dtype != INT32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if where.type != device.type or (device.index is not None and where.index != device.index):
        raise ValueError(f"{name} must be on {device}, got {where}")
    if shape != () and tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_rows_tensor(name: str, t, device: torch.device, rows: int) -> None:
    """An int32[rows] tensor on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32[{rows}] tensor, got {type(t).__name__}")
    check_index_tensor(name, t, device, (rows,))


def check_selection(name: str, t, device: torch.device, rows: int, sp) -> int:
    """A selection for ``resolve``: int32 [rows, K] or [rows, T', K] with 1 <= T' <=
    max_query_tokens, on ``device``, contiguous. Returns its T'."""
    if isinstance(t, torch.Tensor) and t.dim() == 2:
        check_index_tensor(name, t, device, (rows, sp.width))
        return 1
    T = sp.max_query_tokens
    if not isinstance(t, torch.Tensor) or t.dim() != 3:
        check_index_tensor(name, t, device, ())  # a non-tensor, a wrong dtype or device
        raise ValueError(f"{name} must be 2-D ({rows}, {sp.width}) or 3-D ({rows}, query tokens "
                         f"1..{T}, {sp.width}), got {t.dim()}-D shape {tuple(t.shape)}")
    tokens = t.shape[1]
    if not 1 <= tokens <= T:
        check_index_tensor(name, t, device, ())
        raise ValueError(cite(f"{name} has {tokens} query tokens per row (shape "
                              f"{tuple(t.shape)}) but the selection group allows 1..{T} "
                              f"(max_query_tokens, MTP-2)"))
    check_index_tensor(name, t, device, (rows, tokens, sp.width))
    return tokens


def int_sequence(name: str, values, length: Optional[int], device: torch.device) -> list[int]:
    """``values`` (a sequence, numpy array or tensor of ints in [0, 2**31)) as a list of ints,
    of ``length`` entries (None: any)."""
    if isinstance(values, torch.Tensor):
        check_not_meta(name, values, device)
        values = values.tolist()
    elif isinstance(values, np.ndarray):
        values = values.tolist()
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        count = "" if length is None else f"{length} "
        raise TypeError(f"{name} must be a sequence of {count}ints or a tensor (one value per "
                        f"row), got {type(values).__name__} {values!r}")
    values = list(values)
    if length is not None and len(values) != length:
        raise ValueError(f"{name} must have {length} values (one per row), got {len(values)}")
    if all(type(v) is int for v in values) and (
            not values or (min(values) >= 0 and max(values) <= INT32_MAX)):
        return values  # plain ints in range (the common case, checked without a loop)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name} values must be ints, got {type(v).__name__} {v!r}")
        if not 0 <= v <= INT32_MAX:
            raise ValueError(f"{name} values must be in [0, 2**31 - 1], got {v}")
    return [int(v) for v in values]


def check_row(row, rows: int, what: str) -> None:
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < rows:
        raise ValueError(f"{what}: row must be an int in [0, {rows}), got {row!r}")


def fits(t: torch.Tensor, shape: tuple, device: torch.device) -> bool:
    """The eager calls' test for taking a tensor without the checks above: int32, ``shape``,
    contiguous, on ``device`` (a batch tensor's device, with its index). The op's native checks
    still run on it; what fails here takes the checks above, for their messages."""
    return (t.dtype is INT32 and t.shape == shape and t.device == device
            and t.is_contiguous())
