"""Tests of the stream reference model (tests/stream_reference.py; docs/REQUIREMENTS.md §15g, STR-1..2).

Each rule on hand-computed cases, the rules against transformers' DeepSeek-V4 compressors (skipped
without transformers), random engine days on several seeds, directed scenarios (a fork whose
boundary crosses a window, accepting past the flush, a shared prefix's state warm-up, export /
import and offload) and the three planted faults the checks must catch.
"""
import random
from collections import Counter

import pytest

import stream_engine
import stream_reference as sr
from stream_reference import CSA, HCA, SLIDING

P = 256


@pytest.fixture(scope="module")
def v4():
    return sr.v4_config([SLIDING, CSA, HCA], max_inflight_tokens=16, max_query_tokens=4)


def stream(config, layer, name):
    return config.stream((layer, name))


# ------------------------------------------------------------------------------- configuration


def test_v4_config_streams_and_pools(v4):
    keys = [s.key for s in v4.streams]
    assert keys == [("L0", "raw"), ("L1", "raw"), ("L1", "kv"), ("L1", "idx"), ("L2", "raw"),
                    ("L2", "kv")]
    csa, idx, hca, raw = (stream(v4, "L1", "kv"), stream(v4, "L1", "idx"), stream(v4, "L2", "kv"),
                          stream(v4, "L0", "raw"))
    assert (csa.rate, csa.overlap, csa.sparse, csa.entry_bytes) == (4, 1, True, 584)
    assert (idx.rate, idx.overlap, idx.sparse, idx.entry_bytes) == (4, 1, False, 132)
    assert (hca.rate, hca.overlap, hca.sparse) == (128, 0, False)
    assert (raw.rate, raw.window) == (1, 128)
    # D4: 256-token pages in every stream
    assert [v4.entries_per_page(s) for s in (raw, csa, idx, hca)] == [256, 64, 64, 2]
    pools = v4.pools()
    assert pools[v4.pool_key(raw)] == (raw, stream(v4, "L1", "raw"), stream(v4, "L2", "raw"))
    assert pools[v4.pool_key(csa)] == (csa,)
    # same bytes, different rates: never one pool group (their page counts differ)
    assert v4.pool_key(csa) != v4.pool_key(hca) and len(pools) == 4
    assert [c.key for c in v4.compressors] == [("L1", "kv"), ("L1", "idx"), ("L2", "kv")]


@pytest.mark.parametrize("bad, rule", [
    (dict(streams=(sr.StreamSpec("a", "kv", 3, 0, False, None, 8),)), "divide"),
    (dict(streams=(sr.StreamSpec("a", "kv", 4, 0, False, 64, 8),)), "window"),
    (dict(streams=(sr.StreamSpec("a", "raw", 1, 0, True, 64, 8),)), "window"),
    (dict(streams=(sr.StreamSpec("a", "kv", 4, 1, False, None, 8),)), "compressor"),
    (dict(streams=(sr.StreamSpec("a", "kv", 4, 1, False, None, 8),),
          compressors=(sr.CompressorSpec("a", "kv", 4, 0, 8),)), "compressor"),
    (dict(streams=(sr.StreamSpec("a", "raw"),), compressors=(sr.CompressorSpec("b", "kv", 4, 0),)),
     "feeds no stream"),
    (dict(streams=(sr.StreamSpec("a", "raw"),), max_inflight_tokens=2, max_query_tokens=4),
     "MTP-1"),
    (dict(streams=(sr.StreamSpec("a", "raw"), sr.StreamSpec("a", "raw"))), "unique"),
])
def test_config_refuses(bad, rule):
    with pytest.raises(ValueError, match=rule):
        sr.StreamConfig(tokens_per_page=P, **bad)


# ------------------------------------------------------------------------------- D1-D3 lengths


def test_entry_lengths_by_hand():
    # rate 4: entry 1's window is [4, 8); it closes with token 7
    assert sr.entry_window(1, 4) == (4, 8) and sr.closing_token(1, 4) == 7
    assert [sr.entries_existing(c, 4) for c in (0, 3, 4, 7, 8, 9)] == [0, 0, 1, 1, 2, 2]
    assert [sr.entries_final(h, 128) for h in (127, 128, 255, 256)] == [0, 1, 1, 2]
    assert sr.entries_existing(13, 1) == 13  # raw: an entry per token
    assert sr.readable(7, 1, 4) and not sr.readable(6, 1, 4)
    assert sr.readable(3, 0, 4) and not sr.readable(2, 0, 4) and not sr.readable(9, -1, 4)
    assert sr.readable(127, 0, 128) and not sr.readable(126, 0, 128)
    # D3: query t reads raw tokens [t - W + 1, t]
    assert sr.window_readable(200, 73, 128) and not sr.window_readable(200, 72, 128)
    assert not sr.window_readable(5, 6, 128) and sr.window_readable(5, 0, None)


def test_readable_is_transformers_causal_threshold():
    """query t sees entry w iff w < (t + 1) // r (DeepseekV4HCACompressor.forward,
    DeepseekV4Indexer.forward)."""
    for r in (1, 4, 128):
        for t in range(300):
            for i in range(-1, 80):
                assert sr.readable(t, i, r) == (0 <= i < (t + 1) // r)


def test_entry_feeds_by_hand():
    assert sr.entry_feeds(0, 4, 1) == (0, 4)      # entry 0 has no Ca half
    assert sr.entry_feeds(1, 4, 1) == (0, 8)
    assert sr.entry_feeds(5, 4, 1) == (16, 24)
    assert sr.entry_feeds(2, 128, 0) == (256, 384)


def test_stream_ranges_by_hand(v4):
    csa, idx, hca, raw = (stream(v4, "L1", "kv"), stream(v4, "L1", "idx"), stream(v4, "L2", "kv"),
                          stream(v4, "L0", "raw"))
    # a prefill chunk h 10 -> c 40, I = 16: s0 = max(10, floor(24/4)*4) = 24
    r = sr.stream_ranges(10, 40, csa, v4)
    assert (r.final, r.host_direct, r.in_flight, r.open, r.in_cells) == \
        ((0, 2), (2, 6), (6, 10), (40, 40), True)
    # a decode step h 10 -> c 13: entry 2 (window [8, 12)) is written whole this step, into a cell
    r = sr.stream_ranges(10, 13, csa, v4)
    assert (r.final, r.host_direct, r.in_flight, r.open) == ((0, 2), (2, 2), (2, 3), (12, 13))
    # dense streams are written in place: no host-direct part
    r = sr.stream_ranges(10, 40, idx, v4)
    assert (r.host_direct, r.in_flight, r.in_cells) == ((2, 2), (2, 10), False)
    r = sr.stream_ranges(100, 300, hca, v4)
    assert (r.final, r.in_flight, r.open) == ((0, 0), (0, 2), (256, 300))
    r = sr.stream_ranges(10, 13, raw, v4)
    assert (r.final, r.in_flight, r.open) == ((0, 10), (10, 13), (13, 13))


def test_max_inflight_entries_is_tight():
    for I in (1, 3, 4, 16, 17):
        for r in (1, 2, 4):
            for U in (1, 2):
                worst = max(c // r - max(h, (c - I) // (U * r) * U * r) // r
                            for c in range(0, 80) for h in range(0, c + 1))
                assert worst == sr.max_inflight_entries(I, r, U), (I, r, U)


def test_page_spans_by_hand(v4):
    csa, hca, raw = stream(v4, "L1", "kv"), stream(v4, "L2", "kv"), stream(v4, "L0", "raw")
    # D4: a page only once its first entry exists (entry 64 closes with token 259)
    assert sr.page_span(csa, 0, 259, P) == (0, 1) and sr.page_span(csa, 0, 260, P) == (0, 2)
    assert sr.page_span(csa, 0, 256, P) == (0, 1) and sr.page_span(csa, 0, 3, P) == (0, 0)
    assert sr.page_span(hca, 0, 255, P) == (0, 1) and sr.page_span(hca, 0, 127, P) == (0, 0)
    # a window keeps pages from floor((h - W) / P)
    assert sr.page_span(raw, 700, 703, P) == (2, 3) and sr.page_span(raw, 383, 385, P) == (0, 2)
    assert sr.page_span(raw, 384, 385, P) == (1, 2)
    assert sr.live_first_entry(raw, 700, P) == 512 and sr.live_first_entry(csa, 700, P) == 0


# ---------------------------------------------------------------------- D5-D6 write contract


def test_flush_and_watermarks_by_hand(v4):
    csa, idx = stream(v4, "L1", "kv"), stream(v4, "L1", "idx")
    # decode h 10 -> c 13; accept 2 (h' = 12): entry 2 closed by an accepted token, flushed
    assert sr.flush_range(10, 13, 12, csa, v4) == (2, 3)
    assert sr.flushed_watermark(2, 2, 10, 13, 12, csa, v4) == 3
    # accept 1 (h' = 11): entry 2 was closed by a rejected token; nothing to flush
    assert sr.flush_range(10, 13, 11, csa, v4) == (2, 2)
    assert sr.flushed_watermark(2, 2, 10, 13, 11, csa, v4) == 2
    # a prefill chunk: [2, 6) host-direct, [6, 10) flushed; the watermark moves only if declared
    assert sr.declared_end(10, 40, csa, v4) == 6
    assert sr.flush_range(10, 40, 40, csa, v4) == (6, 10)
    assert sr.flushed_watermark(2, 6, 10, 40, 40, csa, v4) == 10
    assert sr.flushed_watermark(2, 2, 10, 40, 40, csa, v4) == 2
    # dense streams: the forward writes in place; a cut drops the rejected tokens' entries
    assert sr.flush_range(10, 13, 12, idx, v4) == (0, 0)
    assert sr.forward_watermark(2, 13, idx) == 3 and sr.cut_watermark(3, 11, idx) == 2


def test_safe2_by_hand(v4):
    written = {s.key: sr.entries_existing(13, s.rate) for s in v4.streams}  # forward to c = 13
    written[("L1", "kv")] = 2  # flushed to h' = 11: entry 2 (closed by token 11) is in a cell
    assert sr.unwritten_on_advance(11, written, v4) == []
    # token 11 closes entry 2: advancing over it needs the entry on its host page
    assert sr.unwritten_on_advance(12, written, v4) == [(("L1", "kv"), 2, 3)]
    assert sr.advance_limit(13, written, v4) == 11
    # HCA: tokens of an open 128-token window need no entry
    written = {s.key: sr.entries_existing(260, s.rate) for s in v4.streams}
    written[("L2", "kv")] = 1
    assert sr.unwritten_on_advance(255, written, v4) == []
    assert sr.unwritten_on_advance(256, written, v4) == [(("L2", "kv"), 1, 2)]


def test_advance_limit_agrees_with_unwritten(v4):
    rng = random.Random(1)
    for _ in range(2000):
        c = rng.randrange(0, 600)
        written = {s.key: rng.randrange(0, c // s.rate + 2) for s in v4.streams}
        limit = sr.advance_limit(c, written, v4)
        for h in range(max(0, limit - 6), min(c, limit + 6) + 1):
            assert (not sr.unwritten_on_advance(h, written, v4)) == (h <= limit)


# ---------------------------------------------------------------------- D7 compressor state


def test_state_entries_by_hand(v4):
    csa, hca = v4.compressor(("L1", "kv")), v4.compressor(("L2", "kv"))
    # h = 10: overlap = Ca (series 1) of window 1 (tokens 4..7), tail = both series of 8, 9
    assert sr.state_entries(10, csa) == [(4, 1), (5, 1), (6, 1), (7, 1), (8, 0), (8, 1), (9, 0),
                                        (9, 1)]
    assert sr.state_entries(8, csa) == [(4, 1), (5, 1), (6, 1), (7, 1)]  # closed: overlap only
    assert sr.state_entries(3, csa) == [(p, j) for p in range(3) for j in (0, 1)]
    assert sr.state_entries(0, csa) == []
    assert sr.state_entries(130, hca) == [(128, 0), (129, 0)] and sr.state_entries(256, hca) == []
    assert sr.state_start(10, csa) == 4 and sr.state_start(130, hca) == 128


def test_state_bytes_of_v4(v4):
    csa, idx, hca = (v4.compressor(("L1", "kv")), v4.compressor(("L1", "idx")),
                     v4.compressor(("L2", "kv")))
    # bf16 kv + gate: CSA 2 x 512 features per series, indexer 2 x 128, HCA 2 x 512
    assert (csa.series_bytes, idx.series_bytes, hca.series_bytes) == (2048, 512, 2048)
    assert sr.max_state_bytes(csa) == (3 * 2 + 4) * 2048 == 20480
    assert sr.max_state_bytes(idx) == 5120
    assert sr.max_state_bytes(hca) == 127 * 2048 == 260096  # larger than the raw window's bytes
    assert sr.max_state_bytes(hca) > 128 * 584
    assert sr.ring_size(csa, 4) == 11 and sr.ring_size(hca, 4) == 131


@pytest.mark.parametrize("rate, overlap", [(4, 1), (8, 0), (3, 1), (2, 2)])
def test_ring_keeps_every_acceptable_state(rate, overlap):
    """D7: after a step at (h, c) the ring holds the live state of every h' with c - h' <= T, so
    rejected tokens need no snapshot; one slot fewer loses some."""
    comp = sr.CompressorSpec("a", "kv", rate, overlap)
    T = 4

    def holds_all(R):
        for h in range(0, 6 * rate):
            ring = {p % R: p for p in range(max(0, h - R), h)}  # what earlier steps left
            for n in range(1, T + 1):
                c = h + n
                after = dict(ring)
                lo, hi = sr.ring_writes(h, c, R)
                for p in range(lo, hi):
                    after[p % R] = p
                for h2 in range(h, c + 1):
                    if any(after.get(p % R) != p for p, _ in sr.state_entries(h2, comp)):
                        return False
        return True

    R = sr.ring_size(comp, T)
    assert holds_all(R)
    assert not holds_all(R - 1)
    for h in range(0, 6 * rate):  # state_survives says the same, and fails past T rejects
        for c in range(h, h + 3 * rate + T):
            for h2 in range(h, c + 1):
                ring = {p % R: p for p in range(max(0, h - R), h)}
                lo, hi = sr.ring_writes(h, c, R)
                ring.update({p % R: p for p in range(lo, hi)})
                held = all(ring.get(p % R) == p for p, _ in sr.state_entries(h2, comp))
                assert held == sr.state_survives(h2, c, comp, R)
                if c - h2 <= T:
                    assert held


# ------------------------------------------------------------------------------- D8-D9 sharing


def test_sharing_by_hand(v4):
    csa, hca, raw = stream(v4, "L1", "kv"), stream(v4, "L2", "kv"), stream(v4, "L0", "raw")
    assert sr.shared_entries(255, 4) == 63 and sr.shared_entries(256, 4) == 64
    # L = 255: entry 63 (window [252, 256)) crosses L: page 0 is private, entries [0, 63) copied
    assert sr.shared_pages(255, csa, P) == (0, 0, 0, 63)
    assert sr.shared_pages(256, csa, P) == (0, 1, 64, 64)
    assert sr.shared_pages(258, csa, P) == (0, 1, 64, 64)
    assert sr.shared_pages(300, hca, P) == (0, 1, 2, 2)
    assert sr.shared_pages(255, hca, P) == (0, 0, 0, 1)  # entry 1 ([128, 256)) crosses 255
    # a window shares only pages it covers; the page holding L is copied from its live part
    assert sr.shared_pages(700, raw, P) == (2, 2, 512, 700)
    assert sr.shared_pages(768, raw, P) == (2, 3, 768, 768)
    assert sr.committable_pages(700, P) == 2
    assert sr.match_candidates(513, P) == 2 and sr.match_candidates(512, P) == 1
    # the state warm-up of a page-aligned match: the CSA overlap's 4 tokens (HCA tail empty)
    assert sr.warmup_span(512, v4) == (508, 512)
    assert sr.warmup_span(300, v4) == (256, 300)


def test_export_spans_by_hand(v4):
    spans = sr.export_spans(700, v4)
    assert spans[("L0", "raw")] == (512, 700)
    assert spans[("L1", "kv")] == (0, 175) and spans[("L1", "idx")] == (0, 175)
    assert spans[("L2", "kv")] == (0, 5)


# ------------------------------------------------------------------------------- D10 admission


def test_admission_by_hand(v4):
    raw, csa, idx, hca = (v4.pool_key(stream(v4, "L0", "raw")), v4.pool_key(stream(v4, "L1", "kv")),
                          v4.pool_key(stream(v4, "L1", "idx")), v4.pool_key(stream(v4, "L2", "kv")))
    need = sr.admission_pages(v4, 1000)
    assert (need[raw], need[csa], need[idx], need[hca], need["leases"], need["state"]) == \
        (4, 4, 4, 4, 1, 1)
    # chunks of 192 with history advancing: the window holds at most 2 pages
    need = sr.admission_pages(v4, 1000, chunk=192)
    assert (need[raw], need[csa], need[hca]) == (2, 4, 4)
    assert sr.admission_pages(v4, 127)[hca] == 0 and sr.admission_pages(v4, 255)[hca] == 1
    assert sr.admission_pages(v4, 259)[csa] == 1 and sr.admission_pages(v4, 260)[csa] == 2
    available = {raw: 4, csa: 8, idx: 8, hca: 8, "leases": 2, "state": 2}
    assert sr.can_fit(v4, available, 1000, count=2, chunk=192)
    assert not sr.can_fit(v4, available, 1000, count=2)
    assert not sr.can_fit(v4, dict(available, state=1), 10, count=2)


def test_admission_is_the_peak_of_the_prefill(v4):
    for tokens in (1, 127, 128, 255, 256, 257, 700, 1000, 3000):
        for chunk in (None, 64, 192, 256, 500):
            need = sr.admission_pages(v4, tokens, chunk)
            for h, c in sr.prefill_schedule(tokens, chunk):
                for key, n in sr.pages_held(v4, h, c).items():
                    assert n <= need[key]


# ------------------------------------------------------------------------------- transformers


@pytest.fixture(scope="module")
def v4_modules():
    torch = pytest.importorskip("torch")
    m4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    cfg = DeepseekV4Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
        q_lora_rank=16, o_lora_rank=8, o_groups=2, index_n_heads=2, index_head_dim=8,
        index_topk=4, sliding_window=8, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, compress_rates={CSA: 4, HCA: 8}, layer_types=[CSA, HCA])
    torch.manual_seed(0)
    csa, hca = m4.DeepseekV4CSACompressor(cfg).eval(), m4.DeepseekV4HCACompressor(cfg).eval()
    for module in (csa, hca, csa.indexer):
        torch.nn.init.normal_(module.position_bias)  # torch.empty at construction
    return torch, m4, cfg, csa, hca


def _run(torch, module, layer, x, q, chunks):
    """Feed tokens in chunks through a compressor with a V4 cache layer; returns the entries and,
    per call, (tokens so far, entries, tail length, overlap held, block bias)."""
    import types

    pkv, pos, trace = types.SimpleNamespace(layers=[layer]), 0, []
    for n in chunks:
        with torch.no_grad():
            out, bias = module(x[:, pos:pos + n], q[:, pos:pos + n],
                               torch.arange(pos, pos + n).unsqueeze(0), pkv, 0)
        overlap = getattr(layer, "overlap_kv", {}).get("compressor")
        trace.append((pos, pos + n, layer.entry_count["compressor"],
                      layer.buffer_kv["compressor"].shape[1], overlap is not None, bias))
        pos += n
    return out[0, 0], trace


def test_transformers_compressors_follow_d1_d2(v4_modules):
    torch, m4, cfg, csa, hca = v4_modules
    T = 40
    x, q = torch.randn(1, T, 32), torch.randn(1, T, 16)
    chunks = [3, 1, 5, 2, 7, 1, 1, 20]
    for module, cls, rate, overlap in ((csa, m4.DeepseekV4CSACache, 4, 1),
                                       (hca, m4.DeepseekV4HCACache, 8, 0)):
        comp = sr.CompressorSpec("a", "kv", rate, overlap)
        layer = cls(cfg)
        chunked, trace = _run(torch, module, layer, x, q, chunks)
        for start, end, count, tail, has_overlap, bias in trace:
            assert count == sr.entries_final(end, rate)                       # D1
            assert tail == end - sr.entries_final(end, rate) * rate          # D7: the tail
            if overlap:
                assert has_overlap == (count > 0)                            # D7: the overlap
                assert layer.compressed_kv["indexer"] is not None
            if bias is not None:  # the causal rule over the entries (D1)
                for row, t in enumerate(range(start, end)):
                    for i in range(count):
                        visible = bool(torch.isfinite(bias[0, 0, row, i]))
                        if overlap:  # CSA: the indexer's picks, never an unreadable entry
                            assert not visible or sr.readable(t, i, rate)
                        else:
                            assert visible == sr.readable(t, i, rate)
        once, _ = _run(torch, module, cls(cfg), x, q, [T])
        assert torch.allclose(chunked, once, atol=1e-5)  # the carried state is exact
        assert once.shape[0] == sr.entries_final(T, rate)
        # D2: token p changes exactly the entries it feeds
        for p in range(0, T, 3):
            x2 = x.clone()
            x2[0, p] += 1.0
            other, _ = _run(torch, module, cls(cfg), x2, q, [T])
            changed = [i for i in range(once.shape[0]) if not torch.equal(other[i], once[i])]
            assert changed == [i for i in range(once.shape[0])
                               if sr.entry_feeds(i, rate, overlap)[0] <= p
                               < sr.entry_feeds(i, rate, overlap)[1]], (rate, p)


def test_transformers_indexer_keys_have_the_overlap(v4_modules):
    torch, m4, cfg, csa, _ = v4_modules
    T = 24
    x, q = torch.randn(1, T, 32), torch.randn(1, T, 16)
    layer = m4.DeepseekV4CSACache(cfg)
    _run(torch, csa, layer, x, q, [T])
    base = layer.compressed_kv["indexer"][0]
    assert base.shape[0] == sr.entries_final(T, 4) and layer.entry_count["indexer"] == 6
    for p in (0, 5, 13, 23):
        x2 = x.clone()
        x2[0, p] += 1.0
        layer2 = m4.DeepseekV4CSACache(cfg)
        _run(torch, csa, layer2, x2, q, [T])
        other = layer2.compressed_kv["indexer"][0]
        changed = [i for i in range(6) if not torch.equal(other[i], base[i])]
        assert changed == [i for i in range(6) if i * 4 - 4 <= p < i * 4 + 4]


# ------------------------------------------------------------------------------- engine days


def test_engine_days():
    totals = Counter()
    for seed in range(4):
        day = stream_engine.EngineDay(seed, steps=160)
        totals.update(day.run())
    for event in ("admitted", "prefill", "decode", "finished", "matched", "warmups", "forked",
                  "migrated", "suspended", "offloaded", "resumed", "aborted", "refused",
                  "late_accepted", "late_refused", "allocation_failed", "preempted", "evicted"):
        assert totals[event] > 0, event


def prefill(day, req):
    while req.h < len(req.prompt):
        n = min(day.CHUNK, len(req.prompt) - req.h)
        assert day.step(req, req.prompt[req.h:req.h + n], n)
    day.check_all()


def quiet_day():
    return stream_engine.EngineDay(0, steps=0)


def test_fork_at_a_crossing_window():
    """A fork at L = 255: CSA entry 63 ([252, 256)) and HCA entry 1 ([128, 256)) cross L, so page 0
    of both streams (and of the raw window) is the child's own, holding copies of the closed
    entries; parent and child then write their crossing entries from different tokens."""
    day = quiet_day()
    m = day.managers[0]
    parent = day.admit(m, day.fresh(255), 20)
    prefill(day, parent)
    child = day.fork(parent)
    cfg = day.config
    csa_pool, hca_pool = (cfg.pool_key(cfg.stream(("L1", "kv"))),
                          cfg.pool_key(cfg.stream(("L2", "kv"))))
    for key in (csa_pool, hca_pool):
        assert len(child.pages[key]) == 1 and child.pages[key][0] != parent.pages[key][0]
    for _ in range(3):
        for req in (parent, child):
            assert day.step(req, day.fresh(2), 2)
        day.check_all()
    assert child.h == parent.h == 261 and child.tokens[:255] == parent.tokens[:255]
    assert child.tokens != parent.tokens
    # a fork at a page boundary shares page 0 of every full stream by reference
    day2 = quiet_day()
    a = day2.admit(day2.managers[0], day2.fresh(256), 20)
    prefill(day2, a)
    b = day2.fork(a)
    assert b.pages[csa_pool][0] == a.pages[csa_pool][0]
    for req in (a, b):
        assert day2.step(req, day2.fresh(3), 3)
    day2.check_all()


def test_accepting_past_the_flush():
    """SAFE-2 per stream: after a flush to h' = 10, accepting up to 11 is allowed (CSA window
    [8, 12) still open) and up to 12 is refused (entry 2 closed by token 11 is in a cell)."""
    day = quiet_day()
    req = day.admit(day.managers[0], day.fresh(9), 20)
    prefill(day, req)
    assert day.step(req, day.fresh(3), 1, late=12)  # c = 12, h' = 10
    assert req.h == 10 and day.stats["late_refused"] == 1
    day.check_all()
    assert day.step(req, day.fresh(3), 1, late=13)  # c = 13, h' = 11 -> 13 crosses 12
    assert req.h == 11 and day.stats["late_refused"] == 2
    assert day.step(req, day.fresh(4), 1, late=15)  # c = 15, h' = 12 -> 15: window [12, 16) open
    assert req.h == 15 and day.stats["late_accepted"] == 1
    day.check_all()


def test_shared_prefix_warm_up():
    """A request sharing 512 committed tokens shares pages 0-1 of every full stream, the window's
    page 1 only, and rebuilds its CSA overlap by recomputing tokens [508, 512)."""
    day = quiet_day()
    m = day.managers[0]
    a = day.admit(m, day.fresh(600), 10)
    prefill(day, a)
    b = day.admit(m, a.tokens[:520] + day.fresh(30), 10)
    assert b.h == 512 and b.state_cold and day.stats["matched"] == 1
    cfg = day.config
    for s in cfg.streams:
        key = cfg.pool_key(s)
        if s.window:
            assert b.pages[key] == [sr.BAD, a.pages[key][1]]
        else:
            assert b.pages[key] == a.pages[key][:len(b.pages[key])]
    prefill(day, b)
    assert not b.state_cold and day.stats["warmups"] == 1
    for _ in range(4):
        for req in (a, b):
            assert day.step(req, day.fresh(4), 3)
        day.check_all()


def test_export_import_and_offload():
    day = quiet_day()
    a = day.admit(day.managers[0], day.fresh(301), 50)
    prefill(day, a)
    assert day.step(a, day.fresh(2), 2)
    b = day.migrate(a)
    assert b is not None and b.manager is day.managers[1] and b.h == 303
    day.check_all()
    day.suspend(b, offload=True)
    assert b.state_slot is None and b.offloaded
    assert day.resume(b)
    day.check_all()
    for _ in range(5):
        assert day.step(b, day.fresh(4), 2)
    day.check_all()
    day.drain()


# ------------------------------------------------------------------------------- planted faults


def early_existence(c, r):
    return (c + 1) // r  # an entry counted as existing one token before its window closes


def advance_over_last_entry(h_new, written, config):
    # the entry closed by the last accepted token is not required
    return [(s.key, written[s.key], (h_new - 1) // s.rate) for s in config.streams
            if h_new and (h_new - 1) // s.rate > written[s.key]]


def share_crossing_entry(L, r):
    return sr.ceil_div(L, r)  # an entry whose window crosses the shared boundary is shared


def test_fault_entry_exists_early(monkeypatch):
    monkeypatch.setattr(sr, "entries_existing", early_existence)
    day = quiet_day()
    req = day.admit(day.managers[0], day.fresh(10), 20)
    with pytest.raises(AssertionError, match="before its window|never written"):
        prefill(day, req)
        for _ in range(4):
            day.step(req, day.fresh(1), 1)


def test_fault_history_passes_an_unwritten_entry(monkeypatch):
    monkeypatch.setattr(sr, "unwritten_on_advance", advance_over_last_entry)
    day = quiet_day()
    req = day.admit(day.managers[0], day.fresh(9), 20)
    prefill(day, req)
    assert day.step(req, day.fresh(3), 1, late=12)
    assert req.h == 12  # accepted over entry 2, which is only in a cell
    with pytest.raises(AssertionError, match=r"\('L1', 'kv'\): final entry 2 .* = None"):
        day.check_all()


def test_fault_shared_crossing_entry(monkeypatch):
    monkeypatch.setattr(sr, "shared_entries", share_crossing_entry)
    day = quiet_day()
    parent = day.admit(day.managers[0], day.fresh(250), 20)
    prefill(day, parent)
    assert day.step(parent, day.fresh(2), 2) and day.step(parent, day.fresh(3), 3)  # h = 255
    with pytest.raises(AssertionError, match="PFX-3|never written"):
        child = day.fork(parent)
        for req in (parent, child):
            day.step(req, day.fresh(2), 2)


@pytest.mark.parametrize("name, fault", [("entries_existing", early_existence),
                                         ("unwritten_on_advance", advance_over_last_entry),
                                         ("shared_entries", share_crossing_entry)])
def test_faults_fail_a_random_day(monkeypatch, name, fault):
    monkeypatch.setattr(sr, name, fault)
    with pytest.raises(AssertionError):
        for seed in range(4):
            stream_engine.EngineDay(seed, steps=160).run()
