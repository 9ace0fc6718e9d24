"""INT-2: the fake (meta) kernels check the metadata the native checks check (csrc/checks.cpp).

For a table of bad-metadata cases per op, built from one realistic argument set
(``stepping.op_samples``), the eager CPU op raises RuntimeError and so does the op on fake tensors
(FakeTensorMode: what torch.compile traces with), both with a message naming the same thing.
Device mismatches run on the fake with one tensor on ``meta`` (and natively only where a second
device, CUDA, exists).
"""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only

import torch_kvcm2 as kv
from conftest import HAS_CUDA
from stepping import op_samples

I32, I64 = torch.int32, torch.int64


def put(args, index, value):
    """``args`` with ``args[index]`` replaced; ``index`` may be a pair (list argument, item)."""
    args = list(args)
    if isinstance(index, tuple):
        outer, inner = index
        items = list(args[outer])
        items[inner] = value(items[inner]) if callable(value) else value
        args[outer] = items
    else:
        args[index] = value(args[index]) if callable(value) else value
    return tuple(args)


def as64(t):
    return t.to(I64)


def narrower(t):
    return t[..., :-1].contiguous()


def transposed(t):
    """Same dtype and element count, not contiguous."""
    return t.new_zeros(t.shape[::-1]).t() if t.dim() == 2 else t.transpose(-1, -2)


def fewer_rows(t):
    return t[:-1].contiguous()


# (op, case id, argument index, replacement (value or function of the good value), message)
CASES = [
    ("convert_page_indices", "out_dtype", 0, as64, "out must be int32"),
    ("convert_page_indices", "out_rank", 0, lambda t: t[None], "out must be 2-D"),
    ("convert_page_indices", "out_layout", 0, transposed, "out must be contiguous"),
    ("convert_page_indices", "capacity_length", 2, fewer_rows, r"capacity must have shape \[4\]"),
    ("convert_page_indices", "pos", 4, 2, "need 0 <= pos < scale"),
    ("convert_page_indices", "scale", 3, 0, "need 0 <= pos < scale"),
    ("convert_page_indices", "units_per_page", 5, 0, "units_per_page and tokens_per_unit must be"),
    ("convert_page_indices", "tokens_per_unit", 6, -1, "units_per_page and tokens_per_unit must"),
    ("convert_page_indices", "out_rows", 0, fewer_rows, "out has 3 rows but page_table has 4"),
    ("convert_page_indices", "out_width", 0, lambda t: t[:, :1].contiguous(), "out is too narrow"),
    ("convert_token_indices", "selected_dtype", 1, as64, "selected must be int32"),
    ("convert_token_indices", "page_table_rank", 2, lambda t: t[0].contiguous(),
     "page_table must be 2-D"),
    ("convert_token_indices", "tokens_per_page", 6, 0, "tokens_per_page must be positive"),
    ("convert_token_indices", "pos", 5, -1, "need 0 <= pos < scale"),
    ("convert_token_indices", "out_shape", 0, narrower, "out has shape .* but selected has"),
    ("convert_token_indices", "capacity_dtype", 3, as64, "capacity must be int32"),
    ("resolve", "resident_dtype", 0, as64, "resident must be int32"),
    ("resolve", "recency_shape", 1, narrower, "recency has shape .* but resident has"),
    ("resolve", "selected_rank", 7, lambda t: t[None, None], "selected must be 2-D .* or 3-D"),
    ("resolve", "selected_layout", 7, transposed, "selected must be contiguous"),
    ("resolve", "index_table_shape", 2, narrower, "index_table has shape .* but selected has"),
    ("resolve", "miss_list_dtype", 3, as64, "miss_list must be int32"),
    ("resolve", "miss_list_rows", 3, lambda t: t[:2].contiguous(), "miss_list must have shape"),
    ("resolve", "miss_count_shape", 4, lambda t: t[:3], r"miss_count must have shape \[4\]"),
    ("resolve", "counters_dtype", 5, lambda t: t.to(I32), "counters must be a contiguous int64"),
    ("resolve", "inflight_slots_shape", 6, narrower, "inflight_slots must have shape"),
    ("resolve", "history_length", 8, fewer_rows, "history must have shape"),
    ("resolve", "lease_dtype", 10, as64, "lease must be int32"),
    ("resolve", "tokens_per_unit", 11, 0, "tokens_per_unit and max_inflight_tokens must be"),
    ("resolve", "tokens_per_page", 12, 0, "tokens_per_unit must be positive and divide"),
    ("resolve", "max_inflight_tokens", 13, 0, "tokens_per_unit and max_inflight_tokens must be"),
    ("resolve", "window", 14, -1, "window non-negative"),
    ("resolve", "sinks_without_window", 18, 4, "sinks must be non-negative, and 0 without a"),
    ("resolve", "sinks_negative", 18, -1, "sinks must be non-negative"),
    ("resolve", "slots_per_page", 12, 5, r"slots \(12\) must be a positive multiple"),
    ("resolve_step", "write_table_width", 7, lambda t: t[:, :1].contiguous(),
     "write_table is too narrow"),
    ("resolve_step", "write_table_rows", 7, lambda t: t[:1], "write_table must have one row per"),
    ("resolve_step", "write_start_length", 8, fewer_rows, "write_start must have shape"),
    ("resolve_step", "counters_shape", 5, lambda t: t[:2], "counters must be a contiguous int64"),
    ("resolve_step", "position", (15, 0), 99, "position 99 outside"),
    ("resolve_step", "no_cells", 9, [], "no cells, so no host pools"),
    ("resolve_step", "sinks_without_window", 22, 1, "sinks must be non-negative, and 0 without"),
    ("resolve_groups", "lists", 1, lambda p: p[:-1], "every per-group list must have one entry"),
    ("resolve_groups", "group_params", 18, lambda p: p[:-1], "group_params must have 6 entries"),
    ("resolve_groups", "scratch_index", 18, lambda p: [*p[:4], 0, *p[5:]],
     r"scratch index 0 outside \[-1, 0\)"),
    ("resolve_groups", "buffers", 18, lambda p: [*p[:5], 99, *p[6:]],
     "99 buffers from buffer 0 exceed"),
    ("resolve_groups", "unfetched", 18, lambda p: [*p[:-1], p[-1] - 1], "the groups fetch 2"),
    ("resolve_groups", "buffer_params", 19, lambda p: p[:-1], "buffer_params must have 3 entries"),
    ("resolve_groups", "pool_index", 19, lambda p: [5, *p[1:]], "buffer 0: host pool 5 or page"),
    ("resolve_groups", "resident_dtype", (0, 1), as64, "resident must be int32"),
    ("resolve_groups", "selected_layout", (11, 0), transposed, "selected must be contiguous"),
    ("resolve_groups", "write_start_length", (8, 1), fewer_rows, "write_start must have shape"),
    ("resolve_groups", "position", 19, lambda p: [*p[:7], 99, *p[8:]], "position 99 outside"),
    ("resolve_groups", "page_table_dtype", (16, 0), as64, r"page_tables\[b\] must be int32"),
    ("fetch", "buffers", 2, lambda p: p[:-1], "must have one entry per buffer"),
    ("fetch", "miss_list_columns", 4, lambda t: t[:, :3].contiguous(),
     "miss_list must have 4 columns"),
    ("fetch", "miss_count_dtype", 5, as64, "miss_count must be int32"),
    ("fetch", "slots", 6, 0, "slots and tokens_per_unit must be positive"),
    ("fetch", "slots_per_page", 6, 13, "slots must be a multiple of units per page"),
    ("fetch", "tokens_per_unit", 7, 3, "tokens_per_unit must divide tokens_per_page"),
    ("fetch", "cells_dtype", (0, 0), lambda t: t.view(I32), "cells and host pools must be uint8"),
    ("fetch", "cells_rank", (0, 0), lambda t: t.flatten(0, 1), "cells must be 4-D"),
    ("fetch", "cells_layout", (0, 0), transposed, "cells must be contiguous"),
    ("fetch", "host_pool_rank", (1, 0), lambda t: t.flatten(1, 2), "host pool must be 3-D"),
    ("fetch", "host_pool_page", (1, 0), lambda t: t[:, :, :-1], "differ from host pool"),
    ("fetch", "position", (2, 0), -1, "position -1 outside"),
    ("fetch", "page_table_dtype", (3, 0), as64, r"page_tables\[b\] must be int32"),
    ("locate_inflight", "inflight_slots_dtype", 0, as64, "inflight_slots must be int32"),
    ("locate_inflight", "resident_rank", 1, lambda t: t[0], "resident must be 2-D"),
    ("locate_inflight", "capacity_length", 3, fewer_rows, "capacity must have shape"),
    ("locate_inflight", "inflight_slots_shape", 0, narrower, "inflight_slots must have shape"),
    ("locate_inflight", "max_inflight_tokens", 6, 0, "max_inflight_tokens must be positive"),
    ("write_indices", "out_width", 0, lambda t: t[:, :1].contiguous(), "out is too narrow"),
    ("write_indices", "out_dtype", 0, as64, "out must be int32"),
    ("write_indices", "inflight_start_length", 1, fewer_rows, "inflight_start must have shape"),
    ("write_indices", "resident_dtype", 2, as64, "resident must be int32"),
    ("write_indices", "inflight_slots_shape", 3, narrower, "inflight_slots must have shape"),
    ("write_indices", "tokens_per_unit", 7, 0, "tokens_per_unit and max_inflight_tokens must be"),
    ("resolve_gpu_history", "index_shape", 0, narrower, "index_table has shape"),
    ("resolve_gpu_history", "write_width", 1, lambda t: t[:, :1].contiguous(),
     "write_table is too narrow"),
    ("resolve_gpu_history", "write_start_length", 2, fewer_rows, "write_start must have shape"),
    ("resolve_gpu_history", "counters_dtype", 3, lambda t: t.to(I32), "counters must be a"),
    ("resolve_gpu_history", "gpu_rows_dtype", 5, as64, "gpu_rows must be int32"),
    ("resolve_gpu_history", "gpu_pages_rows", 6, fewer_rows, "gpu_pages need one row per"),
    ("resolve_gpu_history", "lease_length", 9, fewer_rows, "lease must have shape"),
    ("resolve_gpu_history", "cell_entries", 10, -1, "cell_entries and gpu_slots must be"),
    ("resolve_gpu_history", "entries", 11, 2**30, "exceed the int32 token indices"),
    ("resolve_gpu_history", "unit", 12, 3, "tokens_per_unit must be positive and divide"),
    ("resolve_gpu_history", "sinks", 16, 4, "sinks must be non-negative, and 0 without"),
    ("flush_gpu_history", "gpu_rows_length", 3, fewer_rows, "gpu_rows must have shape"),
    ("flush_gpu_history", "gpu_pages_dtype", 4, as64, "gpu_pages must be int32"),
    ("flush_gpu_history", "gpu_pages_rows", 4, fewer_rows, "gpu_pages needs one row per"),
    ("flush_gpu_history", "new_history_length", 6, fewer_rows, "new_history must have shape"),
    ("flush_gpu_history", "unit_params_length", 10, lambda p: p[:-1], "three ints per buffer"),
    ("flush_gpu_history", "cell_pages", 10, lambda p: [10**6, *p[1:]], "bad unit_params"),
    ("flush_gpu_history", "unit", 10, lambda p: [p[0], 0, *p[2:]], "bad unit_params"),
    ("flush_gpu_history", "position", 1, lambda p: [99, *p[1:]], "position 99 outside"),
    ("flush", "page_table_dtype", 5, as64, "page_table must be int32"),
    ("flush", "new_history_length", 6, fewer_rows, "new_history must have shape"),
    ("flush", "lease_length", 9, fewer_rows, "lease must have shape"),
    ("flush", "unit_params_length", 10, lambda p: p[:-1], "unit_params three ints per buffer"),
    ("flush", "unit_params_slots", 10, lambda p: [p[0] + 1, *p[1:]], "bad unit_params"),
    ("flush", "unit_params_unit", 10, lambda p: [p[0], 0, *p[2:]], "bad unit_params"),
    ("flush", "position", (1, 0), 99, "position 99 outside"),
    ("flush", "cells_layout", (2, 0), transposed, "cells must be contiguous"),
    ("flush", "cells_count", (2, 0), lambda t: t[:1], "fewer cells than leases x slots"),
    ("flush", "resident_dtype", (3, 0), as64, r"resident\[b\] must be int32"),
    ("flush", "inflight_slots_shape", (4, 0), narrower, "inflight_slots must have shape"),
    ("flush", "host_pool_dtype", 0, lambda t: t.view(I32), "cells and host pools must be uint8"),
    ("flush_watermark", "written_rank", 0, lambda t: t[None], r"written must be int32\[rows\]"),
    ("flush_watermark", "written_dtype", 0, as64, "written must be int32"),
    ("flush_watermark", "declared_length", 1, fewer_rows, "declared must have shape"),
    ("flush_watermark", "new_history_dtype", 2, as64, "new_history must be int32"),
    ("flush_watermark", "history_length", 3, fewer_rows, "history must have shape"),
    ("flush_watermark", "shapes_odd", 6, lambda s: s[:-1], "shapes must be .* pairs"),
    ("flush_watermark", "shapes_many", 6, [1, 1] * 17, "shapes must be .* pairs, at most 16"),
    ("flush_watermark", "shape_unit", 6, lambda s: [0, *s[1:]], "shape 0 needs tokens_per_unit"),
    ("flush_watermark", "shape_inflight", 6, lambda s: [s[0], -1, *s[2:]],
     "shape 0 needs tokens_per_unit"),
    ("advance", "lengths_rows", 0, fewer_rows, r"lengths must be contiguous int32\[6, rows\]"),
    ("advance", "lengths_dtype", 0, as64, r"lengths must be contiguous int32\[6, rows\]"),
    ("advance", "lengths_layout", 0, transposed, r"lengths must be contiguous int32\[6, rows\]"),
    ("advance", "accepted_length", 2, fewer_rows, "accepted must have shape"),
    ("advance", "accepted_dtype", 2, as64, "accepted must be int32"),
    ("advance", "counters_shape", 1, lambda t: t[:1], r"counters must be contiguous int64\[2\]"),
    ("clear_leases", "groups", 1, lambda r: r[:-1], "resident and recency need one tensor per"),
    ("clear_leases", "leases_dtype", 2, lambda t: t.to(I32), r"leases must be contiguous int64"),
    ("clear_leases", "leases_rank", 2, lambda t: t[None], r"leases must be contiguous int64"),
    ("clear_leases", "resident_dtype", (0, 0), as64, r"resident\[g\] must be int32"),
    ("clear_leases", "recency_layout", (1, 0), transposed, r"recency\[g\] must be contiguous"),
    ("clear_leases", "recency_shape", (1, 0), narrower, "resident and recency differ in shape"),
    ("rank_signal", "header_length", 0, lambda t: t[:256], "header must be a contiguous int64"),
    ("rank_signal", "header_dtype", 0, lambda t: t.to(I32), "header must be a contiguous int64"),
    ("rank_signal", "gen_dtype", 1, lambda t: t.to(I32), r"gen must be an int64\[1\]"),
    ("rank_signal", "world", 4, 65, "world must be in"),
    ("rank_signal", "rank", 3, 1, "rank must be in"),
    ("rank_wait", "header_rank", 0, lambda t: t.view(2, 256), "header must be a contiguous int64"),
    ("rank_wait", "gen_length", 2, lambda t: t.new_zeros(2), r"gen must be an int64\[1\]"),
    ("rank_wait", "world", 4, 0, "world must be in"),
    ("rank_wait", "rank", 3, -1, "rank must be in"),
    ("rank_wait", "timeout", 5, 0, "timeout_us must be positive"),
]

# (op, case id, index of the tensor moved to another device, message)
DEVICE_CASES = [
    ("convert_page_indices", "capacity", 2, "capacity is on"),
    ("convert_token_indices", "selected", 1, "selected is on"),
    ("resolve", "lease", 10, "history, capacity and lease is on"),
    ("resolve", "counters", 5, "every tensor is on"),
    ("resolve_step", "write_start", 8, "every tensor is on"),
    ("resolve_groups", "selected", (11, 1), "every tensor is on"),
    ("fetch", "miss_count", 5, "miss_count is on"),
    ("fetch", "page_table", (3, 0), "page_tables is on"),
    ("locate_inflight", "resident", 1, "resident is on"),
    ("write_indices", "inflight_start", 1, "every tensor is on"),
    ("resolve_gpu_history", "gpu_pages", 6, "every tensor is on"),
    ("flush_gpu_history", "gpu_rows", 3, "every tensor is on"),
    ("flush", "host_pool", 0, "host_pool is on"),
    ("flush", "inflight_slots", (4, 0), "inflight_slots is on"),
    ("flush_watermark", "declared", 1, "declared is on"),
    ("advance", "counters", 1, "counters is on"),
    ("clear_leases", "recency", (1, 0), "recency is on"),
    ("rank_wait", "gen", 2, "must be on one device"),
]


@pytest.fixture(scope="module")
def samples():
    return op_samples("cpu")


def call(name, args):
    getattr(torch.ops.torch_kvcm2, name)(*args)


def call_fake(name, args):
    """The op on fake copies of ``args``: its fake kernel runs (as when torch.compile traces)."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_args = tree_map_only(torch.Tensor, mode.from_tensor, args)
    with mode:
        call(name, fake_args)


def test_the_samples_pass_both():
    """The good argument sets pass the native checks and the fakes (no case fails by accident)."""
    for name, args in op_samples("cpu").items():
        call_fake(name, args)
        call(name, args)


def test_every_op_with_a_fake_has_cases():
    assert {c[0] for c in CASES} == set(op_samples("cpu"))


@pytest.mark.parametrize("name, case, index, value, message", CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_native_and_fake_refuse_the_same_metadata(samples, name, case, index, value, message):
    args = put(samples[name], index, value)
    with pytest.raises(RuntimeError, match=message):
        call(name, args)
    with pytest.raises(RuntimeError, match=message):
        call_fake(name, args)


@pytest.mark.parametrize("name, case, index, message", DEVICE_CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in DEVICE_CASES])
def test_native_and_fake_refuse_mixed_devices(samples, name, case, index, message):
    with pytest.raises(RuntimeError, match=message):
        call_fake(name, put(samples[name], index, lambda t: t.to("meta")))
    if HAS_CUDA:  # natively: a second device; the ops dispatch on the first CUDA tensor
        with pytest.raises(RuntimeError, match=message):
            call(name, put(samples[name], index, lambda t: t.to("cuda")))


def test_a_compiled_call_reports_the_native_message(samples):
    """Through torch.compile(fullgraph=True) the fake's refusal surfaces at trace time, with the
    native check's words."""
    out, page_table, capacity, *rest = samples["convert_page_indices"]
    narrow = out[:, :1].contiguous()

    def body(o):
        kv.ops.convert_page_indices(o, page_table, capacity, *rest)

    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="convert_page_indices: out is too narrow"):
        torch.compile(body, fullgraph=True, backend="eager")(narrow)
