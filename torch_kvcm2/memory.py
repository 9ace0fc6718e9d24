"""The memory of a batch, from one table of tensor specs, and the manager's batch reserve.

``batch_tensor_specs`` lists every tensor a ``Batch`` allocates (name, shape, dtype, medium); the
batch allocates exactly these and ``batch_memory_bytes`` sums them, so the reserve the manager
sets aside can never drift from what a batch takes (STO-4). This module depends only on the
config and the op constants, so the manager, the batch and the caches can all use it.
"""
from __future__ import annotations

import gc
import mmap
import weakref
from dataclasses import dataclass

import torch

from . import _C, ops
from .config import CacheConfig, SelectionGroup

INT32 = torch.int32
INT64 = torch.int64
UINT8 = torch.uint8

#: rows of the lengths part of a batch's table store (one int32[max_rows] each), as the native
#: library defines them (csrc/rules.h, exported by torch_kvcm2._C)
HISTORY, CAPACITY, LEASE, WRITTEN, DECLARED, ALLOCATED = (
    _C.HISTORY, _C.CAPACITY, _C.LEASE, _C.WRITTEN, _C.DECLARED, _C.ALLOCATED)
LENGTH_ROWS = _C.LENGTH_ROWS
#: pinned staging buffers of the publish ring counted in the reserve (more are made on demand
#: only when the GPU lags this many publishes behind)
STAGING_BUFFERS = 2
#: pinned read-back buffers of the device lengths (Batch.record_advance), used round robin
READBACKS = 4
#: bytes per staged delta entry: an int64 flat index and an int32 value
DELTA_ENTRY_BYTES = 12
ADVANCE_COUNTERS = 2  # advance's refused rows, rows stopped at their reserve


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a batch: ``medium`` "gpu" (the config's device) or "host" (pinned on CUDA)."""

    name: str
    shape: tuple
    dtype: torch.dtype
    medium: str = "gpu"
    align: int = 1  # the memory taken is rounded up to a multiple of this (whole pages)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        n *= torch.empty((), dtype=self.dtype).element_size()
        return -(-n // self.align) * self.align


def miss_list_rows(group: SelectionGroup, max_rows: int) -> int:
    """Miss-list entries one resolve may write: per row, every distinct unit of its union of
    T query tokens' selections (T·K) and every admission (ceil(I/U) + 1)."""
    return max_rows * (group.sparse.max_selected_columns + group.sparse.max_inflight_units)


def resolve_scratch_bytes(columns: int) -> int:
    """Bytes per row of the CUDA resolve's global table region for rows of ``columns`` selected
    columns (T·K) too wide for shared memory: a hash of 2^ceil(log2(2·columns)) entries of three
    int32 arrays, each 16-byte aligned (cuda/resolve.cuh ResolveLayout, global_table)."""
    entries = 1 << max(1, (2 * columns - 1).bit_length())
    return 3 * (-(-4 * entries // 16) * 16)


def resolve_scratch_rows_bytes(config: CacheConfig, group: SelectionGroup, max_rows: int) -> int:
    """The resolve scratch a batch allocates for a group: on CUDA, for groups of more than one
    query token (their T·K columns may exceed the shared layout, docs/MTP.md); else none."""
    if config.device.type != "cuda" or group.sparse.max_query_tokens == 1:
        return 0
    return max_rows * resolve_scratch_bytes(group.sparse.max_selected_columns)


def sparse_buffers(config: CacheConfig, layer: str):
    """The non-zero sparse buffers of a layer: the ones with cells and copies (CFG-6)."""
    return [b for b in config.layer(layer).sparse_buffers if b.bytes_per_token > 0]


def table_entries(config: CacheConfig, num_pool_groups: int, max_rows: int,
                  gpu_slots: int = 0) -> int:
    """Entries of a batch's flat int32 table store: every page table, then the length rows,
    then, for a batch holding GPU history pages (RSD-1), the rows' GPU page table, their flags
    and the lease resolve reads (BAD for the rows on GPU pages)."""
    entries = num_pool_groups * max_rows * config.max_pages_per_row + LENGTH_ROWS * max_rows
    if gpu_slots:
        entries += max_rows * config.max_pages_per_row + 2 * max_rows
    return entries


def counter_words(config: CacheConfig) -> int:
    """int64 device counters of a batch as the read-back gathers them: per selection group its
    ``ops.NUM_COUNTERS`` (hits, misses, invalid), then ``advance``'s ``ADVANCE_COUNTERS``."""
    return ops.NUM_COUNTERS * len(config.selection_groups) + ADVANCE_COUNTERS


def staging_bytes(config: CacheConfig, num_pool_groups: int, max_rows: int,
                  gpu_slots: int = 0) -> int:
    """Bytes of one publish staging buffer: the largest delta (every table entry) plus one int64
    per lease whose residency a publish clears."""
    return (table_entries(config, num_pool_groups, max_rows, gpu_slots) * DELTA_ENTRY_BYTES
            + max_rows * 8)


def batch_tensor_specs(config: CacheConfig, num_pool_groups: int, max_rows: int,
                       gpu_slots: int = 0) -> list:
    """Every tensor a batch of ``max_rows`` rows allocates (REQUIREMENTS §6-7), with
    ``gpu_slots`` GPU history pages (RSD-1: the batch that holds them)."""
    specs = [
        TensorSpec("tables", (table_entries(config, num_pool_groups, max_rows, gpu_slots),),
                   INT32),
        TensorSpec("delta", (staging_bytes(config, num_pool_groups, max_rows, gpu_slots),), UINT8),
        # advance's refused and short rows; each group's counters are a tensor of their own
        # too, never views of one tensor: torch 2.11's AOTAutograd gives mutated inputs that
        # share a storage a synthetic base, and cudagraph trees then skip the graph
        TensorSpec("advance_counters", (ADVANCE_COUNTERS,), INT64),
        # where the read-back gathers every counter (one device copy) before its one D2H copy
        TensorSpec("counter_stage", (counter_words(config),), INT64),
        TensorSpec("step_targets", (max_rows,), INT32),  # Batch.finish_step's flush targets
    ]
    specs += [TensorSpec(f"staging{i}", (staging_bytes(config, num_pool_groups, max_rows,
                                                       gpu_slots),),
                         UINT8, "host") for i in range(STAGING_BUFFERS)]
    # on CUDA the read-back ring is whole pages of its own, registered (readback.py)
    page = mmap.PAGESIZE if config.device.type == "cuda" else 1
    specs.append(TensorSpec("snapshot", (READBACKS, LENGTH_ROWS, max_rows), INT32, "host", page))
    # the counters' read-back ring, filled by the same read-back call (readback.py)
    specs.append(TensorSpec("counter_snapshot", (READBACKS, counter_words(config)), INT64, "host",
                            page))
    for group in config.selection_groups:
        sp, g = group.sparse, group.index
        specs += [
            TensorSpec(f"resident{g}", (max_rows, sp.slots), INT32),
            TensorSpec(f"recency{g}", (max_rows, sp.slots), INT32),
            # for T query tokens: Batch.resolve returns a [max_rows, T', K] view of its prefix
            TensorSpec(f"index_table{g}", (max_rows, sp.max_selected_columns), INT32),
            TensorSpec(f"miss_list{g}", (miss_list_rows(group, max_rows), ops.MISS_FIELDS), INT32),
            TensorSpec(f"miss_count{g}", (ops.MISS_COUNT_WORDS,), INT32),
            TensorSpec(f"counters{g}", (ops.NUM_COUNTERS,), INT64),
            TensorSpec(f"inflight_slots{g}", (max_rows, sp.max_inflight_units), INT32),
            TensorSpec(f"write_table{g}", (max_rows, sp.max_inflight_tokens + sp.tokens_per_unit - 1),
                       INT32),
            TensorSpec(f"inflight_start{g}", (max_rows,), INT32),
        ]
        scratch = resolve_scratch_rows_bytes(config, group, max_rows)
        if scratch:
            specs.append(TensorSpec(f"resolve_scratch{g}", (scratch,), UINT8))
        for layer in group.layers:
            for buf in sparse_buffers(config, layer):
                # the cells, then the GPU history pages (RSD-1): one index space
                cells = max_rows * sp.slots // group.units_per_page + gpu_slots
                specs.append(TensorSpec(
                    f"cells:{layer}:{buf.role}",
                    (cells, buf.chunks, config.tokens_per_page, buf.bytes_per_token // buf.chunks),
                    UINT8))
    return specs


def batch_memory_bytes(config: CacheConfig, num_pool_groups: int, max_rows: int,
                       gpu_slots: int = 0) -> dict:
    """GPU and host bytes of a batch: the sum of ``batch_tensor_specs``."""
    memory = {"gpu": 0, "host": 0}
    for spec in batch_tensor_specs(config, num_pool_groups, max_rows, gpu_slots):
        memory[spec.medium] += spec.nbytes
    return memory


def pool_group_count(config: CacheConfig) -> int:
    """How many pool groups ``Storage`` makes of ``config``: one per distinct (window, sinks,
    sparse, page bytes) of its non-zero buffers (STO-1, TIER-3; ``test_storage.py`` checks it
    against Storage)."""
    return len({(layer.window, layer.sinks, buf.sparse, buf.bytes_per_token)
                for layer in config.layers for buf in layer.buffers if buf.bytes_per_token})


def batch_reserve_bytes(config: CacheConfig, num_pool_groups: int = None) -> dict:
    """The GPU and host bytes ``KVCacheManager(config)`` sets aside for its batches before the
    pools get the rest of the budgets (STO-4): the memory of ``config.max_rows`` one-row
    batches, which covers any split of ``max_rows`` rows over batches (a batch's memory is
    linear in its rows plus a few bytes per selection group), plus once what the GPU history
    pages add to the batch that holds them (``gpu_history_bytes``). A budget must exceed its medium's
    reserve by the pages the run needs. From the config alone (``num_pool_groups`` defaults to
    ``pool_group_count``): nothing is allocated."""
    if num_pool_groups is None:
        num_pool_groups = pool_group_count(config)
    one_row = batch_memory_bytes(config, num_pool_groups, 1)
    reserve = {medium: config.max_rows * n for medium, n in one_row.items()}
    slots = config.gpu_history_slots
    if slots:  # RSD-1: once, for the one batch that holds the GPU history pages
        rows = config.max_rows
        held = batch_memory_bytes(config, num_pool_groups, rows, slots)
        plain = batch_memory_bytes(config, num_pool_groups, rows)
        for medium in reserve:
            reserve[medium] += held[medium] - plain[medium]
    return reserve


class BatchReserve:
    """The memory a manager sets aside for its batches (STO-4): batches ``take`` their memory
    at construction and ``give_back`` it on close."""

    def __init__(self, reserve: dict):
        self.reserve = dict(reserve)
        self.in_use = {medium: 0 for medium in reserve}
        self.history_free = True  # no open batch holds the GPU history pages (RSD-1)
        # batches that gave their memory back and are not yet collected: a batch and its parts
        # refer to each other, so its tensors are freed by Python's cycle collector, not when
        # the last reference goes
        self.returned = weakref.WeakSet()

    def collect(self) -> None:
        """Frees the tensors of the batches that gave their memory back and nobody holds, before
        a new batch allocates the same memory again (else both exist until the cycle collector
        runs: most likely what ran an H100 out of memory when a 61-layer P-SERVE level built its
        batch, with 12 GB of GPU history pages, right after the previous level closed its own;
        docs/DESIGN.md, "batch reserve")."""
        if self.returned:
            gc.collect()
            # the ones still alive are held by the caller: collecting again would not free them
            # (their tensors go when the caller drops them), so they no longer trigger it
            self.returned = weakref.WeakSet()

    def take(self, memory: dict) -> None:
        """Charge ``memory``; raises RuntimeError, charging nothing, when it does not fit."""
        for medium, nbytes in memory.items():
            if self.in_use[medium] + nbytes > self.reserve[medium]:
                raise RuntimeError(
                    f"Batch: {nbytes} {medium} bytes needed but only "
                    f"{self.reserve[medium] - self.in_use[medium]} left of the batch reserve; "
                    f"close another batch first")
        for medium, nbytes in memory.items():
            self.in_use[medium] += nbytes

    def give_back(self, memory: dict) -> None:
        for medium, nbytes in memory.items():
            self.in_use[medium] -= nbytes
