"""Configuration (REQUIREMENTS §3, CFG-1..7): frozen dataclasses validated at construction.

Every violation raises ``ValueError`` naming the layer, the buffer and the rule before anything
is allocated. Sequences given as lists are stored as tuples so configs are hashable.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from . import lengths

BAD = -1  #: "no page / no entry"; never scaled, never folded to 0
INT32_MAX = 2**31 - 1


def max_inflight_units(max_inflight_tokens: int, tokens_per_unit: int) -> int:
    """Most units an in-flight range of ``max_inflight_tokens`` can overlap (CFG-3): the range
    may start inside a unit, hence the +1. The C++ kernels use the same rule (``csrc/rules.h``)."""
    return -(-max_inflight_tokens // tokens_per_unit) + 1


def _fail(rule: str, detail: str, layer: Optional[str] = None, buffer: Optional[str] = None):
    where = "config" if layer is None else f"layer {layer!r}"
    if buffer is not None:
        where += f", buffer {buffer!r}"
    raise ValueError(f"{where}: {rule}: {detail}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class BufferSpec:
    """One named tensor role of a layer.

    ``bytes_per_token`` may be 0 (CFG-6: no memory, cells or copies). ``chunks`` describes the
    page layout (CFG-2): a page is ``chunks`` equal contiguous slabs, each holding the page's
    tokens in order (1 = token-major, H = head-major). ``sparse`` puts the buffer's history in
    host memory behind per-row cells; otherwise it lives in a paged GPU pool.
    """

    role: str
    bytes_per_token: int
    sparse: bool = False
    chunks: int = 1

    @property
    def bytes_per_chunk_token(self) -> int:
        return self.bytes_per_token // self.chunks


@dataclass(frozen=True)
class SparseSpec:
    """Sparse settings of a layer (CFG-3): unit size U, selection width K, slots S per row,
    the in-flight token budget I per row, an optional shared ``selection_id`` (CFG-4), and
    ``max_query_tokens`` T, the most query tokens of a row one step resolves together (MTP-1;
    1 for plain decoding, 1 + drafts for speculative decoding)."""

    tokens_per_unit: int
    width: int
    slots: int
    max_inflight_tokens: int
    selection_id: Optional[str] = None
    max_query_tokens: int = 1

    @property
    def max_selected_columns(self) -> int:
        """T·K: a row's selected columns over all its query tokens, the widest union one resolve
        seats (MTP-3)."""
        return self.max_query_tokens * self.width

    @property
    def max_inflight_units(self) -> int:
        return max_inflight_units(self.max_inflight_tokens, self.tokens_per_unit)

    def inflight_start(self, history: int, capacity: int) -> int:
        """s0 = max(h, floor((c - I) / U) * U): where a row's in-flight range starts (REQUIREMENTS §2);
        tokens in [h, s0) are written straight to host pages, [s0, c) into cells."""
        return lengths.inflight_start(history, capacity,
                                      (self.tokens_per_unit, self.max_inflight_tokens), max)


@dataclass(frozen=True)
class LayerSpec:
    """A layer: its buffers, an optional sliding ``window`` in tokens, and sparse settings when
    any buffer is sparse (CFG-5)."""

    name: str
    buffers: Sequence[BufferSpec]
    window: Optional[int] = None
    sparse: Optional[SparseSpec] = None

    def __post_init__(self):
        object.__setattr__(self, "buffers", tuple(self.buffers))

    @property
    def sparse_buffers(self) -> tuple[BufferSpec, ...]:
        return tuple(b for b in self.buffers if b.sparse)


@dataclass(frozen=True)
class SelectionGroup:
    """Layers driven by one indexer: one resident set, one recency order, one resolve per step."""

    index: int
    key: tuple  # ("id", selection_id) or ("layer", name): explicit and private never collide
    layers: tuple[str, ...]
    sparse: SparseSpec
    window: Optional[int]
    tokens_per_page: int

    @property
    def units_per_page(self) -> int:
        return self.tokens_per_page // self.sparse.tokens_per_unit

    @property
    def name(self) -> str:
        return self.key[1] if self.key[0] == "id" else f"<layer {self.key[1]}>"


@dataclass(frozen=True)
class CacheConfig:
    """Everything the manager needs (CFG-1).

    ``max_total_input_tokens`` bounds the in-flight tokens of all rows (the write-back work
    list); by default ``max_rows`` times the largest in-flight range,
    ``max_inflight_tokens + tokens_per_unit - 1``. Budgets are bytes:
    ``gpu_budget_bytes`` pays for dense pools, cells and device tables, ``host_budget_bytes`` for
    sparse pools and pinned staging (STO-4).
    """

    tokens_per_page: int
    layers: Sequence[LayerSpec]
    max_rows: int
    max_tokens_per_row: int
    gpu_budget_bytes: int
    host_budget_bytes: int
    device: object = "cpu"
    max_total_input_tokens: Optional[int] = None
    selection_groups: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        try:
            object.__setattr__(self, "device", torch.device(self.device))
        except (RuntimeError, TypeError):
            _fail("CFG-1", f"device {self.device!r} is not a torch device")
        self._validate_top()
        for layer in self.layers:
            self._validate_layer(layer)
        object.__setattr__(self, "selection_groups", self._group_layers())
        if self.max_total_input_tokens is None:
            # a unit-aligned in-flight range holds up to I + U - 1 tokens
            widest = max((g.sparse.max_inflight_tokens + g.sparse.tokens_per_unit - 1
                          for g in self.selection_groups), default=1)
            object.__setattr__(self, "max_total_input_tokens", self.max_rows * widest)

    # ---- derived views ----
    def layer(self, name: str) -> LayerSpec:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"unknown layer {name!r}")

    def group_of(self, layer_name: str) -> SelectionGroup:
        """The selection group of a sparse layer (KeyError for unknown or dense layers)."""
        for group in self.selection_groups:
            if layer_name in group.layers:
                return group
        self.layer(layer_name)
        raise KeyError(f"layer {layer_name!r} has no sparse buffers, hence no selection group")

    @property
    def max_pages_per_row(self) -> int:
        return -(-self.max_tokens_per_row // self.tokens_per_page)

    # ---- validation ----
    def _validate_top(self):
        for name in ("tokens_per_page", "max_rows", "max_tokens_per_row"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                _fail("CFG-1", f"{name} must be a positive int, got {value!r}")
        if self.max_tokens_per_row > INT32_MAX:
            _fail("CFG-1", f"max_tokens_per_row must fit int32, got {self.max_tokens_per_row}")
        for name in ("gpu_budget_bytes", "host_budget_bytes"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                _fail("CFG-1", f"{name} must be a non-negative int, got {value!r}")
        total = self.max_total_input_tokens
        if total is not None and (not _is_int(total) or total <= 0):
            _fail("CFG-1", f"max_total_input_tokens must be a positive int or None, got {total!r}")
        if not self.layers:
            _fail("CFG-1", "at least one layer is required")
        for layer in self.layers:
            if not isinstance(layer, LayerSpec):
                _fail("CFG-1", f"layers must be LayerSpec, got {type(layer).__name__}")
            if not isinstance(layer.name, str) or not layer.name:
                _fail("CFG-1", f"a layer name must be a non-empty str, got {layer.name!r}")
        names = [layer.name for layer in self.layers]
        for name in names:
            if names.count(name) > 1:
                _fail("CFG-1", "layer names must be unique", layer=name)

    def _validate_layer(self, layer: LayerSpec):
        name = layer.name
        if layer.window is not None and (not _is_int(layer.window) or layer.window <= 0):
            _fail("CFG-1", f"window must be a positive int or None, got {layer.window!r}", name)
        if not layer.buffers:
            _fail("CFG-1", "a layer needs at least one buffer", name)
        for buf in layer.buffers:
            if not isinstance(buf, BufferSpec):
                _fail("CFG-1", f"buffers must be BufferSpec, got {type(buf).__name__}", name)
            if not isinstance(buf.role, str) or not buf.role:
                _fail("CFG-1", f"a buffer role must be a non-empty str, got {buf.role!r}", name)
            if not isinstance(buf.sparse, bool):
                _fail("CFG-1", f"sparse must be a bool, got {buf.sparse!r}", name, buf.role)
        if layer.sparse is not None and not isinstance(layer.sparse, SparseSpec):
            _fail("CFG-3", f"sparse settings must be a SparseSpec or None, got "
                  f"{type(layer.sparse).__name__}", name)
        roles = [b.role for b in layer.buffers]
        for buf in layer.buffers:
            if roles.count(buf.role) > 1:
                _fail("CFG-1", "buffer roles must be unique within a layer", name, buf.role)
            if not _is_int(buf.bytes_per_token) or buf.bytes_per_token < 0:
                _fail("CFG-1", f"bytes_per_token must be a non-negative int, got "
                      f"{buf.bytes_per_token!r}", name, buf.role)
            if not _is_int(buf.chunks) or buf.chunks <= 0:
                _fail("CFG-2", f"chunks must be a positive int, got {buf.chunks!r}", name, buf.role)
            if buf.bytes_per_token % buf.chunks:
                _fail("CFG-2", f"bytes_per_token ({buf.bytes_per_token}) must be divisible by chunks "
                      f"({buf.chunks})", name, buf.role)
            if self.tokens_per_page * buf.bytes_per_token > INT32_MAX:
                _fail("CFG-1", f"a page ({self.tokens_per_page} tokens x {buf.bytes_per_token} "
                      f"bytes) must be smaller than 2 GiB (int32 byte offsets)", name, buf.role)
        sparse_buffers = layer.sparse_buffers
        if sparse_buffers and layer.sparse is None:
            _fail("CFG-5", "a layer with sparse buffers needs sparse settings", name,
                  sparse_buffers[0].role)
        if not sparse_buffers and layer.sparse is not None:
            _fail("CFG-5", "a layer without sparse buffers must not have sparse settings", name)
        if layer.sparse is not None:
            self._validate_sparse(layer, layer.sparse, sparse_buffers[0].role)

    def _validate_sparse(self, layer: LayerSpec, sp: SparseSpec, role: str):
        for attr in ("tokens_per_unit", "width", "slots", "max_inflight_tokens"):
            value = getattr(sp, attr)
            if not _is_int(value) or value <= 0:
                _fail("CFG-3", f"{attr} must be a positive int, got {value!r}", layer.name, role)
        T = sp.max_query_tokens
        if not _is_int(T) or T <= 0:
            _fail("MTP-1", f"max_query_tokens must be a positive int, got {T!r}", layer.name, role)
        if sp.max_inflight_tokens < T:
            _fail("MTP-1", f"max_inflight_tokens ({sp.max_inflight_tokens}) must be >= "
                  f"max_query_tokens ({T}): every query token of a step is in flight",
                  layer.name, role)
        if self.tokens_per_page % sp.tokens_per_unit:
            _fail("CFG-3", f"tokens_per_unit ({sp.tokens_per_unit}) must divide tokens_per_page "
                  f"({self.tokens_per_page})", layer.name, role)
        units_per_page = self.tokens_per_page // sp.tokens_per_unit
        if sp.slots % units_per_page:
            _fail("CFG-3", f"slots ({sp.slots}) must be a multiple of units per page "
                  f"({units_per_page})", layer.name, role)
        need = sp.max_selected_columns + sp.max_inflight_units
        if sp.slots < need and T == 1:
            _fail("CFG-3", f"slots ({sp.slots}) must be >= width + ceil(max_inflight_tokens / "
                  f"tokens_per_unit) + 1 = {need}", layer.name, role)
        if sp.slots < need:
            _fail("MTP-1", f"slots ({sp.slots}) must be >= max_query_tokens * width + "
                  f"ceil(max_inflight_tokens / tokens_per_unit) + 1 = {T} * {sp.width} + "
                  f"{sp.max_inflight_units} = {need}", layer.name, role)
        if sp.slots > 65535:
            _fail("CFG-3", f"slots ({sp.slots}) must be at most 65535", layer.name, role)
        if self.max_rows * sp.slots > INT32_MAX:
            _fail("CFG-3", f"max_rows * slots ({self.max_rows} * {sp.slots}) must fit int32 "
                  f"(entries are int32)", layer.name, role)
        if sp.selection_id is not None and not isinstance(sp.selection_id, str):
            _fail("CFG-4", f"selection_id must be a str or None, got {sp.selection_id!r}",
                  layer.name, role)

    def _group_layers(self) -> tuple[SelectionGroup, ...]:
        groups: dict[tuple, list[LayerSpec]] = {}
        for layer in self.layers:
            if layer.sparse is None:
                continue
            sid = layer.sparse.selection_id
            key = ("id", sid) if sid is not None else ("layer", layer.name)
            groups.setdefault(key, []).append(layer)
        result = []
        for index, (key, layers) in enumerate(groups.items()):
            first = layers[0]
            for other in layers[1:]:
                a, b = first.sparse, other.sparse
                for attr in ("tokens_per_unit", "width", "slots", "max_inflight_tokens",
                             "max_query_tokens"):
                    if getattr(a, attr) != getattr(b, attr):
                        _fail("CFG-4", f"{attr} ({getattr(b, attr)}) differs from layer "
                              f"{first.name!r} ({getattr(a, attr)}) in selection group "
                              f"{key[1]!r}", other.name, other.sparse_buffers[0].role)
                if first.window != other.window:
                    _fail("CFG-4", f"window ({other.window}) differs from layer {first.name!r} "
                          f"({first.window}) in selection group {key[1]!r}", other.name,
                          other.sparse_buffers[0].role)
            result.append(SelectionGroup(index, key, tuple(l.name for l in layers), first.sparse,
                                         first.window, self.tokens_per_page))
        return tuple(result)
