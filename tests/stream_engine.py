"""The engine driver of the stream reference's engine days: a fake engine over one
V4-shaped config that admits, prefills in chunks, decodes (speculatively too), shares prefixes,
forks, exports, offloads and checks every stream against the stand-in model after each step.
The rules (tests/stream_reference.py) are called through the module (``rules.name``), so a test
that replaces one (a planted fault) changes what the day does."""
from __future__ import annotations

import random
from collections import Counter

import stream_reference as rules
from stream_storage import (_SCORE, SEED, Manager, Request, Truth, TruthSeq, compress_parts,
                            mix, next_context, page_key)


class EngineDay:
    """A fake engine over one V4-shaped config and two managers: admits (``can_fit``, prefix
    match), prefills in chunks (host-direct + in-flight entries), decodes with MTP-like accepted
    counts (and, sometimes, asks to accept more after the flush: SAFE-2 decides), preempts (suspend,
    with or without offload) and resumes, moves requests between managers (export/import), forks
    (parallel sampling), aborts, commits and finishes. After every step it checks, for every
    request, that every stream's final entries and every compressor state equal the dense
    recomputation (``TruthSeq``), and while stepping that every read entry is readable (D1, D3) and
    holds the bytes of the step's tokens."""

    CHUNK = 192        # prefill chunk (not a multiple of P: partial pages, crossing windows)
    SYSTEM = (520, 300)  # shared system prompt lengths

    def __init__(self, seed: int, config: rules.StreamConfig = None, steps: int = 200,
                 slots: dict = None, leases: int = 4, state_slots: int = 5, concurrency: int = 7):
        self.rng = random.Random(seed)
        self.config = config or day_config()
        self.truth = Truth(self.config)
        self.steps, self.concurrency = steps, concurrency
        slots = slots or default_slots(self.config)
        self.managers = [Manager(self.config, slots, leases, state_slots) for _ in range(2)]
        self.requests = []          # admitted, not finished
        self.waiting = []           # (prompt, target)
        self.truths = {}
        self.finished = []          # token lists of finished requests (conversations to continue)
        self.next_rid = 0
        self.stats = Counter()
        rng = self.rng
        self.systems = [[rng.randrange(1, 50_000) for _ in range(n)] for n in self.SYSTEM]

    # -------------------------------------------------------------------- the day
    def run(self) -> Counter:
        for _ in range(self.steps):
            self.tick()
        self.drain()
        self.stats["evicted"] = sum(p.evictions for m in self.managers for p in m.pools.values())
        return self.stats

    def tick(self) -> None:
        self.arrivals()
        self.admit_waiting()
        self.random_events()
        for req in list(self.requests):
            if req in self.requests and not req.suspended:
                self.advance_request(req)
        self.resume_some()
        self.check_all()

    def drain(self) -> None:
        """Finish everything: every pool, lease and state slot must come back."""
        for req in list(self.requests):
            if req.suspended:
                if not self.resume(req):
                    self.close(req)
                    continue
            self.finish(req)
        self.requests.clear()
        for m in self.managers:
            for pool in m.pools.values():
                assert all(n == 0 for n in pool.refs), f"leaked pages in {pool.key}"
                assert pool.available() == pool.slots
            assert all(x is None for x in m.leases), "leaked lease"
            assert len(m.state_free) == len(m.state_data), "leaked state slot"

    # -------------------------------------------------------------------- arrivals/admission
    def arrivals(self) -> None:
        rng = self.rng
        while len(self.requests) + len(self.waiting) < self.concurrency:
            kind = rng.random()
            if kind < 0.35:
                prompt = list(rng.choice(self.systems)) + self.fresh(rng.randrange(1, 200))
            elif kind < 0.5 and self.finished:
                prompt = list(rng.choice(self.finished)) + self.fresh(rng.randrange(1, 100))
            else:
                prompt = self.fresh(rng.randrange(1, 700))
            self.waiting.append((prompt, rng.randrange(1, 120)))

    def fresh(self, n: int) -> list:
        return [self.rng.randrange(1, 50_000) for _ in range(n)]

    def admit_waiting(self) -> None:
        for item in list(self.waiting):
            prompt, target = item
            m = self.rng.choice(self.managers)
            if not rules.can_fit(self.config, m.available(), len(prompt), chunk=self.CHUNK):
                self.stats["refused"] += 1
                continue
            self.waiting.remove(item)
            if self.admit(m, prompt, target) is None:
                self.waiting.append(item)

    def new_request(self, prompt, target) -> Request:
        req = Request(self.next_rid, prompt, target)
        self.next_rid += 1
        return req

    def admit(self, m: Manager, prompt, target: int):
        """create_cache(token_ids): share the longest committed prefix (D8), take a lease and a
        state slot. Returns the request, or None when it does not fit."""
        cfg, P = self.config, self.config.tokens_per_page
        req = self.new_request(prompt, target)
        req.manager = m
        L = self.match(m, prompt)
        state = m.take_state()
        if state is None or not m.take_lease(req):
            if state is not None:
                m.give_state(state)
            return None
        req.state_slot = state
        req.pages = {key: [] for key in m.pools}
        if L:
            self.stats["matched"] += 1
            self.stats["matched_tokens"] += L
            keys, prev = [], 0
            for p in range(L // P):
                prev = page_key(prev, prompt[p * P:(p + 1) * P])
                keys.append(prev)
            for key, streams in cfg.pools().items():
                first, ref_end, _, _ = rules.shared_pages(L, streams[0], P)
                table = req.pages[key]
                for p in range(ref_end):
                    if p < first:
                        table.append(rules.BAD)
                    else:
                        slot = m.index[keys[p]][key]
                        m.pools[key].share(slot)
                        table.append(slot)
            req.keys = keys
            req.committed = L // P
            req.state_cold = True
        req.h = req.c = L
        req.tokens = list(prompt[:L])
        for s in cfg.streams:
            req.written[s.key] = req.declared[s.key] = rules.shared_entries(L, s.rate)
        req.admitted_pages = rules.admission_pages(cfg, len(prompt) - L, self.CHUNK) if not L else None
        self.truths[req.rid] = TruthSeq(self.truth, req.tokens)
        self.requests.append(req)
        self.stats["admitted"] += 1
        return req

    def match(self, m: Manager, prompt) -> int:
        """KVCacheManager.match over streams: the longest page-aligned committed prefix, at most
        len(prompt) - 1 tokens, whose pages every full pool holds and whose window pages (PFX-5)
        the windowed pools hold."""
        P = self.config.tokens_per_page
        keys, prev = [], 0
        for p in range(rules.match_candidates(len(prompt), P)):
            prev = page_key(prev, prompt[p * P:(p + 1) * P])
            if prev not in m.index:
                break
            keys.append(prev)
        pools = self.config.pools()
        for n in range(len(keys), 0, -1):
            L = n * P
            ok = True
            for key, streams in pools.items():
                first, ref_end, _, _ = rules.shared_pages(L, streams[0], P)
                if any(key not in m.index[keys[p]] for p in range(first, ref_end)):
                    ok = False
                    break
            if ok:
                return L
        return 0

    # -------------------------------------------------------------------- page tables
    def resize(self, req: Request, c_new: int) -> bool:
        """REQ-1 over streams: hold the pages of (h, c_new); False (nothing changed) when a pool is
        short. Pages past the new end and behind a window are released."""
        m, P = req.manager, self.config.tokens_per_page
        pools = self.config.pools()
        spans = {key: rules.page_span(streams[0], req.h, c_new, P) for key, streams in pools.items()}
        need = {key: max(0, end - max(first, len(req.pages[key])))
                for key, (first, end) in spans.items()}
        if any(m.pools[key].available() < n for key, n in need.items()):
            self.stats["allocation_failed"] += 1
            return False
        for key, (first, end) in spans.items():
            pool, table = m.pools[key], req.pages[key]
            while len(table) < end:
                table.append(pool.allocate(m.index) if len(table) >= first else rules.BAD)
            while len(table) > end:
                slot = table.pop()
                if slot != rules.BAD:
                    pool.release(slot)
            for p in range(min(first, len(table))):
                if table[p] != rules.BAD:
                    pool.release(table[p])
                    table[p] = rules.BAD
        req.c = c_new
        for s in self.config.streams:
            req.written[s.key] = rules.cut_watermark(req.written[s.key], c_new, s)
        if req.admitted_pages is not None and req.h < len(req.prompt):
            for key, (first, end) in spans.items():
                assert end - first <= req.admitted_pages[key], \
                    f"D10: request {req.rid} holds {end - first} pages of {key}, admitted " \
                    f"{req.admitted_pages[key]}"
        return True

    def locate(self, req: Request, stream: rules.StreamSpec, i: int) -> tuple:
        P = self.config.tokens_per_page
        epp = P // stream.rate
        table = req.pages[self.config.pool_key(stream)]
        assert i // epp < len(table), f"{stream.key} entry {i}: no page (capacity {req.c})"
        slot = table[i // epp]
        assert slot != rules.BAD, f"{stream.key} entry {i}: page released (h {req.h})"
        return req.manager.pools[self.config.pool_key(stream)], slot, i % epp

    def store(self, req: Request, stream: rules.StreamSpec, i: int, value: int) -> None:
        pool, slot, idx = self.locate(req, stream, i)
        pool.write(slot, stream.key, idx, value)

    def load(self, req: Request, stream: rules.StreamSpec, i: int) -> int:
        pool, slot, idx = self.locate(req, stream, i)
        value = pool.data[slot][stream.key][idx]
        assert value is not None, f"{stream.key} entry {i}: never written (h {req.h}, c {req.c})"
        return value

    def gather(self, req: Request, stream: rules.StreamSpec, lo: int, hi: int) -> list:
        """Entries [lo, hi) from the request's pages, page by page."""
        if lo >= hi:
            return []
        epp = self.config.tokens_per_page // stream.rate
        key = self.config.pool_key(stream)
        table, pool, out = req.pages[key], req.manager.pools[key], []
        for p in range(lo // epp, rules.ceil_div(hi, epp)):
            assert p < len(table) and table[p] != rules.BAD, \
                f"{stream.key}: page {p} missing (h {req.h}, entries [{lo}, {hi}))"
            a, b = max(lo, p * epp) - p * epp, min(hi, (p + 1) * epp) - p * epp
            out.extend(pool.data[table[p]][stream.key][a:b])
        return out

    # -------------------------------------------------------------------- the model's step
    def context_before(self, req: Request, p: int) -> int:
        """ctx_{p} recovered from layer 0's raw stream (the model's only way to it)."""
        if p < 0:
            return SEED
        stream = self.config.streams[0]
        assert stream.rate == 1
        return self.load(req, stream, p) ^ self.truth.salt[stream.layer]

    def ring(self, req: Request, comp: rules.CompressorSpec) -> list:
        return req.manager.state_data[req.state_slot][comp.key]

    def ring_value(self, ring: list, p: int, j: int) -> int:
        pos, series = ring[p % len(ring)]
        assert pos == p, f"state ring: slot of token {p} holds token {pos}"
        assert series is not None and series[j] is not None, f"state ring: token {p} series {j}"
        return series[j]

    def warm_up(self, req: Request) -> None:
        """D8: rebuild the compressor state of a shared prefix by recomputing warmup_span."""
        lo, hi = rules.warmup_span(req.h, self.config)
        for p in range(lo, hi):
            ctx_p = self.context_before(req, p)
            for comp in self.config.compressors:
                ring = self.ring(req, comp)
                if p >= rules.state_start(hi, comp):
                    ring[p % len(ring)] = (p, tuple(self.truth.proj(comp, j, ctx_p)
                                                    for j in range(comp.series)))
        req.state_cold = False
        self.stats["warmups"] += 1

    def forward(self, req: Request, new_tokens) -> None:
        """The step's forward over tokens [h, c): raw tokens in place, compressor series into the
        ring, entries whose window closes in the step (host-direct, cells or in place)."""
        cfg, truth, h, c = self.config, self.truth, req.h, req.c
        assert c - h == len(new_tokens)
        if req.state_cold:
            self.warm_up(req)
        prev = self.context_before(req, h - 1)
        ctx = []
        for tok in new_tokens:
            prev = next_context(prev, tok)
            ctx.append(prev)
        for s in cfg.streams:
            if s.rate == 1:
                for p in range(h, c):
                    self.store(req, s, p, truth.raw(s.layer, ctx[p - h]))
                continue
            comp = cfg.compressor(s.key)
            ring, r = self.ring(req, comp), comp.rate
            act = [tuple(truth.proj(comp, j, x) for j in range(comp.series)) for x in ctx]
            closes = rules.entries_existing(c, r) > rules.entries_final(h, r)
            # the carried state (D7), read before this step's ring writes can overwrite it
            carried = {(p, j): self.ring_value(ring, p, j)
                       for p, j in rules.state_entries(h, comp)} if closes else {}
            rng = rules.stream_ranges(h, c, s, cfg)
            for p in range(h, c):
                if (p + 1) % r:
                    continue
                i = (p + 1) // r - 1
                parts = []
                for j in range(comp.overlap, -1, -1):
                    w = i - j
                    if w < 0:
                        continue
                    for q in range(w * r, (w + 1) * r):
                        parts.append(act[q - h][j] if q >= h else carried[(q, j)])
                value = compress_parts(truth.lid[comp.layer], truth.cid[comp.key], i, parts)
                if s.sparse and i >= rng.in_flight[0]:
                    assert i < rng.in_flight[1], f"{s.key}: entry {i} past the in-flight range"
                    req.cells[s.key][i] = value
                    assert len(req.cells[s.key]) <= rules.max_inflight_entries(
                        cfg.max_inflight_tokens, r, cfg.entries_per_unit)
                else:
                    self.store(req, s, i, value)
            lo, hi = rules.ring_writes(h, c, len(ring))
            for p in range(lo, hi):
                ring[p % len(ring)] = (p, act[p - h])
        for s in cfg.streams:
            if s.sparse:
                req.declared[s.key] = max(req.declared[s.key], rules.declared_end(h, c, s, cfg))
            else:
                req.written[s.key] = rules.forward_watermark(req.written[s.key], c, s)

    def read_value(self, req: Request, stream: rules.StreamSpec, i: int) -> int:
        """Where a read of entry i goes during the step at (h, c) (D11)."""
        if stream.sparse:
            rng = rules.stream_ranges(req.h, req.c, stream, self.config)
            if rng.in_flight[0] <= i < rng.in_flight[1]:
                value = req.cells[stream.key].get(i)
                assert value is not None, f"{stream.key}: in-flight entry {i} read before written"
                return value
        return self.load(req, stream, i)

    def attend(self, req: Request, step_tokens) -> None:
        """The step's reads for its first and last query token (D11), each checked against the
        dense truth of the step's token sequence and against ``readable``/``window_readable``."""
        cfg, truth = self.config, self.truth
        ts = self.truths[req.rid]
        ctx = ts.step_ctx(step_tokens)
        queries = sorted({req.h, req.c - 1})
        for s in cfg.streams:
            r = s.rate
            if r == 1:
                for t in queries:
                    lo = max(0, t - s.window + 1) if s.window else 0
                    for q in {lo, t, (lo + t) // 2, max(lo, req.h - 1)}:
                        assert rules.window_readable(t, q, s.window)
                        self.compare(req, s, q, truth.value(s, q, ctx), t)
                continue
            if s.sparse:
                continue
            # a dense stream is read whole: every entry the last query may read
            for t in queries:
                valid = rules.entries_existing(t + 1, r)
                assert valid == 0 or rules.readable(t, valid - 1, r), \
                    f"{s.key}: query {t} reads entry {valid - 1} before its window " \
                    f"{rules.entry_window(valid - 1, r)} closed"
            self.dense_values(req, s, rules.entries_existing(queries[-1] + 1, r), ctx)
        for s in cfg.streams:
            if not s.sparse:
                continue
            for t in queries:
                picks = self.indexer(req, s, t, rules.entries_existing(t + 1, s.rate), ctx)
                for i in picks:
                    assert rules.readable(t, i, s.rate), \
                        f"{s.key}: query {t} reads entry {i} before its window " \
                        f"{rules.entry_window(i, s.rate)} closed"
                    want = ts.final(s, i, i + 1)[0] if i < rules.entries_final(req.h, s.rate) \
                        else truth.value(s, i, ctx)
                    self.compare(req, s, i, want, t)
                self.stats["sparse_reads"] += len(picks)

    def dense_values(self, req: Request, stream: rules.StreamSpec, n: int, ctx) -> list:
        """Entries [0, n) of a dense stream as the step reads them: the final ones from their pages
        (check_request compares them every step), the step's own checked here."""
        hr = min(n, rules.entries_final(req.h, stream.rate))
        values = self.gather(req, stream, 0, hr)
        for i in range(hr, n):
            value = self.read_value(req, stream, i)
            want = self.truth.value(stream, i, ctx)
            assert value == want, f"request {req.rid} {stream.key}: entry {i} of the step = " \
                                  f"{value}, expected {want} (h {req.h}, c {req.c})"
            values.append(value)
        return values

    def indexer(self, req: Request, stream: rules.StreamSpec, t: int, valid: int, ctx) -> list:
        """The lightning indexer stand-in: scores its compressed keys (the layer's dense idx
        stream) against query t and keeps the top index_topk, plus the newest readable entry (so
        the read of the newest closed entry is checked every step)."""
        if valid <= 0:
            return []
        keys = self.dense_values(req, self.config.stream((stream.layer, "idx")), valid, ctx)
        q = ctx[t]
        ranked = sorted(range(valid), key=lambda i: mix(_SCORE, keys[i], q))
        return sorted(set(ranked[:self.config.index_topk]) | {valid - 1})

    def compare(self, req, stream, i, expected, t) -> None:
        got = self.read_value(req, stream, i)
        assert got == expected, \
            f"request {req.rid} {stream.key}: query {t} read entry {i} = {got}, expected " \
            f"{expected} (h {req.h}, c {req.c})"

    # -------------------------------------------------------------------- flush / advance
    def flush(self, req: Request, h_new: int) -> None:
        cfg = self.config
        for s in cfg.streams:
            if not s.sparse:
                continue
            lo, hi = rules.flush_range(req.h, req.c, h_new, s, cfg)
            for i in range(lo, hi):
                value = req.cells[s.key].get(i)
                assert value is not None, f"flush of {s.key} entry {i}: not in cells"
                self.store(req, s, i, value)
            req.written[s.key] = rules.flushed_watermark(req.written[s.key], req.declared[s.key],
                                                   req.h, req.c, h_new, s, cfg)

    def advance(self, req: Request, h_new: int, step_tokens) -> bool:
        """resize(history=h'): refused (False, nothing changed) when SAFE-2 finds an unwritten
        closed entry."""
        if h_new < req.h or h_new > req.c:
            return False
        if rules.unwritten_on_advance(h_new, req.written, self.config):
            return False
        accepted = step_tokens[:h_new - req.h]
        req.tokens.extend(accepted)
        self.truths[req.rid].extend(accepted)
        req.h = h_new
        return True

    def step(self, req: Request, step_tokens, accepted: int, late: int = None) -> bool:
        """One step of a seated request: capacity to h + n, forward, reads, flush to h + accepted,
        advance, optionally accept up to ``late`` more (asked after the flush: SAFE-2 decides),
        capacity back to h (rejected tokens dropped), commit. False when the pools are short."""
        h = req.h
        if not self.resize(req, h + len(step_tokens)):
            return False
        self.forward(req, step_tokens)
        self.attend(req, step_tokens)
        h_new = h + accepted
        self.flush(req, h_new)
        assert self.advance(req, h_new, step_tokens), \
            f"SAFE-2 refused the flushed history {h_new}: " \
            f"{rules.unwritten_on_advance(h_new, req.written, self.config)}"
        if late is not None and late > req.h:
            ok = self.advance(req, late, step_tokens[req.h - h:])
            self.stats["late_accepted" if ok else "late_refused"] += 1
        for comp in self.config.compressors:
            assert rules.state_survives(req.h, req.c, comp, len(self.ring(req, comp))), \
                f"D7: {comp.key}: the step to {req.c} overwrote the state of history {req.h}"
        for s in self.config.streams:
            if s.sparse:
                req.cells[s.key] = {}  # the lease's in-flight entries are flushed or dropped
        assert self.resize(req, req.h)
        self.commit(req)
        return True

    def advance_request(self, req: Request) -> None:
        rng = self.rng
        T = self.config.max_query_tokens
        if req.h < len(req.prompt):
            n = min(self.CHUNK, len(req.prompt) - req.h)
            toks, accepted, late = req.prompt[req.h:req.h + n], n, None
            kind = "prefill"
        else:
            n = rng.randint(1, T)
            toks, accepted = self.fresh(n), rng.randint(1, n)
            late = req.h + rng.randint(accepted + 1, n) if accepted < n and rng.random() < 0.3 \
                else None
            kind = "decode"
        if rng.random() < 0.01:
            self.abort(req, toks)
            return
        while not self.step(req, toks, accepted, late):
            victim = self.preemption_victim(req)
            if victim is None:
                self.stats["stalled"] += 1
                return
            self.suspend(victim, offload=True)
            self.stats["preempted"] += 1
        self.stats[kind] += 1
        if req.h >= len(req.prompt) + req.target:
            self.finish(req)

    # -------------------------------------------------------------------- events
    def random_events(self) -> None:
        rng = self.rng
        for req in list(self.requests):
            if req not in self.requests:
                continue
            x = rng.random()
            if req.suspended:
                continue
            if x < 0.02:
                self.suspend(req, offload=rng.random() < 0.6)
            elif x < 0.04:
                self.migrate(req)
            elif x < 0.07 and req.h >= len(req.prompt) and req.h > 0:
                self.fork(req)

    def preemption_victim(self, req: Request):
        seated = [r for r in self.requests
                  if r is not req and r.manager is req.manager and not r.suspended]
        return seated[-1] if seated else None

    def suspend(self, req: Request, offload: bool) -> None:
        """REQ-4 / TIER-1: give up the lease (nothing in flight: h == c); offloaded, the private
        dense pages and the state's live part go to the host tier."""
        assert req.h == req.c and not any(req.cells.values()), "REQ-4: tokens in flight"
        m = req.manager
        m.give_lease(req)
        self.stats["suspended"] += 1
        if not offload:
            return
        moved = {}
        for key, pool in m.pools.items():
            if key[0] != "gpu":
                continue
            table = req.pages[key]
            for p, slot in enumerate(table):
                if slot != rules.BAD and pool.refs[slot] == 1 and pool.commit_key[slot] is None:
                    moved.setdefault(key, {})[p] = {k: list(v) for k, v in pool.data[slot].items()}
                    pool.release(slot)
                    table[p] = rules.BAD
        state = None if req.state_cold else self.export_state(req)
        m.give_state(req.state_slot)
        req.state_slot = None
        req.offloaded = (moved, state)
        self.stats["offloaded"] += 1

    def resume_some(self) -> None:
        for req in list(self.requests):
            if req.suspended and self.rng.random() < 0.3:
                self.resume(req)

    def resume(self, req: Request) -> bool:
        m = req.manager
        need = {}
        if req.offloaded:
            for key, pages in req.offloaded[0].items():
                need[key] = len(pages)
        if any(m.pools[k].available() < n for k, n in need.items()):
            return False
        if req.offloaded and not m.state_free:
            return False
        if not m.take_lease(req):
            return False
        if req.offloaded:
            moved, state = req.offloaded
            for key, pages in moved.items():
                pool = m.pools[key]
                for p, data in pages.items():
                    slot = pool.allocate(m.index)
                    pool.data[slot] = data
                    req.pages[key][p] = slot
            req.state_slot = m.take_state()
            if state is not None:
                self.import_state(req, state)
            req.offloaded = None
        self.stats["resumed"] += 1
        return True

    def export_state(self, req: Request) -> dict:
        return {c.key: tuple((p, j, self.ring_value(self.ring(req, c), p, j))
                             for p, j in rules.state_entries(req.h, c))
                for c in self.config.compressors}

    def import_state(self, req: Request, state: dict) -> None:
        for comp in self.config.compressors:
            ring = self.ring(req, comp)
            for p, j, value in state[comp.key]:
                pos, series = ring[p % len(ring)]
                series = list(series) if pos == p else [None] * comp.series
                series[j] = value
                ring[p % len(ring)] = (p, tuple(series))

    def export(self, req: Request) -> dict:
        """D9 / TIER-2."""
        assert req.h == req.c and not req.state_cold
        spans = rules.export_spans(req.h, self.config)
        return {"history": req.h, "tokens": list(req.tokens),
                "entries": {s.key: (spans[s.key][0], self.gather(req, s, *spans[s.key]))
                            for s in self.config.streams},
                "state": self.export_state(req)}

    def import_record(self, m: Manager, record: dict, prompt, target: int):
        cfg, P, h = self.config, self.config.tokens_per_page, record["history"]
        need = rules.pages_held(cfg, h, h)
        if any(m.pools[k].available() < n for k, n in need.items()) or not m.state_free:
            return None
        req = self.new_request(prompt, target)
        req.manager = m
        if not m.take_lease(req):
            return None
        req.state_slot = m.take_state()
        req.pages = {key: [] for key in m.pools}
        req.h = req.c = h
        for s in cfg.streams:
            req.written[s.key] = req.declared[s.key] = 0
        assert self.resize(req, h)
        for s in cfg.streams:
            first, values = record["entries"][s.key]
            for n, value in enumerate(values):
                self.store(req, s, first + n, value)
            req.written[s.key] = req.declared[s.key] = rules.entries_final(h, s.rate)
        self.import_state(req, record["state"])
        req.tokens = list(record["tokens"])
        self.truths[req.rid] = TruthSeq(self.truth, req.tokens)
        return req

    def migrate(self, req: Request):
        """Export from one manager, import into the other, close the original (TIER-2)."""
        if req.state_cold or req.suspended:
            return None
        other = self.managers[1 - self.managers.index(req.manager)]
        record = self.export(req)
        new = self.import_record(other, record, req.prompt, req.target)
        if new is None:
            return None
        self.requests[self.requests.index(req)] = new
        self.close(req)
        self.stats["migrated"] += 1
        return new

    def fork(self, parent: Request):
        """Parallel sampling from a running request at its history L = h (D8): whole pages shared,
        the closed entries of the page holding L copied, the live state copied."""
        cfg, P, m, L = self.config, self.config.tokens_per_page, parent.manager, parent.h
        if parent.state_cold or parent.suspended:
            return None
        assert parent.h == parent.c
        pools = cfg.pools()
        spans = {key: rules.shared_pages(L, streams[0], P) for key, streams in pools.items()}
        need = {key: max(0, rules.page_span(pools[key][0], L, L, P)[1] - spans[key][1]) for key in pools}
        if any(m.pools[k].available() < n for k, n in need.items()) or not m.state_free:
            return None
        child = self.new_request(parent.tokens, self.rng.randrange(1, 80))
        child.manager, child.parent = m, parent.rid
        if not m.take_lease(child):
            return None
        child.state_slot = m.take_state()
        child.pages = {key: [] for key in m.pools}
        for key, (first, ref_end, lo, hi) in spans.items():
            pool, table = m.pools[key], child.pages[key]
            for p in range(ref_end):
                slot = parent.pages[key][p] if p >= first else rules.BAD
                if slot != rules.BAD:
                    pool.share(slot)
                table.append(slot)
        child.h = child.c = L
        child.tokens = list(parent.tokens)
        for s in cfg.streams:
            child.written[s.key] = child.declared[s.key] = rules.shared_entries(L, s.rate)
        assert self.resize(child, L)  # the private page holding L
        for s in cfg.streams:
            _, _, lo, hi = spans[cfg.pool_key(s)]
            for i in range(lo, hi):
                self.store(child, s, i, self.load(parent, s, i))
        self.import_state(child, self.export_state(parent))
        self.truths[child.rid] = TruthSeq(self.truth, child.tokens)
        self.requests.append(child)
        self.stats["forked"] += 1
        return child

    def commit(self, req: Request) -> None:
        """PFX-1, eagerly after each step: whole pages of history enter the prefix index."""
        m, P = req.manager, self.config.tokens_per_page
        n = rules.committable_pages(req.h, P)
        while req.committed < n:
            p = req.committed
            prev = req.keys[-1] if req.keys else 0
            key = page_key(prev, req.tokens[p * P:(p + 1) * P])
            req.keys.append(key)
            entry = m.index.setdefault(key, {})
            for pool_key, pool in m.pools.items():
                table = req.pages[pool_key]
                slot = table[p] if p < len(table) else rules.BAD
                if slot == rules.BAD or pool_key in entry or pool.commit_key[slot] is not None:
                    continue
                entry[pool_key] = slot
                pool.commit_key[slot] = key
            req.committed += 1

    def abort(self, req: Request, toks) -> None:
        """An abort mid-step: capacity grown, forward run, then the request is dropped: the
        in-flight entries go with the lease."""
        if self.resize(req, req.h + len(toks)):
            self.forward(req, toks)
        self.stats["aborted"] += 1
        self.close(req)

    def finish(self, req: Request) -> None:
        self.commit(req)
        self.finished.append(list(req.tokens))
        self.stats["finished"] += 1
        self.close(req)

    def close(self, req: Request) -> None:
        m = req.manager
        for key, table in req.pages.items():
            for slot in table:
                if slot != rules.BAD:
                    m.pools[key].release(slot)
        req.pages = {key: [] for key in req.pages}
        if req.lease is not None:
            m.give_lease(req)
        if req.state_slot is not None:
            m.give_state(req.state_slot)
            req.state_slot = None
        if req in self.requests:
            self.requests.remove(req)
        self.truths.pop(req.rid, None)

    # -------------------------------------------------------------------- checks
    def check_request(self, req: Request) -> None:
        """Every stream's final entries (the live ones of a window) equal the dense recomputation;
        every watermark covers the history (SAFE-2); the compressor state is the truth's."""
        cfg, P, ts = self.config, self.config.tokens_per_page, self.truths[req.rid]
        assert ts.tokens == req.tokens and len(req.tokens) == req.h
        for s in cfg.streams:
            hr = rules.entries_final(req.h, s.rate)
            if not (req.offloaded and cfg.pool_key(s) in req.offloaded[0]):
                lo = rules.live_first_entry(s, req.h, P)
                got, want = self.gather(req, s, lo, hr), ts.final(s, lo, hr)
                if got != want:
                    bad = next(n for n in range(len(want)) if got[n] != want[n])
                    raise AssertionError(
                        f"request {req.rid} {s.key}: final entry {lo + bad} (window "
                        f"{rules.entry_window(lo + bad, s.rate)}) = {got[bad]}, expected {want[bad]} "
                        f"(h {req.h})")
            assert req.written[s.key] >= hr, f"SAFE-2: {s.key} written {req.written[s.key]} < {hr}"
        if req.state_slot is not None and not req.state_cold:
            for comp in cfg.compressors:
                got = tuple((p, j, self.ring_value(self.ring(req, comp), p, j))
                            for p, j in rules.state_entries(req.h, comp))
                assert got == ts.state(comp, req.h), f"request {req.rid} {comp.key}: state"

    def check_all(self) -> None:
        for req in self.requests:
            self.check_request(req)
        for m in self.managers:
            for key, pool in m.pools.items():
                refs = [0] * pool.slots
                for req in self.requests:
                    if req.manager is m:
                        for slot in req.pages[key]:
                            if slot != rules.BAD:
                                refs[slot] += 1
                assert refs == pool.refs, f"reference counts of {key}"
                assert len(pool.free) + len(pool.cached) + sum(1 for n in refs if n) == pool.slots


def day_config() -> rules.StreamConfig:
    """The engine day's V4-shaped config: a sliding layer, a CSA layer, an HCA layer, a CSA layer
    (window 128, rates 4 and 128, 256-token pages, MTP up to 4 tokens); index_topk scaled to 8."""
    return rules.v4_config([rules.SLIDING, rules.CSA, rules.HCA, rules.CSA], index_topk=8, max_inflight_tokens=16,
                     max_query_tokens=4)


def default_slots(config: rules.StreamConfig) -> dict:
    """Pool sizes that make the day preempt, evict cached prefix pages and refuse admissions."""
    out = {}
    for key in config.pools():
        medium, rate, window, _ = key
        if window:
            out[key] = 7
        elif medium == "host":
            out[key] = 28
        else:
            out[key] = 8
    return out
