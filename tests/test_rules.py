"""The length rules that host and device both apply are written once in C++ (csrc/rules.h) and
once in Python (torch_kvcm2/lengths.py, memory.py's row order, Batch.advance's rule): the two
agree on random valid lengths and at the edges (rules_py.cpp exposes the C++ side)."""
import random

import pytest

import torch_kvcm2  # noqa: F401  (loads _C)
from torch_kvcm2 import _C
from torch_kvcm2 import lengths as rules
from torch_kvcm2 import memory

import reference as ref

INT32_MAX = 2**31 - 1


def python_rules(h, c, written, declared, target, allocated, accepted, shapes):
    """What ``_C.length_rules`` returns, from the Python rules: the in-flight start per shape,
    the host-direct end, the flush watermark, and the advance of one seated row (refused 1,
    short 2, moved 0; the reference model of Batch.advance's docstring)."""
    starts = tuple(rules.inflight_start(h, c, shape, max) for shape in shapes)
    end = rules.host_direct_end(h, c, shapes, max)
    mark = rules.flushed_watermark(h, c, written, declared, target, shapes, max, min, rules.pick)
    lengths = [[h], [c], [0], [written], [declared], [allocated]]
    (new_h,), (new_c,), refused, short = ref.advance(lengths, [accepted])
    outcome = 1 if refused else 2 if short else 0
    return starts, end, mark, outcome, new_h, new_c


def random_shape(rng):
    U = rng.choice([1, 2, 4, 16, 64, 3, 5, 7, 12, 100, rng.randint(1, 1000)])
    I = rng.choice([0, 1, U - 1, U, U + 1, 8, 63, 64, 4096, rng.randint(0, 10**6)])
    return (U, I)


def random_row(rng):
    """Valid lengths 0 <= h <= c < 2**31, small or near int32 max, with c = h and c - I < 0
    cases, and the other lengths around them."""
    top = rng.choice([50, 5000, INT32_MAX])
    h = rng.choice([0, rng.randint(0, top), top])
    c = rng.choice([h, h + rng.randint(0, 100), rng.randint(h, top)])
    c = min(c, INT32_MAX)
    near = lambda x: min(max(x + rng.randint(-70, 70), 0), INT32_MAX)  # noqa: E731
    written = rng.choice([0, h, c, near(h), near(c), rng.randint(0, c)])
    declared = rng.choice([0, h, c, near(h), near(c), rng.randint(0, c)])
    target = rng.choice([0, h, c, near(c), INT32_MAX, rng.randint(0, INT32_MAX)])
    allocated = rng.choice([c, near(c), INT32_MAX, rng.randint(c, INT32_MAX)])
    width = c - h
    accepted = rng.choice([0, -1, width, width + 1, rng.randint(0, max(width, 0)),
                           written - h, written - h + 1])
    accepted = max(min(accepted, INT32_MAX), -(2**31))
    shapes = [random_shape(rng) for _ in range(rng.randint(1, 3))]
    return h, c, written, declared, target, allocated, accepted, shapes


EDGES = [
    (0, 0, 0, 0, 0, 0, 0, [(1, 1)]),
    (0, 0, 0, 0, 0, 0, 1, [(4, 8)]),  # c - I < 0, accepted past the width
    (5, 5, 5, 5, 9, 5, 0, [(4, 8), (3, 2)]),  # c = h
    (10, 12, 12, 0, 100, 20, 2, [(8, 64)]),  # c - I < 0, history moves to the watermark
    (10, 40, 10, 10, 30, 40, 5, [(16, 8), (1, 1), (7, 0)]),  # accepted past written: refused
    (100, 300, 300, 250, 280, 310, 150, [(64, 128)]),  # short: cut at the allocated tokens
    (INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX, 0, [(1, 1)]),
    (INT32_MAX - 100, INT32_MAX, INT32_MAX, 0, INT32_MAX, INT32_MAX, 100, [(64, 4096), (3, 7)]),
    (0, INT32_MAX, 0, INT32_MAX, INT32_MAX, INT32_MAX, 0, [(1, 0), (2**20, INT32_MAX)]),
]


@pytest.mark.parametrize("row", EDGES)
def test_length_rules_agree_at_the_edges(row):
    assert _C.length_rules(*row) == python_rules(*row)


def test_length_rules_agree_on_random_valid_lengths():
    rng = random.Random(2026)
    outcomes = {0: 0, 1: 0, 2: 0}
    for _ in range(20000):
        row = random_row(rng)
        got = _C.length_rules(*row)
        assert got == python_rules(*row), row
        outcomes[got[3]] += 1
    assert all(n > 500 for n in outcomes.values()), outcomes  # moved, refused and short seen


def test_length_rules_have_the_documented_values():
    """Spot values, so that a rule changed on both sides at once is caught too."""
    # s0 = max(h, floor((c - I) / U) * U): floor((37 - 8) / 4) * 4 = 28; (37 - 40) // 4 * 4 = -4
    starts, end, mark, outcome, h, c = _C.length_rules(10, 37, 20, 30, 35, 50, 5, [(4, 8),
                                                                                (4, 40)])
    assert starts == (28, 10) and end == 28
    assert mark == 35  # max(written, declared) = 30 >= 28: min(target, c) = 35
    assert (outcome, h, c) == (0, 15, 42)
    assert _C.length_rules(10, 37, 20, 27, 35, 50, 5, [(4, 8)])[2] == 20  # 27 < 28: unchanged
    assert _C.length_rules(10, 37, 12, 0, 0, 50, 5, [(4, 8)])[3:] == (1, 10, 37)  # past written
    assert _C.length_rules(10, 37, 20, 0, 0, 40, 5, [(4, 8)])[3:] == (2, 15, 40)  # short


def test_length_row_order_is_memory_py_s():
    order = _C.length_row_order()
    assert order == {"HISTORY": memory.HISTORY, "CAPACITY": memory.CAPACITY,
                     "LEASE": memory.LEASE, "WRITTEN": memory.WRITTEN,
                     "DECLARED": memory.DECLARED, "ALLOCATED": memory.ALLOCATED, "ROWS": 6}
    assert sorted(order.values()) == list(range(7))


def test_length_rules_check_their_arguments():
    good = [0, 0, 0, 0, 0, 0, 0, [(1, 1)]]
    for i, bad in [(0, 1.0), (3, "3"), (6, True), (7, [(1.5, 1)]), (7, [1, 2]), (7, 5)]:
        args = list(good)
        args[i] = bad
        with pytest.raises(TypeError):
            _C.length_rules(*args)
    for i, bad in [(1, 2**31), (4, -(2**31) - 1), (7, [(0, 1)]), (7, [(1, -1)]),
                   (7, [(1, 1)] * 17)]:
        args = list(good)
        args[i] = bad
        with pytest.raises(ValueError):
            _C.length_rules(*args)
    with pytest.raises(OverflowError):
        _C.length_rules(2**70, *good[1:])
    with pytest.raises(TypeError):
        _C.length_rules(*good[:7])
    with pytest.raises(TypeError):
        _C.length_row_order(1)


def python_window_rules(h, c, U, P, I, window, sinks, units):
    """What ``_C.window_rules`` returns, from torch_kvcm2/lengths.py (the pages) and the
    reference model's RowRange (what a row may select)."""
    h0 = max(h, 0)
    row = ref.RowRange(h, c, U, P, I, window, sinks)
    kept = rules.sink_pages(sinks, P) if window else 0
    return kept, rules.first_live_page(h0, P, window), tuple(row.selectable(u) for u in units)


def test_window_rules_agree_with_sinks():
    """TIER-3: the sink pages, the window's first live page and every unit's selectability agree
    between csrc/rules.h and the Python side, over random windows, sinks and lengths."""
    rng = random.Random(37)
    kept_behind = 0
    for _ in range(4000):
        U = rng.choice([1, 2, 3, 4, 16])
        P = U * rng.choice([1, 2, 3, 4])
        window = rng.choice([0, 1, P, 3 * P + 1, rng.randint(1, 300)])
        sinks = 0 if not window else rng.choice([0, 1, P - 1, P, P + 1, rng.randint(0, 200)])
        h = rng.choice([0, rng.randint(0, 2000), window + rng.randint(-3, 3)])
        c = h + rng.choice([0, 1, rng.randint(0, 64)])
        I = rng.choice([1, U, 8, 64])
        top = max(-(-c // U) + 2, 1)
        units = [-1, 0, 1, *rng.sample(range(top), min(top, 12)), top]
        got = _C.window_rules(h, c, U, P, I, window, sinks, units)
        assert got == python_window_rules(h, c, U, P, I, window, sinks, units), \
            (h, c, U, P, I, window, sinks)
        kept_behind += got[0] > 0 and got[1] > got[0]
    assert kept_behind > 500, kept_behind  # sink pages below a released range were tested


def test_window_rules_have_the_documented_values():
    """P = 4, U = 2, window 8, sinks 5 (two sink pages: units 0..3), h = c = 40: pages 2..7
    (units 4..15) are released, page 8 on (unit 16 on) live."""
    kept, first, sel = _C.window_rules(40, 40, 2, 4, 4, 8, 5, list(range(22)))
    assert (kept, first) == (2, 8)
    assert sel == tuple([True] * 4 + [False] * 12 + [True] * 4 + [False] * 2)
    assert _C.window_rules(40, 40, 2, 4, 4, 0, 0, [0])[:2] == (0, 0)  # full attention
    with pytest.raises(ValueError):
        _C.window_rules(40, 40, 3, 4, 4, 8, 5, [0])  # U does not divide P
    with pytest.raises(TypeError):
        _C.window_rules(40, 40, 2, 4, 4, 8, 5, 3)
