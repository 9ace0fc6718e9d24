"""The DSA indexer's paged logits (torch_kvcm2/models/indexer_logits.py): the definition against
transformers' own ``DeepseekV32Indexer`` (its scores order the tokens; ours must order them
alike), the torch implementation against the definition on CPU, and the Triton kernel against it
on CUDA at P-SERVE's shape (64 heads, pages of 64) and inside a CUDA graph. (On the development
machine the kernel also ran under ``TRITON_INTERPRET=1``, its dot product in fp32 because the
interpreter's bf16 dot is wrong there, within 2e-5 of the definition.)"""
import os
import subprocess
import sys

import pytest
import torch

from conftest import DEVICE_PARAMS
from torch_kvcm2.models import indexer_logits as il


def make(R, H, P, npages, pool_pages, lengths, device, seed=0, power_of_two_scales=False,
         layout="token"):
    """Random query, weights and FP8 keys in a pool of ``pool_pages`` pages (in ``layout``),
    each request's pages a random permutation's (no two requests share a page)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(R, H, il.INDEX_DIM, generator=g).to(torch.bfloat16)
    w = torch.randn(R, H, generator=g)
    keys = il.quantize_index_keys(torch.randn(pool_pages * P, il.INDEX_DIM, generator=g))
    if power_of_two_scales:  # dequantised keys exact in bf16
        keys[:, il.INDEX_DIM:] = torch.full((keys.shape[0], 1), 2.0 ** -4).view(torch.uint8)
    keys = keys.view(pool_pages, P, il.KEY_BYTES)
    if layout == "page":
        keys = il.to_page_layout(keys)
    table = torch.randperm(pool_pages, generator=g)[:R * npages].view(R, npages).to(torch.int32)
    lengths = torch.tensor(lengths, dtype=torch.int32)
    return [t.to(device) for t in (q, w, keys, table, lengths)]


def test_quantize_round_trip_and_format():
    k = torch.randn(10, 128) * 3
    k[3] = 0
    keys = il.quantize_index_keys(k)
    assert keys.shape == (10, 132) and keys.dtype == torch.uint8
    back = il.dequantize_index_keys(keys)
    assert torch.equal(back[3], torch.zeros(128))
    assert ((back - k).abs() <= k.abs().amax(1, keepdim=True) / 16).all()  # e4m3: 3 mantissa bits
    scale = keys[:, 128:].contiguous().view(torch.float32)
    assert torch.allclose(scale[:, 0], torch.where(k.abs().amax(1) > 0, k.abs().amax(1) / 448, 1.0))


def test_definition_orders_tokens_as_transformers_indexer():
    """Per request, transformers' indexer (random weights, the rotary embedding the identity,
    its key cache replaced by our pool's keys through ``update_indexer``) returns every token
    by score; our definition's logits at its query and weights must fall in that order, and the
    top-8 sets agree. A planted fault (relu left out) breaks the order."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer
    hidden, H, P = 64, 8, 16
    lengths = [37, 80, 16]
    config = transformers.DeepseekV32Config(
        hidden_size=hidden, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, index_n_heads=H,
        index_head_dim=128, index_topk=max(lengths))
    torch.manual_seed(0)
    indexer = DeepseekV32Indexer(config, 0).to(torch.bfloat16).eval()
    _, _, keys, table, lens = make(3, H, P, 5, 16, lengths, "cpu", power_of_two_scales=True)
    x = torch.randn(3, hidden).bfloat16()
    q_resid = torch.randn(3, 32).bfloat16()
    with torch.no_grad():
        q = indexer.wq_b(q_resid).view(3, H, 128)
        w = indexer.weights_proj(x).float() * H ** -0.5 * indexer.softmax_scale
    ours = il.indexer_logits_reference(q, w, keys, table, lens)

    class Keys:  # transformers' cache interface for the indexer: our keys, every position
        def __init__(self, k):
            self.k = k

        def update_indexer(self, k, layer_idx):
            return self.k

    for r, n in enumerate(lengths):
        t = torch.arange(n)
        k = il.dequantize_index_keys(keys[table[r, t // P].long(), t % P])
        assert torch.equal(k.bfloat16().float(), k)  # exact in the module's dtype
        indexer.index_topk = n
        cos, sin = torch.ones(1, n, 16, dtype=torch.bfloat16), torch.zeros(1, n, 16, dtype=torch.bfloat16)
        with torch.no_grad():  # the query token is the last of n; its row of the scores is ours
            order = indexer(x[r].expand(1, n, hidden).contiguous(), q_resid[r].expand(1, n, 32).contiguous(),
                            (cos, sin), torch.ones(1, n, n, dtype=torch.bool), None,
                            Keys(k.bfloat16()[None]))[0, -1].long()
        assert sorted(order.tolist()) == list(range(n))
        ranked = ours[r, order]
        slack = 1e-5 * ours[r, :n].abs().max()
        assert (ranked[1:] <= ranked[:-1] + slack).all(), f"request {r}: not transformers' order"
        assert set(order[:8].tolist()) == set(ours[r, :n].topk(8).indices.tolist())
        assert torch.isinf(ours[r, n:]).all()
        wrong = w[r] @ (q[r].float() @ k.t())  # the planted fault: no relu
        assert not (wrong[order][1:] <= wrong[order][:-1] + slack).all()


def test_page_layout_holds_the_same_keys():
    """``to_page_layout``: a page's values then its scales; the definition over either layout
    of one pool gives the same logits, and reading a page-layout pool as token-layout does not
    (a test of the layout's use)."""
    q, w, keys, table, lens = make(3, 8, 16, 4, 12, [64, 20, 33], "cpu")
    paged = il.to_page_layout(keys)
    assert torch.equal(paged[5].flatten()[:16 * 128], keys[5, :, :128].flatten())
    assert torch.equal(paged[5].flatten()[16 * 128 + 4 * 3:16 * 128 + 4 * 4], keys[5, 3, 128:])
    want = il.indexer_logits_reference(q, w, keys, table, lens)
    assert torch.equal(il.indexer_logits_reference(q, w, paged, table, lens, layout="page"), want)
    assert not torch.equal(il.indexer_logits_reference(q, w, paged, table, lens), want)


@pytest.mark.parametrize("layout", il.LAYOUTS)
@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_dispatch_matches_definition(device, layout):
    """``indexer_logits`` (CPU: torch; CUDA: Triton) against the definition: 64 heads and pages
    of 64 (P-SERVE's shape), a request with no history, lengths off page boundaries, page-table
    entries past the length left garbage, ``out`` written in place."""
    P, npages = 64, 9
    q, w, keys, table, lens = make(4, 64, P, npages, 40, [0, 1, 300, npages * P], device,
                                   layout=layout)
    table[2, 5:] = 10 ** 6  # past its length: never read
    want = il.indexer_logits_reference(q, w, keys, table, lens, layout=layout)
    out = torch.full((4, npages * P), 7.0, device=device)
    got = il.indexer_logits(q, w, keys, table, lens, out=out, layout=layout)
    assert got is out
    assert torch.equal(got.isinf(), want.isinf()) and torch.isinf(got[0]).all()
    scale = want[want.isfinite()].abs().max()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(scale))


@pytest.mark.parametrize("layout", il.LAYOUTS)
@pytest.mark.parametrize("H,P", [(4, 16), (64, 64)])
def test_torch_implementation_matches_definition(H, P, layout):
    q, w, keys, table, lens = make(3, H, P, 4, 20, [P * 4, 5, 2 * P + 3], "cpu", seed=3,
                                   layout=layout)
    want = il.indexer_logits_reference(q, w, keys, table, lens, layout=layout)
    scale = float(want[want.isfinite()].abs().max())  # fp32 sums in another order
    torch.testing.assert_close(il.indexer_logits_torch(q, w, keys, table, lens, layout=layout),
                               want, rtol=1e-5, atol=1e-5 * scale)


def test_bad_arguments_are_refused():
    q, w, keys, table, lens = make(2, 4, 16, 2, 6, [3, 4], "cpu")
    with pytest.raises(ValueError, match="q must be bf16"):
        il.indexer_logits(q.float(), w, keys, table, lens)
    with pytest.raises(ValueError, match="weights must be fp32"):
        il.indexer_logits(q, w[:1], keys, table, lens)
    with pytest.raises(ValueError, match="keys must be uint8"):
        il.indexer_logits(q, w, keys[..., :128], table, lens)
    with pytest.raises(ValueError, match="lengths"):
        il.indexer_logits(q, w, keys, table, lens.float())
    with pytest.raises(ValueError, match="out must be fp32"):
        il.indexer_logits(q, w, keys, table, lens, out=torch.empty(2, 31))
    with pytest.raises(ValueError, match="layout must be one of"):
        il.indexer_logits(q, w, keys, table, lens, layout="paged")


@pytest.mark.cuda
def test_kernel_at_the_benchmarks_shape_inside_a_graph():
    """64 heads, 116 requests of 34,816 positions in pages of 64 in the page layout (P-SERVE at
    32K tokens), captured once and replayed after the query and the lengths changed."""
    pytest.importorskip("triton")
    P, npages = 64, 544
    q, w, keys, table, lens = make(116, 64, P, npages, 116 * npages, [30000 + 7 * r for r in range(116)],
                                   "cuda", layout="page")
    out = torch.empty(116, npages * P, device="cuda")
    il.indexer_logits(q, w, keys, table, lens, out=out, layout="page")  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        il.indexer_logits(q, w, keys, table, lens, out=out, layout="page")
    q.copy_(torch.randn_like(q, dtype=torch.float32).bfloat16())
    lens.add_(100)
    graph.replay()
    rows = [0, 57, 115]
    want = il.indexer_logits_reference(q[rows], w[rows], keys, table[rows], lens[rows], layout="page")
    scale = want[want.isfinite()].abs().max()
    torch.testing.assert_close(out[rows], want, rtol=1e-5, atol=1e-5 * float(scale))


BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def test_benchmark_checks_catch_a_planted_fault():
    """benchmarks/bench_indexer.py's check passes the logits and top-k of a set computed right
    and fails logits computed over a page table shifted by one page (built on the CPU here: the
    benchmark itself measures only on a GPU)."""
    sys.path.insert(0, BENCH)
    import bench_indexer as bench
    work = bench.build(256, 3, device="cpu")
    rows = slice(0, 3)
    args = (work["q"], work["w"], work["keys"]["token"], work["table"], work["lengths"])
    out = il.indexer_logits(*args)
    bench.check(work, rows, out, bench.topk.reference(out, bench.K), "right", "token")
    paged = il.indexer_logits(*args[:2], work["keys"]["page"], *args[3:], layout="page")
    bench.check(work, rows, paged, bench.topk.reference(paged, bench.K), "page layout")
    shifted = il.indexer_logits(*args[:3], work["table"].roll(1, 1), args[4])
    with pytest.raises(AssertionError, match="logits differ"):
        bench.check(work, rows, shifted, bench.topk.reference(shifted, bench.K), "shifted", "token")
    with pytest.raises(AssertionError, match="top-k differs"):
        bench.check(work, rows, out, bench.topk.reference(out, bench.K).flip(1), "reordered", "token")


def test_benchmark_refuses_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the benchmark would measure")
    result = subprocess.run([sys.executable, os.path.join(BENCH, "bench_indexer.py"), "--quick"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "nothing was measured" in result.stderr
