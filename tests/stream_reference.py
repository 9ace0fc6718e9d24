"""A plain-Python reference model of request streams with a compression rate (docs/REQUIREMENTS.md
§15g, STR-1..2: DeepSeek-V4's compressed sparse attention through the cache).

Written from docs/REQUIREMENTS.md (§2 vocabulary, §5-§9, §15g), docs/HOST_PATH.md
(the write contract) and the semantics of transformers' DeepSeek-V4 definition
(``transformers/models/deepseek_v4/modeling_deepseek_v4.py``, transformers 5.23.0), whose functions
are named below wherever a rule comes from. Nothing is imported from the library or copied from
another project: it uses Python ints, lists and dicts only. Its tests are
tests/test_stream_reference.py.

The model has three parts: the rules (this module, sections 1-6, pure functions over ints), a
deterministic stand-in model with the storage of every stream in pages and cells
(tests/stream_storage.py, sections 7-8) and a small engine driver (tests/stream_engine.py) that
runs random "engine days" and checks the rules after every step.

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
