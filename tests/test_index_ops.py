"""OP-INDEX: both index-conversion ops against the plain-Python reference (tests/reference.py).

Covers the page form (``convert_page_indices``) and the token form (``convert_token_indices``):
random tables with BAD slots, capacities from 0 past the table, wider ``out``, scale/pos, E > 1,
overflow to BAD, an ``out`` too narrow, bad host-side arguments (SAFE-3), ``opcheck`` (INT-1) and
``torch.compile(fullgraph=True)`` equal to eager (INT-2).
"""
from __future__ import annotations

import random

import pytest
import torch

import torch_kvcm2  # noqa: F401  (registers the ops)
from torch_kvcm2 import ops

import reference as ref
from conftest import DEVICE_PARAMS

BAD = ref.BAD
I32 = torch.int32


def t32(data, device):
    return torch.tensor(data, dtype=I32, device=device)


def random_page_table(rng, rows, pages, max_slot=50):
    return [[BAD if rng.random() < 0.25 else rng.randrange(max_slot) for _ in range(pages)]
            for _ in range(rows)]


def random_capacities(rng, rows, max_tokens):
    # 0, exact page/unit boundaries, values in between, and beyond the table
    picks = [0, max_tokens, max_tokens + 7, 1]
    return [rng.choice(picks) if rng.random() < 0.3 else rng.randrange(0, max_tokens + 2)
            for _ in range(rows)]


def run_page_op(device, table, capacity, scale, pos, E, U, width, fill=12345):
    rows = len(table)
    pages = len(table[0]) if rows else 0
    pt = torch.tensor(table, dtype=I32, device=device).reshape(rows, pages)
    out = torch.full((rows, width), fill, dtype=I32, device=device)
    ops.convert_page_indices(out, pt, t32(capacity, device), scale, pos, E, U)
    return out.cpu().tolist()


def run_token_op(device, selected, table, capacity, scale, pos, P):
    rows = len(table)
    pages = len(table[0]) if rows else 0
    pt = torch.tensor(table, dtype=I32, device=device).reshape(rows, pages)
    sel = torch.tensor(selected, dtype=I32, device=device).reshape(len(selected), -1)
    out = torch.full(sel.shape, 12345, dtype=I32, device=device)
    ops.convert_token_indices(out, sel, pt, t32(capacity, device), scale, pos, P)
    return out.cpu().tolist()


# ----------------------------------------------------------------------------------------------
# page form
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_index_page_form_random_matches_reference(device):
    """OP-INDEX page form: (slot*scale + pos)*E + j%E below capacity, BAD for BAD slots, past
    capacity and past the table, on random tables (E >= 1, scale/pos, wider out)."""
    rng = random.Random(1)
    checked = 0
    for trial in range(400):
        rows = rng.randrange(0, 6)
        pages = rng.randrange(0, 10)  # 4 and 8 with E = 1: the CUDA kernel's int4 page loads
        E = rng.choice([1, 2, 3, 4, 5])  # 3, 5: a thread's 4 columns cross pages anywhere
        U = rng.choice([1, 2, 16])
        scale = rng.choice([1, 2, 3])
        pos = rng.randrange(scale)
        width = pages * E + rng.choice([0, 0, 1, 5])
        table = random_page_table(rng, rows, pages)
        capacity = random_capacities(rng, rows, pages * E * U)
        got = run_page_op(device, table, capacity, scale, pos, E, U, width)
        want = ref.convert_page_indices(table, capacity, scale, pos, E, U, width)
        assert got == want, (trial, table, capacity, scale, pos, E, U, width)
        checked += sum(v != BAD for row in want for v in row)
    assert checked > 500  # the trials produced real (non-BAD) indices, not only BAD


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_index_page_form_exact_values(device):
    """OP-INDEX page form on a hand-computed table: E=2, U=4, scale=3, pos=1, capacity cutting a
    page in half, a BAD slot, and extra columns beyond the table."""
    table = [[5, BAD, 7], [0, 1, 2]]
    capacity = [20, 0]  # row 0: units 0..4 are below capacity (j*4 < 20)
    got = run_page_op(device, table, capacity, scale=3, pos=1, E=2, U=4, width=8)
    # slot 5 -> (5*3+1)*2 = 32, 33; BAD page -> BAD, BAD; slot 7 -> 44 only for unit 4
    assert got == [[32, 33, BAD, BAD, 44, BAD, BAD, BAD], [BAD] * 8]
    assert got == ref.convert_page_indices(table, capacity, 3, 1, 2, 4, 8)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_index_page_form_overflow_is_bad(device):
    """OP-INDEX / DESIGN: results above INT32_MAX are BAD, never wrapped; other negative slot
    ids are treated as no page (SAFE-3: bad device data yields BAD)."""
    big = 2**31 - 2
    table = [[big, big // 4, 2**29, -7]]
    got = run_page_op(device, table, [10**9], scale=2, pos=1, E=4, U=1, width=16)
    want = ref.convert_page_indices(table, [10**9], 2, 1, 4, 1, 16)
    assert got == want
    assert got[0][:4] == [BAD] * 4  # (big*2+1)*4 overflows
    assert all(v == BAD for v in got[0][12:])  # negative slot id -7
    assert all(0 <= v <= 2**31 - 1 for v in got[0] if v != BAD)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_index_page_form_negative_capacity_is_bad(device):
    """OP-INDEX / SAFE-3: a bad (negative) capacity yields an all-BAD row, never a crash."""
    table = [[1, 2], [3, 4]]
    got = run_page_op(device, table, [-5, 2**31 - 1], scale=1, pos=0, E=2, U=8, width=4)
    assert got == [[BAD] * 4, [6, 7, 8, 9]]
    assert got == ref.convert_page_indices(table, [-5, 2**31 - 1], 1, 0, 2, 8, 4)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_index_page_form_out_too_narrow_raises(device):
    """OP-INDEX: an `out` narrower than max_pages*E is refused (and left untouched)."""
    pt = t32([[1, 2, 3]], device)
    cap = t32([100], device)
    out = torch.full((1, 5), 77, dtype=I32, device=device)
    with pytest.raises(RuntimeError, match="too narrow"):
        ops.convert_page_indices(out, pt, cap, 1, 0, 2, 1)
    assert out.cpu().tolist() == [[77] * 5]
    out = torch.full((1, 6), 77, dtype=I32, device=device)  # exactly wide enough works
    ops.convert_page_indices(out, pt, cap, 1, 0, 2, 1)
    assert out.cpu().tolist() == [[2, 3, 4, 5, 6, 7]]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_index_page_form_bad_arguments_raise(device):
    """SAFE-3: wrong dtype, shape, layout and integer arguments raise before writing."""
    pt = t32([[1, 2], [3, 4]], device)
    cap = t32([8, 8], device)

    def fresh():
        return torch.full((2, 4), 77, dtype=I32, device=device)

    bad_calls = [
        lambda o: ops.convert_page_indices(o.long(), pt, cap, 1, 0, 2, 1),
        lambda o: ops.convert_page_indices(o, pt.long(), cap, 1, 0, 2, 1),
        lambda o: ops.convert_page_indices(o, pt, cap.long(), 1, 0, 2, 1),
        lambda o: ops.convert_page_indices(o, pt.reshape(-1), cap, 1, 0, 2, 1),
        lambda o: ops.convert_page_indices(o, pt, cap[:1], 1, 0, 2, 1),
        lambda o: ops.convert_page_indices(o, pt, cap.reshape(2, 1), 1, 0, 2, 1),
        lambda o: ops.convert_page_indices(o[:1], pt, cap, 1, 0, 2, 1),
        lambda o: ops.convert_page_indices(o, pt.t(), cap, 1, 0, 2, 1),  # non-contiguous
        lambda o: ops.convert_page_indices(o, pt, cap, 0, 0, 2, 1),  # scale 0
        lambda o: ops.convert_page_indices(o, pt, cap, 2, 2, 2, 1),  # pos >= scale
        lambda o: ops.convert_page_indices(o, pt, cap, 1, -1, 2, 1),  # pos < 0
        lambda o: ops.convert_page_indices(o, pt, cap, 1, 0, 0, 1),  # E = 0
        lambda o: ops.convert_page_indices(o, pt, cap, 1, 0, 2, 0),  # U = 0
    ]
    for i, call in enumerate(bad_calls):
        out = fresh()
        with pytest.raises((RuntimeError, ValueError)):
            call(out)
        assert out.cpu().tolist() == [[77] * 4] * 2, i


@pytest.mark.cuda
def test_op_index_mixed_devices_raise():
    """SAFE-3: tensors on different devices raise (both index ops)."""
    pt = t32([[1, 2]], "cuda")
    cap = t32([8], "cuda")
    out = torch.full((1, 4), 77, dtype=I32, device="cuda")
    with pytest.raises(RuntimeError):
        ops.convert_page_indices(out, pt.cpu(), cap, 1, 0, 2, 1)
    with pytest.raises(RuntimeError):
        ops.convert_page_indices(out, pt, cap.cpu(), 1, 0, 2, 1)
    sel = t32([[0, 1, 2, 3]], "cuda")
    with pytest.raises(RuntimeError):
        ops.convert_token_indices(out, sel.cpu(), pt, cap, 1, 0, 4)
    with pytest.raises(RuntimeError):
        ops.convert_token_indices(out.cpu(), sel, pt, cap, 1, 0, 4)
    assert out.cpu().tolist() == [[77] * 4]


# ----------------------------------------------------------------------------------------------
# token form
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_index_token_form_random_matches_reference(device):
    """OP-INDEX token form: (page_table[t//P]*scale + pos)*P + t%P, BAD for t < 0,
    t >= capacity, a page beyond the table or a BAD slot, on random tables and selections."""
    rng = random.Random(2)
    checked = 0
    for trial in range(400):
        rows = rng.randrange(1, 6)
        sel_rows = rng.randrange(1, rows + 1)  # selected may have fewer rows than the table
        pages = rng.randrange(0, 6)
        P = rng.choice([1, 4, 16, 64])
        K = rng.randrange(1, 9)
        scale = rng.choice([1, 2, 3])
        pos = rng.randrange(scale)
        table = random_page_table(rng, rows, pages)
        capacity = random_capacities(rng, rows, pages * P)
        hi = pages * P + 2 * P + 1
        selected = [[rng.choice([-1, -1, -7, hi * 10, rng.randrange(hi)])
                     if rng.random() < 0.2 else rng.randrange(hi) for _ in range(K)]
                    for _ in range(sel_rows)]
        got = run_token_op(device, selected, table, capacity, scale, pos, P)
        want = ref.convert_token_indices(selected, table, capacity, scale, pos, P)
        assert got == want, (trial, selected, table, capacity, scale, pos, P)
        checked += sum(v != BAD for row in want for v in row)
    assert checked > 100


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_index_token_form_exact_values(device):
    """OP-INDEX token form on hand-computed values (P=4, scale=2, pos=1)."""
    table = [[3, BAD, 9]]
    selected = [[0, 3, 4, 8, 9, 11, 12, -1, 2**31 - 1]]
    got = run_token_op(device, selected, table, [11], scale=2, pos=1, P=4)
    # t=0 -> (3*2+1)*4+0 = 28; t=3 -> 31; t=4,5 on the BAD page; t=8 -> (9*2+1)*4 = 76;
    # t=9 -> 77; t=11 >= capacity; t=12 past the table; -1 padding; huge -> BAD
    assert got == [[28, 31, BAD, 76, 77, BAD, BAD, BAD, BAD]]
    assert got == ref.convert_token_indices(selected, table, [11], 2, 1, 4)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_index_token_form_overflow_is_bad(device):
    """OP-INDEX / DESIGN: token results above INT32_MAX are BAD."""
    table = [[2**30, 2**22, -3]]
    selected = [[0, 1, 63, 64, 127, 128]]
    got = run_token_op(device, selected, table, [2**31 - 1], scale=2, pos=1, P=64)
    want = ref.convert_token_indices(selected, table, [2**31 - 1], 2, 1, 64)
    assert got == want
    assert got[0][:3] == [BAD] * 3 and got[0][3] == (2**22 * 2 + 1) * 64
    assert got[0][5] == BAD  # negative slot id


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_index_divisors_above_int32(device):
    """OP-INDEX with tokens per unit / per page above INT32_MAX (the CUDA kernels divide in 32
    bits when the divisor fits): every int32 capacity is one unit, every token is on page 0."""
    table = [[1, 2], [0, 3], [4, BAD]]
    capacity = [0, 1, 2**31 - 1]
    got = run_page_op(device, table, capacity, 1, 0, 2, 2**33, 5)
    assert got == ref.convert_page_indices(table, capacity, 1, 0, 2, 2**33, 5)
    assert got == [[BAD] * 5, [0, BAD, BAD, BAD, BAD], [8, BAD, BAD, BAD, BAD]]
    selected = [[0, 5, 2**31 - 1, -1]] * 3
    got = run_token_op(device, selected, table, capacity, 1, 0, 2**33)
    assert got == ref.convert_token_indices(selected, table, capacity, 1, 0, 2**33)
    assert got[2] == [BAD] * 4 and got[1] == [0, BAD, BAD, BAD]  # slot 4 * 2^33 > INT32_MAX


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_index_token_form_bad_arguments_raise(device):
    """SAFE-3: token form rejects wrong dtype, shape, layout and integer arguments."""
    pt = t32([[1, 2], [3, 4]], device)
    cap = t32([8, 8], device)
    sel = t32([[0, 1, 2], [3, 4, 5]], device)

    def fresh():
        return torch.full((2, 3), 77, dtype=I32, device=device)

    bad_calls = [
        lambda o: ops.convert_token_indices(o.long(), sel, pt, cap, 1, 0, 4),
        lambda o: ops.convert_token_indices(o, sel.long(), pt, cap, 1, 0, 4),
        lambda o: ops.convert_token_indices(o, sel, pt.long(), cap, 1, 0, 4),
        lambda o: ops.convert_token_indices(o, sel, pt, cap.long(), 1, 0, 4),
        lambda o: ops.convert_token_indices(o[:, :2], sel, pt, cap, 1, 0, 4),  # out != selected
        lambda o: ops.convert_token_indices(o, sel, pt[:1], cap[:1], 1, 0, 4),  # rows > table
        lambda o: ops.convert_token_indices(o, sel, pt, cap[:1], 1, 0, 4),
        lambda o: ops.convert_token_indices(o, sel.reshape(-1), pt, cap, 1, 0, 4),
        lambda o: ops.convert_token_indices(o, sel, pt, cap, 0, 0, 4),  # scale 0
        lambda o: ops.convert_token_indices(o, sel, pt, cap, 1, 1, 4),  # pos >= scale
        lambda o: ops.convert_token_indices(o, sel, pt, cap, 1, 0, 0),  # P = 0
    ]
    for i, call in enumerate(bad_calls):
        out = fresh()
        with pytest.raises((RuntimeError, ValueError)):
            call(out)
        assert out.cpu().tolist() == [[77] * 3] * 2, i


# ----------------------------------------------------------------------------------------------
# INT-1 / INT-2
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_index_opcheck(device):
    """INT-1: both index ops pass torch.library.opcheck (all default utilities)."""
    pt = t32([[1, BAD, 3], [4, 5, BAD]], device)
    cap = t32([9, 24], device)
    out = torch.zeros((2, 7), dtype=I32, device=device)
    torch.library.opcheck(torch.ops.torch_kvcm2.convert_page_indices.default,
                          (out, pt, cap, 2, 1, 2, 4))
    sel = t32([[0, 5, 9, -1], [23, 24, 7, 8]], device)
    out2 = torch.zeros((2, 4), dtype=I32, device=device)
    torch.library.opcheck(torch.ops.torch_kvcm2.convert_token_indices.default,
                          (out2, sel, pt, cap, 2, 1, 8))
    # and the op itself (opcheck works on copies) gives the reference values
    torch.ops.torch_kvcm2.convert_page_indices(out, pt, cap, 2, 1, 2, 4)
    torch.ops.torch_kvcm2.convert_token_indices(out2, sel, pt, cap, 2, 1, 8)
    assert out.cpu().tolist() == ref.convert_page_indices(pt.cpu().tolist(), [9, 24], 2, 1, 2, 4, 7)
    assert out2.cpu().tolist() == ref.convert_token_indices(
        sel.cpu().tolist(), pt.cpu().tolist(), [9, 24], 2, 1, 8)


def test_op_index_torch_compile_fullgraph_equals_eager():
    """INT-2: a function calling both index ops compiles with fullgraph=True on CPU and gives
    the eager results (and the reference's)."""
    torch._dynamo.reset()

    def step(out_pages, out_tokens, page_table, capacity, selected):
        ops.convert_page_indices(out_pages, page_table, capacity, 2, 1, 2, 4)
        ops.convert_token_indices(out_tokens, selected, page_table, capacity, 2, 1, 8)
        return out_pages + 0, out_tokens * 1

    rng = random.Random(3)
    table = random_page_table(rng, 3, 4)
    capacity = [0, 13, 40]
    selected = [[rng.randrange(-2, 40) for _ in range(6)] for _ in range(3)]
    args = lambda: (torch.full((3, 9), 5, dtype=I32), torch.full((3, 6), 5, dtype=I32),  # noqa: E731
                    t32(table, "cpu"), t32(capacity, "cpu"), t32(selected, "cpu"))
    eager_args = args()
    eager = step(*eager_args)
    compiled_args = args()
    compiled = torch.compile(step, fullgraph=True, backend="inductor")(*compiled_args)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])
    # the in-place mutation is visible to the caller in both modes
    assert torch.equal(eager_args[0], compiled_args[0])
    assert torch.equal(eager_args[1], compiled_args[1])
    assert eager[0].tolist() == ref.convert_page_indices(table, capacity, 2, 1, 2, 4, 9)
    assert eager[1].tolist() == ref.convert_token_indices(selected, table, capacity, 2, 1, 8)
