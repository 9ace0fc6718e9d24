"""The stand-in model and the storage of the stream reference's engine days
(tests/stream_reference.py holds the rules, tests/stream_engine.py the engine driver): what a
dense recomputation from the token ids gives, and pools, managers and requests that hold every
stream in pages. The rules are called through the module (``rules.name``), so a test that
replaces one (a planted fault) reaches every caller."""
from __future__ import annotations

import heapq
from collections import OrderedDict

import stream_reference as rules


# =============================================================================================
# 7. The stand-in model: what a dense recomputation from the token ids gives
# =============================================================================================
#
# Token p's hidden state is the chained hash ctx_p = mix(ctx_{p-1}, token_p) (a function of every
# token up to p, like a real hidden state). Layer l's raw entry of token p is ctx_p ^ salt(l)
# (invertible: the driver's model recovers ctx_{h-1} from the cache, so a wrong raw page spoils
# everything after it). Series j of compressor k at token p is mix(l, k, j, ctx_p); entry i of a
# compressor is mix(l, k, i, the series feeding it in D2's order). ``Truth`` computes all of it
# densely from the token list; the driver computes it from the cache (ring + pages) and the step's
# new tokens only.

MASK = (1 << 61) - 1
SEED = 0x5EED
_CTX, _PROJ, _ENTRY, _SALT, _PAGE, _SCORE = 1, 2, 3, 4, 5, 6


def mix(*parts) -> int:
    """A deterministic 61-bit hash of ints and tuples of ints."""
    return hash(parts) & MASK


def next_context(prev: int, token: int) -> int:
    return mix(_CTX, prev, token)


def compress_parts(lid: int, cid: int, i: int, parts) -> int:
    return mix(_ENTRY, lid, cid, i, tuple(parts))


class Truth:
    """The stand-in's formulas, evaluated densely."""

    def __init__(self, config: rules.StreamConfig):
        self.config = config
        self.lid = {layer: n for n, layer in enumerate(config.layers())}
        self.cid = {c.key: n for n, c in enumerate(config.compressors)}
        self.salt = {layer: mix(_SALT, n) for layer, n in self.lid.items()}

    def raw(self, layer: str, ctx_p: int) -> int:
        return ctx_p ^ self.salt[layer]

    def proj(self, comp: rules.CompressorSpec, j: int, ctx_p: int) -> int:
        return mix(_PROJ, self.lid[comp.layer], self.cid[comp.key], j, ctx_p)

    def entry(self, comp: rules.CompressorSpec, i: int, ctx) -> int:
        """Entry i from ``ctx`` (indexable by token): series j of window i - j, j = overlap..0."""
        r, parts = comp.rate, []
        for j in range(comp.overlap, -1, -1):
            w = i - j
            if w >= 0:
                parts.extend(self.proj(comp, j, ctx[p]) for p in range(w * r, (w + 1) * r))
        return compress_parts(self.lid[comp.layer], self.cid[comp.key], i, parts)

    def value(self, stream: rules.StreamSpec, i: int, ctx) -> int:
        if stream.rate == 1:
            return self.raw(stream.layer, ctx[i])
        return self.entry(self.config.compressor(stream.key), i, ctx)


class _Ctx:
    """ctx of final tokens followed by a step's tokens, indexable by token position."""

    def __init__(self, final, extra):
        self.final, self.extra, self.n = final, extra, len(final)

    def __getitem__(self, p):
        if p < 0:
            raise IndexError(p)
        return self.final[p] if p < self.n else self.extra[p - self.n]


class TruthSeq:
    """One request's dense recomputation: the contexts of its final tokens and memoised final
    entries per stream (final tokens never change)."""

    def __init__(self, truth: Truth, tokens=()):
        self.truth, self.tokens, self.ctx, self.memo = truth, [], [], {}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        prev = self.ctx[-1] if self.ctx else SEED
        for tok in tokens:
            prev = next_context(prev, tok)
            self.ctx.append(prev)
            self.tokens.append(tok)

    def final(self, stream: rules.StreamSpec, lo: int, hi: int) -> list:
        """Entries [lo, hi) of ``stream`` from the final tokens."""
        assert hi <= rules.entries_final(len(self.tokens), stream.rate), (stream.key, hi)
        memo = self.memo.setdefault(stream.key, [])
        if len(memo) < hi:
            if stream.rate == 1:
                salt = self.truth.salt[stream.layer]
                memo.extend(x ^ salt for x in self.ctx[len(memo):hi])
            else:
                comp = self.truth.config.compressor(stream.key)
                while len(memo) < hi:
                    memo.append(self.truth.entry(comp, len(memo), self.ctx))
        return memo[lo:hi]

    def step_ctx(self, step_tokens) -> _Ctx:
        prev = self.ctx[-1] if self.ctx else SEED
        extra = []
        for tok in step_tokens:
            prev = next_context(prev, tok)
            extra.append(prev)
        return _Ctx(self.ctx, extra)

    def state(self, comp: rules.CompressorSpec, h: int) -> tuple:
        """D7: the live state at h as ((token, series, value), ...)."""
        assert h == len(self.tokens)
        return tuple((p, j, self.truth.proj(comp, j, self.ctx[p]))
                     for p, j in rules.state_entries(h, comp))


# =============================================================================================
# 8. Storage and the engine driver
# =============================================================================================


class Pool:
    """One pool group: slots of one page per coalesced stream; reference counts, committed prefix
    pages kept cached (LRU) when unreferenced (PFX-4); lowest free slot first (STO-5)."""

    def __init__(self, key, streams, slots: int, epp: int):
        self.key, self.slots, self.epp = key, slots, epp
        self.streams = tuple(s.key for s in streams)
        self.data = [None] * slots
        self.refs = [0] * slots
        self.commit_key = [None] * slots
        self.free = list(range(slots))
        self.cached = OrderedDict()
        self.evictions = 0

    def available(self) -> int:
        return len(self.free) + len(self.cached)

    def allocate(self, index: dict) -> int:
        if self.free:
            slot = heapq.heappop(self.free)
        else:
            slot, _ = self.cached.popitem(last=False)
            held = index.get(self.commit_key[slot])
            if held is not None and held.get(self.key) == slot:
                del held[self.key]
            self.commit_key[slot] = None
            self.evictions += 1
        self.refs[slot] = 1
        self.data[slot] = {k: [None] * self.epp for k in self.streams}
        return slot

    def share(self, slot: int) -> None:
        if self.refs[slot] == 0:
            del self.cached[slot]
        self.refs[slot] += 1

    def release(self, slot: int) -> None:
        assert self.refs[slot] > 0, (self.key, slot)
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            if self.commit_key[slot] is not None:
                self.cached[slot] = None
            else:
                self.data[slot] = None
                heapq.heappush(self.free, slot)

    def write(self, slot: int, stream_key, idx: int, value: int) -> None:
        # PFX-3: never write a page that is shared or committed
        assert self.refs[slot] == 1 and self.commit_key[slot] is None, \
            f"PFX-3: write to a shared or committed page (pool {self.key}, slot {slot}, " \
            f"refs {self.refs[slot]}, stream {stream_key}, entry in page {idx})"
        self.data[slot][stream_key][idx] = value


class Manager:
    """The storage of one manager: pools, a prefix index (chained page key -> {pool: slot}),
    leases (rows with cells) and compressor-state slots (one ring per compressor each)."""

    def __init__(self, config: rules.StreamConfig, slots: dict, leases: int, state_slots: int):
        self.config = config
        P = config.tokens_per_page
        self.pools = {key: Pool(key, streams, slots[key], P // streams[0].rate)
                      for key, streams in config.pools().items()}
        self.index = {}
        self.leases = [None] * leases
        self.state_free = list(range(state_slots))
        self.state_data = [None] * state_slots
        self.rings = {c.key: rules.ring_size(c, config.max_query_tokens) for c in config.compressors}

    def available(self) -> dict:
        out = {key: pool.available() for key, pool in self.pools.items()}
        out["leases"] = sum(1 for x in self.leases if x is None)
        out["state"] = len(self.state_free)
        return out

    def take_lease(self, req) -> bool:
        for n, owner in enumerate(self.leases):
            if owner is None:
                self.leases[n] = req.rid
                req.lease = n
                req.cells = {s.key: {} for s in self.config.streams if s.sparse}
                return True
        return False

    def give_lease(self, req) -> None:
        assert self.leases[req.lease] == req.rid
        self.leases[req.lease] = None
        req.lease, req.cells = None, None

    def take_state(self):
        if not self.state_free:
            return None
        slot = heapq.heappop(self.state_free)
        # junk in every ring slot: only the live state may ever be read
        self.state_data[slot] = {k: [(rules.BAD, None)] * R for k, R in self.rings.items()}
        return slot

    def give_state(self, slot) -> None:
        self.state_data[slot] = None
        heapq.heappush(self.state_free, slot)


class Request:
    """One request's handle: lengths, page tables per pool, watermarks, lease and cells, state."""

    def __init__(self, rid: int, prompt, target: int):
        self.rid, self.prompt, self.target = rid, list(prompt), target
        self.tokens = []           # final token ids [0, h)
        self.h = self.c = 0
        self.manager = None
        self.pages = {}
        self.written, self.declared = {}, {}
        self.lease, self.cells = None, None
        self.state_slot, self.state_cold = None, False
        self.offloaded = None      # TIER-1: {pool: {page: {stream: entries}}}, state
        self.committed = 0
        self.keys = []             # chained prefix keys of committed pages
        self.admitted_pages = None  # D10's peak, checked during the prefill
        self.parent = None

    @property
    def suspended(self) -> bool:
        return self.lease is None


def page_key(prev: int, tokens) -> int:
    return mix(_PAGE, prev, tuple(tokens))
