"""Configuration (REQUIREMENTS §3, CFG-1..7): frozen dataclasses validated at construction.

Every violation raises ``ValueError`` naming the layer, the buffer and the rule (and where rule
ids are defined) before anything is allocated: each spec checks its own fields when it is made,
``CacheConfig`` the rules that relate them. Sequences given as lists are stored as tuples so
configs are hashable. A config names its device without opening it (it may be built on a host
without a GPU and shipped); ``KVCacheManager`` refuses a device this process cannot use.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from . import _C, lengths
from ._util import cite

BAD = _C.BAD  #: "no page / no entry" (-1, csrc/rules.h); never scaled, never folded to 0
INT32_MAX = 2**31 - 1


def max_inflight_units(max_inflight_tokens: int, tokens_per_unit: int) -> int:
    """Most units an in-flight range of ``max_inflight_tokens`` can overlap (CFG-3): the range
    may start inside a unit, hence the +1. The C++ kernels use the same rule (``csrc/rules.h``)."""
    return -(-max_inflight_tokens // tokens_per_unit) + 1


def _refuse(where: str, rule: str, detail: str):
    raise ValueError(cite(f"{where}: {rule}: {detail}"))


def _fail(rule: str, detail: str, layer: Optional[str] = None, buffer: Optional[str] = None):
    where = "config" if layer is None else f"layer {layer!r}"
    if buffer is not None:
        where += f", buffer {buffer!r}"
    _refuse(where, rule, detail)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class BufferSpec:
    """One named tensor role of a layer.

    ``bytes_per_token`` may be 0 (CFG-6: no memory, cells or copies). ``chunks`` describes the
    page layout (CFG-2): a page is ``chunks`` equal contiguous slabs, each holding the page's
    tokens in order (1 = token-major, H = head-major). ``sparse`` puts the buffer's history in
    host memory behind per-row cells; otherwise it lives in a paged GPU pool.

    Raises ``ValueError`` naming the buffer and the rule for a bad field: an empty or non-str
    ``role``, a ``bytes_per_token`` that is not a non-negative int (bools are not ints), a
    ``chunks`` that is not a positive int or does not divide ``bytes_per_token``, a non-bool
    ``sparse``. What needs the page size (a page must fit int32 offsets) is the config's check.
    """

    role: str
    bytes_per_token: int
    sparse: bool = False
    chunks: int = 1

    def __post_init__(self):
        if not isinstance(self.role, str) or not self.role:
            _refuse("buffer", "CFG-1", f"a buffer role must be a non-empty str, got {self.role!r}")
        where = f"buffer {self.role!r}"
        if not _is_int(self.bytes_per_token) or self.bytes_per_token < 0:
            _refuse(where, "CFG-1", f"bytes_per_token must be a non-negative int, got "
                    f"{self.bytes_per_token!r}")
        if not isinstance(self.sparse, bool):
            _refuse(where, "CFG-1", f"sparse must be a bool, got {self.sparse!r}")
        if not _is_int(self.chunks) or self.chunks <= 0:
            _refuse(where, "CFG-2", f"chunks must be a positive int, got {self.chunks!r}")
        if self.bytes_per_token % self.chunks:
            _refuse(where, "CFG-2", f"bytes_per_token ({self.bytes_per_token}) must be divisible "
                    f"by chunks ({self.chunks})")

    @property
    def bytes_per_chunk_token(self) -> int:
        return self.bytes_per_token // self.chunks


@dataclass(frozen=True)
class SparseSpec:
    """Sparse settings of a layer (CFG-3): unit size U, selection width K, slots S per row,
    the in-flight token budget I per row, an optional shared ``selection_id`` (CFG-4), and
    ``max_query_tokens`` T, the most query tokens of a row one step resolves together (MTP-1;
    1 for plain decoding, 1 + drafts for speculative decoding).

    Raises ``ValueError`` naming the rule for a bad field: a count that is not a positive int
    (bools are not ints), ``max_inflight_tokens`` below ``max_query_tokens``, a ``selection_id``
    that is neither a non-empty str nor None. The rules that relate the fields to the page size
    and the batch (CFG-3: units per page, slots for a full selection, entries in int32) are the
    config's checks."""

    tokens_per_unit: int
    width: int
    slots: int
    max_inflight_tokens: int
    selection_id: Optional[str] = None
    max_query_tokens: int = 1

    def __post_init__(self):
        sid = self.selection_id
        if sid is not None and (not isinstance(sid, str) or not sid):
            _refuse("sparse settings", "CFG-4", f"selection_id must be a non-empty str or None, "
                    f"got {sid!r}")
        where = "sparse settings" + (f" of selection_id {sid!r}" if sid is not None else "")
        for attr in ("tokens_per_unit", "width", "slots", "max_inflight_tokens"):
            value = getattr(self, attr)
            if not _is_int(value) or value <= 0:
                _refuse(where, "CFG-3", f"{attr} must be a positive int, got {value!r}")
        T = self.max_query_tokens
        if not _is_int(T) or T <= 0:
            _refuse(where, "MTP-1", f"max_query_tokens must be a positive int, got {T!r}")
        if self.max_inflight_tokens < T:
            _refuse(where, "MTP-1", f"max_inflight_tokens ({self.max_inflight_tokens}) must be "
                    f">= max_query_tokens ({T}): every query token of a step is in flight")

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
    any buffer is sparse (CFG-5). A windowed layer may keep ``sinks`` tokens at the start
    forever (attention sinks, TIER-3): its first ``ceil(sinks / tokens_per_page)`` pages are
    never released by the window (REQ-3); default 0.

    Raises ``ValueError`` naming the layer (and buffer) and the rule for an empty or non-str
    ``name``, ``buffers`` that are empty, not ``BufferSpec`` or share a role, a ``window`` that
    is neither a positive int nor None, ``sinks`` that is not a non-negative int or is positive
    without a window, ``sparse`` settings that are not a ``SparseSpec``. Whether sparse buffers
    and sparse settings go together (CFG-5) is the config's check."""

    name: str
    buffers: Sequence[BufferSpec]
    window: Optional[int] = None
    sparse: Optional[SparseSpec] = None
    sinks: int = 0

    def __post_init__(self):
        name = self.name
        if not isinstance(name, str) or not name:
            _refuse("layer", "CFG-1", f"a layer name must be a non-empty str, got {name!r}")
        where = f"layer {name!r}"
        try:
            object.__setattr__(self, "buffers", tuple(self.buffers))
        except TypeError:
            _refuse(where, "CFG-1", f"buffers must be a sequence of BufferSpec, got "
                    f"{type(self.buffers).__name__}")
        if self.window is not None and (not _is_int(self.window) or self.window <= 0):
            _refuse(where, "CFG-1", f"window must be a positive int or None, got {self.window!r}")
        if not _is_int(self.sinks) or self.sinks < 0:
            _refuse(where, "TIER-3", f"sinks must be a non-negative int, got {self.sinks!r}")
        if self.sinks and self.window is None:
            _refuse(where, "TIER-3", f"sinks ({self.sinks}) needs a window: sink tokens are what "
                    f"a sliding-window layer keeps at the start")
        if not self.buffers:
            _refuse(where, "CFG-1", "a layer needs at least one buffer")
        roles = set()
        for buf in self.buffers:
            if not isinstance(buf, BufferSpec):
                _refuse(where, "CFG-1", f"buffers must be BufferSpec, got {type(buf).__name__}")
            if buf.role in roles:
                _refuse(f"{where}, buffer {buf.role!r}", "CFG-1",
                        "buffer roles must be unique within a layer")
            roles.add(buf.role)
        if self.sparse is not None and not isinstance(self.sparse, SparseSpec):
            _refuse(where, "CFG-3", f"sparse settings must be a SparseSpec or None, got "
                    f"{type(self.sparse).__name__}")

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
    sinks: int  # tokens kept at the start of a windowed group (TIER-3)

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
    sparse pools and pinned staging (STO-4). ``gpu_history_bytes`` (RSD-1, default 0: every
    sparse history offloaded) is GPU memory for the sparse history of rows that fit there:
    ``gpu_history_slots`` pages of every sparse buffer (``gpu_history_page_bytes`` per page
    ordinal of a row), set aside once in the batch reserve and held by one open batch at a time
    (the first that is built while no other holds it), after its cells in one index space; the
    GPU budget pays for it. ``device`` is "cpu" or a CUDA device, checked to be
    a torch device of a supported type but not opened: ``KVCacheManager`` raises RuntimeError
    when this process cannot use it (``torch_kvcm2.missing_for``).
    """

    tokens_per_page: int
    layers: Sequence[LayerSpec]
    max_rows: int
    max_tokens_per_row: int
    gpu_budget_bytes: int
    host_budget_bytes: int
    device: object = "cpu"
    max_total_input_tokens: Optional[int] = None
    gpu_history_bytes: int = 0
    selection_groups: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        try:
            object.__setattr__(self, "device", torch.device(self.device))
        except (RuntimeError, TypeError):
            _fail("CFG-1", f"device {self.device!r} is not a torch device")
        if self.device.type not in ("cpu", "cuda"):
            _fail("CFG-1", f"device {str(self.device)!r} is not supported: cpu or cuda")
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

    @property
    def gpu_history_page_bytes(self) -> int:
        """GPU bytes of one page ordinal of a row's GPU-resident history: a page of every
        non-zero sparse buffer of every sparse layer (RSD-1)."""
        return sum(self.tokens_per_page * buf.bytes_per_token for layer in self.layers
                   for buf in layer.sparse_buffers if buf.bytes_per_token > 0)

    @property
    def gpu_history_slots(self) -> int:
        """GPU history page slots (``gpu_history_bytes`` in whole pages; 0: off)."""
        page = self.gpu_history_page_bytes
        return self.gpu_history_bytes // page if page else 0

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
        if not _is_int(self.gpu_history_bytes) or self.gpu_history_bytes < 0:
            _fail("CFG-1", f"gpu_history_bytes must be a non-negative int, got "
                           f"{self.gpu_history_bytes!r}")
        total = self.max_total_input_tokens
        if total is not None and (not _is_int(total) or total <= 0):
            _fail("CFG-1", f"max_total_input_tokens must be a positive int or None, got {total!r}")
        if not self.layers:
            _fail("CFG-1", "at least one layer is required")
        for layer in self.layers:
            if not isinstance(layer, LayerSpec):
                _fail("CFG-1", f"layers must be LayerSpec, got {type(layer).__name__}")
        seen = set()
        for layer in self.layers:
            if layer.name in seen:
                _fail("CFG-1", "layer names must be unique", layer=layer.name)
            seen.add(layer.name)

    def _validate_layer(self, layer: LayerSpec):
        """The rules that relate a layer to the rest of the config (each spec checked its own
        fields when it was made)."""
        name = layer.name
        for buf in layer.buffers:
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
        T = sp.max_query_tokens
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
                if first.sinks != other.sinks:
                    _fail("CFG-4", f"sinks ({other.sinks}) differs from layer {first.name!r} "
                          f"({first.sinks}) in selection group {key[1]!r}", other.name,
                          other.sparse_buffers[0].role)
            result.append(SelectionGroup(index, key, tuple(l.name for l in layers), first.sparse,
                                         first.window, self.tokens_per_page, first.sinks))
        return tuple(result)
