"""The serving benchmark's radix-select top-k (benchmarks/topk.py): on CPU its torch rule
(``reference``) against ``torch.topk``; on CUDA the Triton kernel against that rule, position for
position, on scores with many ties (where ``torch.topk``'s own positions differ), the whole
int32 range, K = 1 and K = N, rows not a multiple of the kernel's block, and rows split over
several programs or compacted. (On the development machine the kernels also ran under
``TRITON_INTERPRET=1`` against the rule, every case equal.)"""
import importlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
topk = importlib.import_module("topk")

CASES = [  # rows, positions, K, scores drawn from [lo, hi)
    (3, 1000, 64, -5, 5),  # ties at the K-th value
    (2, 5000, 2048, -2 ** 31, 2 ** 31 - 1),  # the whole int32 range
    (4, 9000, 100, 0, 1 << 20),  # the benchmark's 20-bit scores, several blocks and a tail
    (1, 100, 100, 0, 3),  # K = N
    (2, 4097, 1, -1, 1),  # K = 1, one position past a block
]


def scores_of(R, n, lo, hi, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (R, n), generator=g, dtype=torch.int64).to(torch.int32).to(device)


def float_scores(R, n, device, seed=0):
    """fp32 scores as the indexer's logits come: ties, both zeros, -inf (positions past a
    request's length) and the largest finite value (the locality model's boost)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(R, n, generator=g)
    s[:, 1::5] = 0.5
    s[:, 3::11] = -0.0
    s[:, 4::13] = 0.0
    s[:, ::7] = float("-inf")
    s[0, :10] = torch.finfo(torch.float32).max
    return s.to(device)


FLOAT_CASES = [(3, 1000, 64), (2, 5000, 700), (1, 100, 100), (2, 4097, 1)]


@pytest.mark.parametrize("R,n,k,lo,hi", CASES)
def test_the_rule_takes_the_k_largest_ties_to_the_lowest_positions(R, n, k, lo, hi):
    s = scores_of(R, n, lo, hi, "cpu")
    got = topk.reference(s, k)
    assert got.shape == (R, k) and got.dtype == torch.int64
    # the K largest values, each position once
    assert torch.equal(s.gather(1, got).sort(1).values, s.topk(k, 1).values.sort(1).values)
    assert all(len(set(row.tolist())) == k for row in got)
    kth = s.topk(k, 1).values[:, -1:]
    for row in range(R):
        above = torch.nonzero(s[row] > kth[row]).flatten()
        ties = torch.nonzero(s[row] == kth[row]).flatten()[:k - len(above)]
        assert got[row].tolist() == above.tolist() + ties.tolist()  # the order documented


@pytest.mark.parametrize("R,n,k", FLOAT_CASES)
def test_the_rule_on_float_scores(R, n, k):
    s = float_scores(R, n, "cpu")
    got = topk.reference(s, k)
    assert torch.equal(s.gather(1, got).sort(1).values, s.topk(k, 1).values.sort(1).values)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="int32"):
        topk.topk_indices(torch.zeros(2, 8, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match=r"K = 9 must be in \[1, 8\]"):
        topk.topk_indices(torch.zeros(2, 8, dtype=torch.int32), 9)


@pytest.mark.parametrize("rows,n,want", [(1, 34816, 4), (1, 132096, 8), (30, 132096, 4),
                                          (116, 34816, 1), (1, 8192, 1), (66, 34816, 2)])
def test_split_by_shape_is_the_sweeps_best(rows, n, want):
    """``split`` = 0: the sweep's best split at each shape it measured on an H100 (132 SMs):
    the programs within the SMs, chunks of at least 8,192 positions, at most 8 per row."""
    assert topk.auto_split(rows, n, 132) == want


@pytest.mark.cuda
@pytest.mark.parametrize("R,n,k,lo,hi", CASES)
def test_the_kernel_is_the_rule_position_for_position(R, n, k, lo, hi):
    pytest.importorskip("triton")
    s = scores_of(R, n, lo, hi, "cuda")
    want = topk.reference(s, k)
    out = torch.full((R, k), -7, dtype=torch.int64, device="cuda")
    assert topk.topk_indices(s, k, out=out) is out
    assert torch.equal(out, want)


@pytest.mark.cuda
@pytest.mark.parametrize("R,n,k", FLOAT_CASES)
def test_the_kernel_on_float_scores_is_the_rule(R, n, k):
    pytest.importorskip("triton")
    s = float_scores(R, n, "cuda")
    assert torch.equal(topk.topk_indices(s, k), topk.reference(s, k))


@pytest.mark.cuda
@pytest.mark.parametrize("config", [{"split": 4}, {"split": 64, "block": 256, "bits": 5},
                                    {"compact": 2}, {"compact": 1, "split": 4, "block": 512}],
                         ids=["split4", "split64", "compact2", "compact1-split4"])
def test_split_and_compacted_rows_give_the_same_positions(config):
    """``split``: each chunk's top-K, then the top-K of the candidates; ``compact``: the passes
    after a digit read only the positions still matching. Position for position the
    one-program rule, on every case above and on ascending scores, where a chunk shorter than K
    lies wholly above the row's K-th value (its candidates must stay in position order: the
    merge writes the keys above the K-th value in candidate order)."""
    pytest.importorskip("triton")
    rows = [scores_of(R, n, lo, hi, "cuda") for R, n, _, lo, hi in CASES]
    ks = [k for *_, k, _, _ in CASES]
    rows += [float_scores(R, n, "cuda") for R, n, _ in FLOAT_CASES]
    ks += [k for *_, k in FLOAT_CASES]
    ascending = torch.arange(300, dtype=torch.int32, device="cuda").repeat(2, 1)
    ascending[1] = ascending[1].flip(0)
    rows.append(ascending.contiguous())
    ks.append(40)
    for s, k in zip(rows, ks):
        assert torch.equal(topk.topk_indices(s, k, config=config), topk.reference(s, k)), \
            (config, list(s.shape), k)


@pytest.mark.cuda
def test_the_kernel_at_the_benchmarks_shape_inside_a_graph():
    """116 rows of 34,816 positions, K = 2048 (P-SERVE at 32K tokens), replayed from a CUDA
    graph after the scores changed: the new top-k each replay."""
    pytest.importorskip("triton")
    s = scores_of(116, 34816, -1, 1 << 20, "cuda")
    out = torch.empty(116, 2048, dtype=torch.int64, device="cuda")
    topk.topk_indices(s, 2048, out=out)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topk.topk_indices(s, 2048, out=out)
    s.copy_(scores_of(116, 34816, -1, 1 << 20, "cuda", seed=1))
    graph.replay()
    assert torch.equal(out, topk.reference(s, 2048))
