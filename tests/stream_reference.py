"""A plain-Python reference model of request streams with a compression rate (docs/REQUIREMENTS.md
§15g, STR-1..2: DeepSeek-V4's compressed sparse attention through the cache).

Written from docs/REQUIREMENTS.md (§2 vocabulary, §5-§9, §15g), docs/HOST_PATH.md
(the write contract) and the semantics of transformers' DeepSeek-V4 definition
(``transformers/models/deepseek_v4/modeling_deepseek_v4.py``, transformers 5.23.0), whose functions
are named below wherever a rule comes from. Nothing is imported from the library or copied from
another project: it uses Python ints, lists and dicts only. Its tests are
tests/test_stream_reference.py.

The module has three parts: the rules (sections 1-6, pure functions over ints), a deterministic
stand-in model (section 7: what a dense recomputation from the token ids gives) and a small engine
driver (section 8) that stores every stream in pages and cells, runs random "engine days" and
checks the rules after every step.

Vocabulary
==========
A request has a history ``h`` (tokens ``[0, h)`` are final) and a capacity ``c`` (tokens ``[h, c)``
are being written by the current step), as in REQ-1. It owns one **stream** per buffer. A stream of
**rate** ``r`` holds one **entry** per ``r`` tokens; entry ``i``'s **window** is tokens
``[i*r, (i+1)*r)``. A raw stream has ``r = 1`` (an entry is a token). A compressed stream is fed by
a **compressor**, which keeps a small per-request **state** between steps.

Decisions (what the requirements leave open)
=====================================
D1  Existence. Entry ``i`` is written when its window closes -- by the step that processes token
    ``(i+1)*r - 1`` -- and never before. It exists for capacity ``c`` iff ``(i+1)*r <= c``
    (``c_r = c // r``, ``entries_existing``). It is final for history ``h`` iff ``(i+1)*r <= h``
    (``h_r = h // r``, ``entries_final``). Every token boundary ``b`` maps to the entry boundary
    ``b // r``, and every range of the write contract maps that way. Query token ``t`` may read
    entry ``i`` iff ``(i+1)*r <= t + 1`` (``readable``). From
    ``DeepseekV4HCACache.store_compression_weights`` (only the longest multiple of
    ``compress_rate`` is compressed; the rest stays in ``buffer_kv``/``buffer_gate``),
    ``DeepseekV4HCACache.update_compressor_states`` (``entry_count``), and the causal threshold
    ``(position_ids + 1) // compress_rate`` of ``DeepseekV4HCACompressor.forward`` and
    ``DeepseekV4Indexer.forward`` (query ``t`` sees entry ``w`` iff ``w < (t+1) // r``;
    ``DeepseekV4CSACompressor.forward`` masks the indexer's picks with it).
D2  Overlap. A CSA entry (rate 4) is a softmax-gated sum over ``2r`` token slots: series ``Ca``
    (``[..., :head_dim]`` of ``kv_proj``/``gate_proj``) of window ``i-1`` and series ``Cb``
    (``[..., head_dim:]``) of window ``i``; entry 0 has no ``Ca`` half (zero kv, -inf gate: weight
    0). So entry ``i`` *depends on* tokens ``[max(0, (i-1)*r), (i+1)*r)`` (``entry_feeds``) but is
    *written* by the same rule as D1: its own window's close. The overlap changes what feeds an
    entry and what the compressor must carry, never when an entry exists. From
    ``DeepseekV4CSACompressor.forward``
    (``new_kv[:, 1:, :ratio] = chunk_kv[:, :-1, :, :head_dim]``) and
    ``DeepseekV4CSACache.update_overlap_state``. The indexer's compressed keys
    (``DeepseekV4Indexer.forward``) are a second rate-4 compressor with the same overlap, at
    ``index_head_dim``. HCA (``DeepseekV4HCACompressor.forward``) has no overlap. Here ``overlap``
    counts earlier windows feeding an entry (CSA 1, HCA 0); series ``j`` of window ``w`` feeds
    entry ``w + j`` (``j = 0`` is ``Cb``, ``j = 1`` is ``Ca``). (Entry ``i``'s RoPE position is
    ``i*r``: position-dependent bytes, so entries are never reused at another position.)
D3  Raw window. Every V4 attention layer, sliding, CSA or HCA, attends over a sliding window of raw
    tokens: ``DeepseekV4HCACache.update`` keeps the last ``sliding_window - 1`` tokens, and the
    mask (``sliding_window_overlay``: ``kv > q - W``) lets query ``t`` read tokens ``[t-W+1, t]``
    (``window_readable``). Each layer therefore has a rate-1 dense windowed stream ``raw``; pages
    wholly before ``h - W`` are released (REQ-3). V4's sinks are per-head logits
    (``DeepseekV4Attention.sinks``), not sink tokens: no sink pages.
D4  Layout. Every stream uses pages of ``P`` tokens (``tokens_per_page``, 256 as in the engines'
    "584-byte entry on 256-token pages"), so a stream of rate ``r`` holds ``P // r`` entries per
    page (CSA 64, HCA 2, raw 256) and page ``p`` of every stream covers the same tokens
    ``[p*P, (p+1)*P)``: one token-page index serves all streams, and prefix keys stay per token
    page. ``P % r == 0`` is required, so no entry crosses a page. A compressed stream holds a page
    only once its first entry exists (pages ``ceil(c_r / (P/r))``). Pool groups are keyed by
    (medium, rate, window, entry bytes): streams of different rates never share a slot, as their
    page counts differ.
D5  Write paths. Sparse streams (CSA entries) live in host pages + cells, as REQUIREMENTS §8: with the
    stream's selection shape in tokens ``(U*r, I)`` (``U`` entries per unit; V4's indexer selects
    single entries, ``U = 1``), the in-flight start ``s0 = max(h, floor((c-I)/(U*r))*U*r)`` maps to
    entries: ``[h_r, s0//r)`` are written straight to host pages (declared), ``[s0//r, c_r)`` into
    cells and flushed (``stream_ranges``). An entry is written whole, once, so no unit is ever
    partly written and nothing is fetched for a head unit (with ``U = 1``). Dense streams (HCA
    entries, the indexer's compressed keys, the raw window) are written in place in GPU pages by
    the step's forward; they have no flush.
D6  Watermarks and SAFE-2. Each stream has a written watermark in entries: ``[0, w)`` hold the
    bytes of the request's current tokens on their final storage. A flush to ``h'`` moves a sparse
    stream's ``w`` to ``min(h', c) // r`` when everything below its in-flight start was written or
    declared (``flushed_watermark``, the token rule of HOST_PATH §1 mapped by ``// r``); a dense
    stream's ``w`` becomes ``c // r`` once the forward ran (``forward_watermark``); cutting
    capacity to ``c'`` cuts ``w`` to ``c' // r``. History may advance to ``h'`` only when, for
    every stream, ``h' // r <= w`` (``unwritten_on_advance``): every *closed* entry is written;
    tokens whose window is still open need nothing but the compressor state (``advance_limit`` =
    ``min(c, (w+1)*r - 1)`` over streams).
D7  Compressor state. Per request and compressor the live state at history ``h`` is the projections
    of tokens ``[state_start(h), h)`` with ``state_start(h) = max(0, (h//r - overlap)*r)``: the
    tail (every series of the ``h mod r`` tokens of the open window: ``buffer_kv``/``buffer_gate``)
    and, for CSA, the overlap (series ``Ca`` of the last closed window:
    ``overlap_kv``/``overlap_gate``) (``state_entries``, ``state_bytes``). It is a dense
    per-request GPU buffer: a ring of ``ring_size = (overlap+1)*r - 1 + T`` token slots (``T`` =
    max query tokens), token ``p`` in slot ``p mod R``, written like KV: each step writes the
    projections of tokens ``[max(h, c-R), c)``. The state at any ``h'`` with ``c - h' <= T`` stays
    readable after the step (``state_survives``), so speculative tokens that are rejected need no
    snapshot (transformers' accumulate-and-drain buffer is not rewindable:
    ``DeepseekV4PreTrainedModel._is_stateful = True``). A step cut back by more than ``T`` tokens
    after its forward (a long prefill not accepted) has overwritten the state of its old history:
    such a request is closed (abort), never continued. Export, import, offload and fork carry the
    live state (``state_entries``' values, at most ``max_state_bytes``); a resumed or imported
    request must have it before its next forward. The state is dense and per request: it is neither
    paged, shared nor flushed.
D8  Sharing. A prefix of ``L`` shared tokens shares ``L // r`` entries of a stream
    (``shared_entries``): an entry whose window crosses ``L`` belongs to the sharer. Pages
    ``[0, (L//r) // (P/r))`` are shared by reference; the closed entries of the page holding ``L``
    are copied into a private page (``shared_pages``); a windowed stream shares only pages its
    window covers (PFX-5). Committed prefixes are matched at page boundaries (``L % P == 0``, at
    most ``len(prompt) - 1`` tokens, so the last prompt token is computed), where every window is
    closed for every rate (``P % r == 0``). The compressor state at ``L`` is not in any page (the
    CSA overlap is a projection of tokens ``[L-4, L)``, lossy-compressed into entry ``L/4 - 1``): a
    request that shares a committed prefix recomputes it by a state-only warm-up over tokens
    ``warmup_span(L)`` = ``[min state_start(L), L)`` (4 tokens for V4 at a page boundary: the HCA
    tail is empty there), writing only its ring. A fork (parallel sampling from a running request
    at its ``h``) copies the parent's live state instead.
D9  Export/import (TIER-2). Allowed with nothing in flight (``h == c``). The record carries the
    tokens, ``h``, every stream's entries ``[first, h_r)`` (``first = 0``, or the window's first
    live token for a windowed stream) and every compressor's live state (D7). Import gives
    ``c = h``, ``w = declared = h_r``.
D10 Admission (STO-8). A request of ``tokens`` tokens prefilled in chunks of ``chunk`` tokens
    (history advancing after each chunk) needs, per pool, the peak over its chunks of the pages it
    holds (``admission_pages``): ``ceil((c//r) / (P/r))`` for full streams (peak at the end), the
    window's live pages ``[first_live_page(h), ceil(c/P))`` for the raw window stream
    (``ceil(tokens/P)`` without chunking, as the library's ``can_fit``), one lease and one
    compressor-state slot. A suspended request gives up its lease and keeps its pages (REQ-4);
    offloaded (TIER-1) it also gives up its private, uncommitted GPU pages and its state slot,
    whose live part goes to the host tier with them.
D11 Reads. CSA: per query token the indexer scores its compressed keys (the dense ``idx`` stream,
    read whole) and picks the top ``index_topk`` readable entries (``DeepseekV4Indexer.forward``:
    padding ``-1`` for unreadable picks); HCA: every readable entry; raw: the window. A read entry
    is final (host or GPU page), in flight (cells for sparse, the page for dense) or written
    host-direct this step (a prefill reads it from its activations; the same bytes).

Where DeepSeek-V4 does not fit "a stream with a compression rate" alone
=======================================================================
* The window belongs to a buffer, not a layer: a CSA layer holds a windowed dense raw stream, a
  full sparse entry stream and a full dense indexer-key stream, and an HCA layer a windowed raw
  stream beside a full dense one, so a per-layer ``window`` (and life cycle) cannot describe it.
* An entry depends on more than its window (D2): the overlap is carried in compressor state that no
  page holds, so a shared prefix needs a state rebuild (D8) and an export needs the state (D9).
* The compressor state is not small for HCA: up to 127 tokens x (kv + gate) x 512 features = 254
  KiB per HCA layer per request in bf16 (``max_state_bytes``), more than the 128-token raw window
  at 584 B a token (73 KiB); CSA's is 20 KiB plus 5 KiB for the indexer.
* The stock state is a drain buffer (``store_compression_weights`` / ``update_overlap_state``), not
  position-addressed, and the model is ``_is_stateful``: MTP rejection needs D7's ring (or a
  snapshot per step).
* The indexer selects entries, not tokens: a sparse stream's unit, selection and write indices are
  in entry ordinals (token boundary b -> b // r), and an in-flight entry is written whole (no
  partly written head unit to fetch).
* Rebuilding the state of a shared prefix (D8) runs the model over the last tokens, since the
  compressor reads the layer's hidden states, not anything a cache holds.
"""
from __future__ import annotations

import heapq
import random
from collections import Counter, OrderedDict
from dataclasses import dataclass
from functools import cached_property

BAD = -1
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
SLIDING = "sliding_attention"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# =============================================================================================
# 1. Configuration: streams, compressors, pool groups
# =============================================================================================


@dataclass(frozen=True)
class StreamSpec:
    """One buffer of one layer: a stream of ``rate`` tokens per entry (1 = raw tokens)."""

    layer: str
    name: str
    rate: int = 1
    overlap: int = 0          # earlier windows feeding an entry (CSA 1, HCA 0; D2)
    sparse: bool = False      # host pages + cells (CSA entries) or dense GPU pages
    window: int | None = None  # raw tokens a query reads back (sliding window), None = all
    entry_bytes: int = 0

    @cached_property
    def key(self) -> tuple:
        return (self.layer, self.name)


@dataclass(frozen=True)
class CompressorSpec:
    """The compressor writing stream ``(layer, name)``; ``series_bytes`` = bytes of one series
    (kv + gate projections) of one token."""

    layer: str
    name: str
    rate: int
    overlap: int
    series_bytes: int = 0

    @cached_property
    def key(self) -> tuple:
        return (self.layer, self.name)

    @property
    def series(self) -> int:
        """Series per token: series j of window w feeds entry w + j (CSA: Cb, Ca; HCA: one)."""
        return self.overlap + 1


@dataclass(frozen=True)
class StreamConfig:
    """A request's streams. ``max_inflight_tokens`` (I) and ``entries_per_unit`` (U) are the sparse
    streams' selection shape, ``max_query_tokens`` (T) the most tokens a step may reject + 1."""

    tokens_per_page: int
    streams: tuple
    compressors: tuple = ()
    max_inflight_tokens: int = 16
    entries_per_unit: int = 1
    max_query_tokens: int = 1
    index_topk: int = 512

    def __post_init__(self):
        P = self.tokens_per_page
        if P <= 0:
            raise ValueError("tokens_per_page must be positive")
        if self.max_inflight_tokens < self.max_query_tokens or self.max_query_tokens < 1:
            raise ValueError("MTP-1: need 1 <= max_query_tokens <= max_inflight_tokens")
        if self.entries_per_unit < 1:
            raise ValueError("entries_per_unit must be positive")
        keys = [s.key for s in self.streams]
        if len(set(keys)) != len(keys):
            raise ValueError("stream keys (layer, name) must be unique")
        comps = {c.key: c for c in self.compressors}
        if len(comps) != len(self.compressors):
            raise ValueError("one compressor per stream")
        for s in self.streams:
            where = f"stream {s.layer}.{s.name}"
            if s.rate < 1 or P % s.rate:
                raise ValueError(f"{where}: rate {s.rate} must divide tokens_per_page {P} (D4)")
            if s.window is not None and (s.rate != 1 or s.window <= 0 or s.sparse):
                raise ValueError(f"{where}: a window is a dense raw (rate 1) stream's (D3)")
            if s.sparse and P % (s.rate * self.entries_per_unit):
                raise ValueError(f"{where}: a unit of {self.entries_per_unit} entries must fit "
                                 f"a page")
            comp = comps.get(s.key)
            if s.rate == 1:
                if s.overlap or comp is not None:
                    raise ValueError(f"{where}: a raw stream has no compressor or overlap")
            elif comp is None or comp.rate != s.rate or comp.overlap != s.overlap:
                raise ValueError(f"{where}: a compressed stream needs a compressor of its rate "
                                 f"and overlap")
        for c in self.compressors:
            if c.key not in keys:
                raise ValueError(f"compressor {c.layer}.{c.name} feeds no stream")

    # -- lookups -------------------------------------------------------------------------
    def stream(self, key) -> StreamSpec:
        for s in self.streams:
            if s.key == key:
                return s
        raise KeyError(key)

    def compressor(self, key) -> CompressorSpec:
        for c in self.compressors:
            if c.key == key:
                return c
        raise KeyError(key)

    def layers(self) -> tuple:
        return tuple(dict.fromkeys(s.layer for s in self.streams))

    def entries_per_page(self, stream: StreamSpec) -> int:
        return self.tokens_per_page // stream.rate

    def pool_key(self, stream: StreamSpec) -> tuple:
        """D4: (medium, rate, window, entry bytes)."""
        return ("host" if stream.sparse else "gpu", stream.rate, stream.window, stream.entry_bytes)

    def pools(self) -> dict:
        """Pool key -> the streams coalesced in its slots (a slot holds one page of each)."""
        out = {}
        for s in self.streams:
            out.setdefault(self.pool_key(s), []).append(s)
        return {k: tuple(v) for k, v in out.items()}

    def unit_tokens(self, stream: StreamSpec) -> int:
        return self.entries_per_unit * stream.rate


def v4_config(layer_types, *, tokens_per_page=256, sliding_window=128, compress_rates=None,
              index_topk=512, max_inflight_tokens=16, max_query_tokens=4, entry_bytes=584,
              indexer_key_bytes=132, head_dim=512, index_head_dim=128, state_dtype_bytes=2):
    """A DeepSeek-V4-shaped config from ``layer_types`` (``DeepseekV4Config.layer_types``): every
    layer a raw window stream (D3); CSA layers a sparse ``kv`` stream (584-B entries) and a dense
    ``idx`` stream (the indexer's 132-B compressed keys), both rate 4 with overlap 1; HCA layers a
    dense rate-128 ``kv`` stream. Compressor series bytes: kv + gate of ``2*head_dim`` features for
    CSA (``DeepseekV4CSACompressor.kv_proj``: ``2 * head_dim`` outputs = two series of
    ``head_dim``), ``head_dim`` for HCA, at ``state_dtype_bytes`` each."""
    rates = {CSA: 4, HCA: 128}
    rates.update(compress_rates or {})
    streams, comps = [], []
    for n, kind in enumerate(layer_types):
        layer = f"L{n}"
        streams.append(StreamSpec(layer, "raw", 1, 0, False, sliding_window, entry_bytes))
        if kind == CSA:
            r = rates[CSA]
            streams.append(StreamSpec(layer, "kv", r, 1, True, None, entry_bytes))
            streams.append(StreamSpec(layer, "idx", r, 1, False, None, indexer_key_bytes))
            comps.append(CompressorSpec(layer, "kv", r, 1, 2 * head_dim * state_dtype_bytes))
            comps.append(CompressorSpec(layer, "idx", r, 1,
                                        2 * index_head_dim * state_dtype_bytes))
        elif kind == HCA:
            r = rates[HCA]
            streams.append(StreamSpec(layer, "kv", r, 0, False, None, entry_bytes))
            comps.append(CompressorSpec(layer, "kv", r, 0, 2 * head_dim * state_dtype_bytes))
        elif kind != SLIDING:
            raise ValueError(f"unknown layer type {kind!r}")
    return StreamConfig(tokens_per_page, tuple(streams), tuple(comps), max_inflight_tokens, 1,
                        max_query_tokens, index_topk)


# =============================================================================================
# 2. Entry lengths (D1, D2, D3)
# =============================================================================================


def entries_final(h: int, r: int) -> int:
    """h_r: entries whose window closed within the history [0, h)."""
    return h // r


def entries_existing(c: int, r: int) -> int:
    """c_r: entries whose window closed within [0, c) -- written by the step that reaches c."""
    return c // r


def entry_window(i: int, r: int) -> tuple:
    return i * r, (i + 1) * r


def entry_feeds(i: int, r: int, overlap: int) -> tuple:
    """The tokens entry i depends on: its window and ``overlap`` windows before it (D2)."""
    return max(0, (i - overlap) * r), (i + 1) * r


def closing_token(i: int, r: int) -> int:
    """The token whose arrival closes entry i's window (the entry is written in its step)."""
    return (i + 1) * r - 1


def readable(t: int, i: int, r: int) -> bool:
    """Whether query token t may read entry i: its window closed at or before t (D1)."""
    return i >= 0 and closing_token(i, r) <= t


def window_readable(t: int, q: int, window) -> bool:
    """Whether query token t reads raw token q of a window of ``window`` tokens (D3)."""
    return 0 <= q <= t and (window is None or q > t - window)


def first_live_page(h: int, P: int, window) -> int:
    """REQ-3: pages wholly before h - window are released (0 without a window)."""
    if not window or h <= window:
        return 0
    return (h - window) // P


def inflight_start(h: int, c: int, unit_tokens: int, I: int) -> int:
    """REQUIREMENTS §2: s0 = max(h, floor((c - I) / U) * U), U in tokens."""
    return max(h, (c - I) // unit_tokens * unit_tokens)


def max_inflight_entries(I: int, r: int, U: int = 1) -> int:
    """The most entries of a sparse stream in cells at once: floor((I + U*r - 1) / r)."""
    return (I + U * r - 1) // r


@dataclass(frozen=True)
class StreamRanges:
    """One step's ranges of one stream, in entries; ``open`` in tokens (the open window, held by
    the compressor state only). ``in_cells``: the in-flight entries are in cells (sparse) rather
    than written in place (dense)."""

    final: tuple
    host_direct: tuple
    in_flight: tuple
    open: tuple
    in_cells: bool


def stream_ranges(h: int, c: int, stream: StreamSpec, config: StreamConfig) -> StreamRanges:
    """D5: the step's ranges of ``stream`` at lengths (h, c)."""
    r = stream.rate
    hr, cr = entries_final(h, r), entries_existing(c, r)
    if stream.sparse:
        s0 = inflight_start(h, c, config.unit_tokens(stream), config.max_inflight_tokens)
        mid = max(hr, s0 // r)
    else:
        mid = hr
    return StreamRanges((0, hr), (hr, mid), (mid, cr), (cr * r, c), stream.sparse)


def page_span(stream: StreamSpec, h: int, c: int, P: int) -> tuple:
    """D4 / REQ-3: the page ordinals [first, end) a request holds for ``stream`` at (h, c)."""
    end = ceil_div(entries_existing(c, stream.rate), P // stream.rate)
    first = min(first_live_page(h, P, stream.window), end) if stream.window else 0
    return first, end


def live_first_entry(stream: StreamSpec, h: int, P: int) -> int:
    """The first entry a request still holds (0, or the first token of a windowed stream's first
    live page)."""
    if not stream.window:
        return 0
    return first_live_page(h, P, stream.window) * (P // stream.rate)


# =============================================================================================
# 3. The write contract per stream (D5, D6)
# =============================================================================================


def declared_end(h: int, c: int, stream: StreamSpec, config: StreamConfig) -> int:
    """The entries a step writes straight to host pages and declares: up to the host-direct end."""
    return stream_ranges(h, c, stream, config).host_direct[1]


def flush_range(h: int, c: int, h_new: int, stream: StreamSpec, config: StreamConfig) -> tuple:
    """OP-FLUSH per stream: the in-flight entries below the new history, [max(h, s0), min(h', c))
    mapped by // r. Empty for dense streams (written in place)."""
    if not stream.sparse:
        return (0, 0)
    lo = stream_ranges(h, c, stream, config).in_flight[0]
    hi = entries_final(min(h_new, c), stream.rate)
    return (lo, max(lo, hi))


def flushed_watermark(written: int, declared: int, h: int, c: int, h_new: int,
                      stream: StreamSpec, config: StreamConfig) -> int:
    """D6, sparse: after a flush to h', entries up to min(h', c) // r are on host pages when every
    entry below the in-flight range already was (written) or was declared."""
    lo = stream_ranges(h, c, stream, config).in_flight[0]
    if max(written, declared) >= lo:
        return max(written, entries_final(min(h_new, c), stream.rate))
    return written


def forward_watermark(written: int, c: int, stream: StreamSpec) -> int:
    """D6, dense: the forward wrote every entry that exists at capacity c, in place."""
    return max(written, entries_existing(c, stream.rate))


def cut_watermark(written: int, c_new: int, stream: StreamSpec) -> int:
    """D6: cutting capacity to c' drops entries past c' // r (rejected tokens' entries)."""
    return min(written, entries_existing(c_new, stream.rate))


def unwritten_on_advance(h_new: int, written: dict, config: StreamConfig) -> list:
    """SAFE-2 per stream: the entries [w, h' // r) an advance to h' would make final without their
    bytes written, as ``(stream key, lo, hi)``; empty when the advance is allowed. Entries whose
    window is still open at h' are not required."""
    out = []
    for s in config.streams:
        need = entries_final(h_new, s.rate)
        if need > written[s.key]:
            out.append((s.key, written[s.key], need))
    return out


def advance_limit(c: int, written: dict, config: StreamConfig) -> int:
    """The furthest history SAFE-2 allows: min(c, (w + 1) * r - 1) over the streams."""
    limit = c
    for s in config.streams:
        limit = min(limit, (written[s.key] + 1) * s.rate - 1)
    return limit


# =============================================================================================
# 4. Compressor state (D7)
# =============================================================================================


def state_start(h: int, comp: CompressorSpec) -> int:
    return max(0, (h // comp.rate - comp.overlap) * comp.rate)


def state_entries(h: int, comp: CompressorSpec) -> list:
    """The live state at history h as (token, series) pairs: series j of token p (window
    w = p // r) is live iff it feeds an entry not yet closed, w + j >= h // r. The tail holds every
    series of the open window's tokens, the overlap series Ca (j = 1) of the last closed window."""
    r, open_window = comp.rate, h // comp.rate
    return [(p, j) for p in range(state_start(h, comp), h)
            for j in range(comp.series) if p // r + j >= open_window]


def state_bytes(h: int, comp: CompressorSpec) -> int:
    return len(state_entries(h, comp)) * comp.series_bytes


def max_state_bytes(comp: CompressorSpec) -> int:
    """The largest live state (at h = (overlap + 1) * r - 1)."""
    return state_bytes((comp.overlap + 1) * comp.rate - 1, comp)


def ring_size(comp: CompressorSpec, max_query_tokens: int) -> int:
    """D7: token slots of the rewindable state ring."""
    return (comp.overlap + 1) * comp.rate - 1 + max_query_tokens


def ring_writes(h: int, c: int, R: int) -> tuple:
    """The tokens a step at (h, c) writes into a ring of R slots: [max(h, c - R), c)."""
    return max(h, c - R), c


def state_survives(h_new: int, c: int, comp: CompressorSpec, R: int) -> bool:
    """Whether a ring of R slots still holds the live state of h' after a step that wrote tokens
    [h, c): every live token p of h' satisfies p >= c - R (older ones were overwritten). True for
    every h' with c - h' <= T when R = ring_size (D7); a step cut back by more (a long prefill
    whose tokens are not accepted) has lost the state of its old history."""
    return all(p >= c - R for p, _ in state_entries(h_new, comp))


def warmup_span(L: int, config: StreamConfig) -> tuple:
    """D8: the tokens a request that shares L committed tokens recomputes (state only)."""
    start = min((state_start(L, c) for c in config.compressors), default=L)
    return start, L


# =============================================================================================
# 5. Sharing and export (D8, D9)
# =============================================================================================


def shared_entries(L: int, r: int) -> int:
    """Entries of a stream shared by a prefix of L tokens: those whose window closed within L."""
    return L // r


def shared_pages(L: int, stream: StreamSpec, P: int) -> tuple:
    """D8: ``(first, ref_end, copy_lo, copy_hi)``: pages [first, ref_end) are shared by reference,
    entries [copy_lo, copy_hi) (closed, in the page holding L) copied into a private page; pages
    before ``first`` (behind a window) are not needed."""
    epp = P // stream.rate
    n = shared_entries(L, stream.rate)
    ref_end = n // epp
    first = min(first_live_page(L, P, stream.window), ref_end) if stream.window else 0
    lo = max(ref_end * epp, live_first_entry(stream, L, P))
    return first, ref_end, lo, max(lo, n)


def committable_pages(h: int, P: int) -> int:
    """PFX-1: whole pages of history; with P % r == 0 every entry of them is closed and final."""
    return h // P


def match_candidates(prompt_len: int, P: int) -> int:
    """D8: the most whole pages a match may share (at most prompt_len - 1 tokens)."""
    return max(0, prompt_len - 1) // P


def export_spans(h: int, config: StreamConfig) -> dict:
    """D9: per stream the entries [first, h_r) a record carries."""
    P = config.tokens_per_page
    return {s.key: (live_first_entry(s, h, P), entries_final(h, s.rate)) for s in config.streams}


# =============================================================================================
# 6. Admission (D10)
# =============================================================================================


def prefill_schedule(tokens: int, chunk=None) -> list:
    """The (h, c) of each chunk of a prefill of ``tokens`` tokens, history advancing after each."""
    if chunk is None or chunk >= tokens:
        return [(0, tokens)]
    return [(h, min(tokens, h + chunk)) for h in range(0, tokens, chunk)]


def pages_held(config: StreamConfig, h: int, c: int) -> dict:
    """Pages per pool at lengths (h, c) (the coalesced streams of a pool hold equal spans)."""
    out = {}
    for key, streams in config.pools().items():
        first, end = page_span(streams[0], h, c, config.tokens_per_page)
        out[key] = end - first
    return out


def admission_pages(config: StreamConfig, tokens: int, chunk=None) -> dict:
    """D10: per pool the peak pages over the chunked prefill; plus one lease and one state slot."""
    peak = {key: 0 for key in config.pools()}
    for h, c in prefill_schedule(tokens, chunk):
        for key, n in pages_held(config, h, c).items():
            peak[key] = max(peak[key], n)
    peak["leases"] = 1
    peak["state"] = 1 if config.compressors else 0
    return peak


def can_fit(config: StreamConfig, available: dict, tokens: int, count: int = 1,
            chunk=None) -> bool:
    """STO-8 over streams: whether ``count`` requests of ``tokens`` tokens fit ``available``
    (free + cached slots per pool, free leases, free state slots)."""
    need = admission_pages(config, tokens, chunk)
    return all(available.get(key, 0) >= n * count for key, n in need.items())


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

    def __init__(self, config: StreamConfig):
        self.config = config
        self.lid = {layer: n for n, layer in enumerate(config.layers())}
        self.cid = {c.key: n for n, c in enumerate(config.compressors)}
        self.salt = {layer: mix(_SALT, n) for layer, n in self.lid.items()}

    def raw(self, layer: str, ctx_p: int) -> int:
        return ctx_p ^ self.salt[layer]

    def proj(self, comp: CompressorSpec, j: int, ctx_p: int) -> int:
        return mix(_PROJ, self.lid[comp.layer], self.cid[comp.key], j, ctx_p)

    def entry(self, comp: CompressorSpec, i: int, ctx) -> int:
        """Entry i from ``ctx`` (indexable by token): series j of window i - j, j = overlap..0."""
        r, parts = comp.rate, []
        for j in range(comp.overlap, -1, -1):
            w = i - j
            if w >= 0:
                parts.extend(self.proj(comp, j, ctx[p]) for p in range(w * r, (w + 1) * r))
        return compress_parts(self.lid[comp.layer], self.cid[comp.key], i, parts)

    def value(self, stream: StreamSpec, i: int, ctx) -> int:
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

    def final(self, stream: StreamSpec, lo: int, hi: int) -> list:
        """Entries [lo, hi) of ``stream`` from the final tokens."""
        assert hi <= entries_final(len(self.tokens), stream.rate), (stream.key, hi)
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

    def state(self, comp: CompressorSpec, h: int) -> tuple:
        """D7: the live state at h as ((token, series, value), ...)."""
        assert h == len(self.tokens)
        return tuple((p, j, self.truth.proj(comp, j, self.ctx[p]))
                     for p, j in state_entries(h, comp))


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

    def __init__(self, config: StreamConfig, slots: dict, leases: int, state_slots: int):
        self.config = config
        P = config.tokens_per_page
        self.pools = {key: Pool(key, streams, slots[key], P // streams[0].rate)
                      for key, streams in config.pools().items()}
        self.index = {}
        self.leases = [None] * leases
        self.state_free = list(range(state_slots))
        self.state_data = [None] * state_slots
        self.rings = {c.key: ring_size(c, config.max_query_tokens) for c in config.compressors}

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
        self.state_data[slot] = {k: [(BAD, None)] * R for k, R in self.rings.items()}
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

    def __init__(self, seed: int, config: StreamConfig = None, steps: int = 200,
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
            if not can_fit(self.config, m.available(), len(prompt), chunk=self.CHUNK):
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
                first, ref_end, _, _ = shared_pages(L, streams[0], P)
                table = req.pages[key]
                for p in range(ref_end):
                    if p < first:
                        table.append(BAD)
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
            req.written[s.key] = req.declared[s.key] = shared_entries(L, s.rate)
        req.admitted_pages = admission_pages(cfg, len(prompt) - L, self.CHUNK) if not L else None
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
        for p in range(match_candidates(len(prompt), P)):
            prev = page_key(prev, prompt[p * P:(p + 1) * P])
            if prev not in m.index:
                break
            keys.append(prev)
        pools = self.config.pools()
        for n in range(len(keys), 0, -1):
            L = n * P
            ok = True
            for key, streams in pools.items():
                first, ref_end, _, _ = shared_pages(L, streams[0], P)
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
        spans = {key: page_span(streams[0], req.h, c_new, P) for key, streams in pools.items()}
        need = {key: max(0, end - max(first, len(req.pages[key])))
                for key, (first, end) in spans.items()}
        if any(m.pools[key].available() < n for key, n in need.items()):
            self.stats["allocation_failed"] += 1
            return False
        for key, (first, end) in spans.items():
            pool, table = m.pools[key], req.pages[key]
            while len(table) < end:
                table.append(pool.allocate(m.index) if len(table) >= first else BAD)
            while len(table) > end:
                slot = table.pop()
                if slot != BAD:
                    pool.release(slot)
            for p in range(min(first, len(table))):
                if table[p] != BAD:
                    pool.release(table[p])
                    table[p] = BAD
        req.c = c_new
        for s in self.config.streams:
            req.written[s.key] = cut_watermark(req.written[s.key], c_new, s)
        if req.admitted_pages is not None and req.h < len(req.prompt):
            for key, (first, end) in spans.items():
                assert end - first <= req.admitted_pages[key], \
                    f"D10: request {req.rid} holds {end - first} pages of {key}, admitted " \
                    f"{req.admitted_pages[key]}"
        return True

    def locate(self, req: Request, stream: StreamSpec, i: int) -> tuple:
        P = self.config.tokens_per_page
        epp = P // stream.rate
        table = req.pages[self.config.pool_key(stream)]
        assert i // epp < len(table), f"{stream.key} entry {i}: no page (capacity {req.c})"
        slot = table[i // epp]
        assert slot != BAD, f"{stream.key} entry {i}: page released (h {req.h})"
        return req.manager.pools[self.config.pool_key(stream)], slot, i % epp

    def store(self, req: Request, stream: StreamSpec, i: int, value: int) -> None:
        pool, slot, idx = self.locate(req, stream, i)
        pool.write(slot, stream.key, idx, value)

    def load(self, req: Request, stream: StreamSpec, i: int) -> int:
        pool, slot, idx = self.locate(req, stream, i)
        value = pool.data[slot][stream.key][idx]
        assert value is not None, f"{stream.key} entry {i}: never written (h {req.h}, c {req.c})"
        return value

    def gather(self, req: Request, stream: StreamSpec, lo: int, hi: int) -> list:
        """Entries [lo, hi) from the request's pages, page by page."""
        if lo >= hi:
            return []
        epp = self.config.tokens_per_page // stream.rate
        key = self.config.pool_key(stream)
        table, pool, out = req.pages[key], req.manager.pools[key], []
        for p in range(lo // epp, ceil_div(hi, epp)):
            assert p < len(table) and table[p] != BAD, \
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

    def ring(self, req: Request, comp: CompressorSpec) -> list:
        return req.manager.state_data[req.state_slot][comp.key]

    def ring_value(self, ring: list, p: int, j: int) -> int:
        pos, series = ring[p % len(ring)]
        assert pos == p, f"state ring: slot of token {p} holds token {pos}"
        assert series is not None and series[j] is not None, f"state ring: token {p} series {j}"
        return series[j]

    def warm_up(self, req: Request) -> None:
        """D8: rebuild the compressor state of a shared prefix by recomputing warmup_span."""
        lo, hi = warmup_span(req.h, self.config)
        for p in range(lo, hi):
            ctx_p = self.context_before(req, p)
            for comp in self.config.compressors:
                ring = self.ring(req, comp)
                if p >= state_start(hi, comp):
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
            closes = entries_existing(c, r) > entries_final(h, r)
            # the carried state (D7), read before this step's ring writes can overwrite it
            carried = {(p, j): self.ring_value(ring, p, j)
                       for p, j in state_entries(h, comp)} if closes else {}
            rng = stream_ranges(h, c, s, cfg)
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
                    assert len(req.cells[s.key]) <= max_inflight_entries(
                        cfg.max_inflight_tokens, r, cfg.entries_per_unit)
                else:
                    self.store(req, s, i, value)
            lo, hi = ring_writes(h, c, len(ring))
            for p in range(lo, hi):
                ring[p % len(ring)] = (p, act[p - h])
        for s in cfg.streams:
            if s.sparse:
                req.declared[s.key] = max(req.declared[s.key], declared_end(h, c, s, cfg))
            else:
                req.written[s.key] = forward_watermark(req.written[s.key], c, s)

    def read_value(self, req: Request, stream: StreamSpec, i: int) -> int:
        """Where a read of entry i goes during the step at (h, c) (D11)."""
        if stream.sparse:
            rng = stream_ranges(req.h, req.c, stream, self.config)
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
                        assert window_readable(t, q, s.window)
                        self.compare(req, s, q, truth.value(s, q, ctx), t)
                continue
            if s.sparse:
                continue
            # a dense stream is read whole: every entry the last query may read
            for t in queries:
                valid = entries_existing(t + 1, r)
                assert valid == 0 or readable(t, valid - 1, r), \
                    f"{s.key}: query {t} reads entry {valid - 1} before its window " \
                    f"{entry_window(valid - 1, r)} closed"
            self.dense_values(req, s, entries_existing(queries[-1] + 1, r), ctx)
        for s in cfg.streams:
            if not s.sparse:
                continue
            for t in queries:
                picks = self.indexer(req, s, t, entries_existing(t + 1, s.rate), ctx)
                for i in picks:
                    assert readable(t, i, s.rate), \
                        f"{s.key}: query {t} reads entry {i} before its window " \
                        f"{entry_window(i, s.rate)} closed"
                    want = ts.final(s, i, i + 1)[0] if i < entries_final(req.h, s.rate) \
                        else truth.value(s, i, ctx)
                    self.compare(req, s, i, want, t)
                self.stats["sparse_reads"] += len(picks)

    def dense_values(self, req: Request, stream: StreamSpec, n: int, ctx) -> list:
        """Entries [0, n) of a dense stream as the step reads them: the final ones from their pages
        (check_request compares them every step), the step's own checked here."""
        hr = min(n, entries_final(req.h, stream.rate))
        values = self.gather(req, stream, 0, hr)
        for i in range(hr, n):
            value = self.read_value(req, stream, i)
            want = self.truth.value(stream, i, ctx)
            assert value == want, f"request {req.rid} {stream.key}: entry {i} of the step = " \
                                  f"{value}, expected {want} (h {req.h}, c {req.c})"
            values.append(value)
        return values

    def indexer(self, req: Request, stream: StreamSpec, t: int, valid: int, ctx) -> list:
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
            lo, hi = flush_range(req.h, req.c, h_new, s, cfg)
            for i in range(lo, hi):
                value = req.cells[s.key].get(i)
                assert value is not None, f"flush of {s.key} entry {i}: not in cells"
                self.store(req, s, i, value)
            req.written[s.key] = flushed_watermark(req.written[s.key], req.declared[s.key],
                                                   req.h, req.c, h_new, s, cfg)

    def advance(self, req: Request, h_new: int, step_tokens) -> bool:
        """resize(history=h'): refused (False, nothing changed) when SAFE-2 finds an unwritten
        closed entry."""
        if h_new < req.h or h_new > req.c:
            return False
        if unwritten_on_advance(h_new, req.written, self.config):
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
            f"{unwritten_on_advance(h_new, req.written, self.config)}"
        if late is not None and late > req.h:
            ok = self.advance(req, late, step_tokens[req.h - h:])
            self.stats["late_accepted" if ok else "late_refused"] += 1
        for comp in self.config.compressors:
            assert state_survives(req.h, req.c, comp, len(self.ring(req, comp))), \
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
                if slot != BAD and pool.refs[slot] == 1 and pool.commit_key[slot] is None:
                    moved.setdefault(key, {})[p] = {k: list(v) for k, v in pool.data[slot].items()}
                    pool.release(slot)
                    table[p] = BAD
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
                             for p, j in state_entries(req.h, c))
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
        spans = export_spans(req.h, self.config)
        return {"history": req.h, "tokens": list(req.tokens),
                "entries": {s.key: (spans[s.key][0], self.gather(req, s, *spans[s.key]))
                            for s in self.config.streams},
                "state": self.export_state(req)}

    def import_record(self, m: Manager, record: dict, prompt, target: int):
        cfg, P, h = self.config, self.config.tokens_per_page, record["history"]
        need = pages_held(cfg, h, h)
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
            req.written[s.key] = req.declared[s.key] = entries_final(h, s.rate)
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
        spans = {key: shared_pages(L, streams[0], P) for key, streams in pools.items()}
        need = {key: max(0, page_span(pools[key][0], L, L, P)[1] - spans[key][1]) for key in pools}
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
                slot = parent.pages[key][p] if p >= first else BAD
                if slot != BAD:
                    pool.share(slot)
                table.append(slot)
        child.h = child.c = L
        child.tokens = list(parent.tokens)
        for s in cfg.streams:
            child.written[s.key] = child.declared[s.key] = shared_entries(L, s.rate)
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
        n = committable_pages(req.h, P)
        while req.committed < n:
            p = req.committed
            prev = req.keys[-1] if req.keys else 0
            key = page_key(prev, req.tokens[p * P:(p + 1) * P])
            req.keys.append(key)
            entry = m.index.setdefault(key, {})
            for pool_key, pool in m.pools.items():
                table = req.pages[pool_key]
                slot = table[p] if p < len(table) else BAD
                if slot == BAD or pool_key in entry or pool.commit_key[slot] is not None:
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
                if slot != BAD:
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
            hr = entries_final(req.h, s.rate)
            if not (req.offloaded and cfg.pool_key(s) in req.offloaded[0]):
                lo = live_first_entry(s, req.h, P)
                got, want = self.gather(req, s, lo, hr), ts.final(s, lo, hr)
                if got != want:
                    bad = next(n for n in range(len(want)) if got[n] != want[n])
                    raise AssertionError(
                        f"request {req.rid} {s.key}: final entry {lo + bad} (window "
                        f"{entry_window(lo + bad, s.rate)}) = {got[bad]}, expected {want[bad]} "
                        f"(h {req.h})")
            assert req.written[s.key] >= hr, f"SAFE-2: {s.key} written {req.written[s.key]} < {hr}"
        if req.state_slot is not None and not req.state_cold:
            for comp in cfg.compressors:
                got = tuple((p, j, self.ring_value(self.ring(req, comp), p, j))
                            for p, j in state_entries(req.h, comp))
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
                            if slot != BAD:
                                refs[slot] += 1
                assert refs == pool.refs, f"reference counts of {key}"
                assert len(pool.free) + len(pool.cached) + sum(1 for n in refs if n) == pool.slots


def day_config() -> StreamConfig:
    """The engine day's V4-shaped config: a sliding layer, a CSA layer, an HCA layer, a CSA layer
    (window 128, rates 4 and 128, 256-token pages, MTP up to 4 tokens); index_topk scaled to 8."""
    return v4_config([SLIDING, CSA, HCA, CSA], index_topk=8, max_inflight_tokens=16,
                     max_query_tokens=4)


def default_slots(config: StreamConfig) -> dict:
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
