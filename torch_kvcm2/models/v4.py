"""DeepSeek-V4 through the cache (STR-1, STR-2, MOD-1): transformers' ``DeepseekV4ForCausalLM``
with its compressed sparse attention (CSA) entries in host pages and cells, resolved from its
lightning indexer's top-k over entries, and every other stream in GPU pools.

Streams (``torch_kvcm2.stream_set``), one manager per rate; per model layer ``i``:

* rate 1: ``layer{i}.window`` (``kv``: the shared key/value of a token, ``head_dim`` elements,
  windowed to ``sliding_window`` tokens: the sliding-window branch every layer has);
  ``layer{i}.state`` on CSA and HCA layers (``proj``: the compressor's and, on CSA layers, the
  indexer's per-token projections, kv then gate, windowed to the tokens a window's entry still
  needs: 2r for CSA, whose entry also takes the previous window's first half, r for HCA). The
  compressor state the stock cache keeps (a tail of pending tokens, the overlap of the last
  window) is these projections: written once per token like any other, never rewritten, so the
  write contract, export and preemption carry it unchanged;
* rate ``r`` (CSA, 4): ``layer{i}``: ``entry`` (sparse: the compressed entry, ``head_dim``
  elements, as r token rows; one unit per entry, selection group ``csa{i}`` of width
  ``index_topk``) and ``index_k`` (dense: the indexer's compressed key);
* rate ``r'`` (HCA, 128): ``layer{i}``: ``entry`` (dense: every entry is attended).

A step, per layer: the token's key into the window pool and its projections into the state
pool; for every window the step's tokens close, the entry computed from the stored projections
exactly as the stock compressor computes it from its buffer and overlap state, written (CSA: the
last one into its in-flight cell, earlier ones of a prefill chunk to host pages; index keys and
HCA entries to their pools); the indexer's top-k over the row's index keys; on CSA layers the
decode rows' selection resolved and fetched (``Batch.resolve(..., fetch=True)``); then the
stock attention math over the window keys and the compressed entries, the selected ones put
back at their positions (a prefill row reads all its entries: the history from host pages, the
chunk's as computed), which makes the logits bit for bit the stock model's where the shapes are
the stock batch's.

Eager only: DeepSeek-V4 declares no fullgraph compile (``_can_compile_fullgraph = False``).
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

import torch_kvcm2 as kv
from torch_kvcm2.lengths import windowed_peak_pages
from torch_kvcm2.stream_set import StreamBatch, stream_max_tokens

from .dsa_cache import BAD, put_rows, read_rows, step_rows, write_rows
from .support import import_transformers

CSA, HCA, SLIDING = ("compressed_sparse_attention", "heavily_compressed_attention",
                     "sliding_attention")
KV, PROJ, ENTRY, INDEX_KEYS = "kv", "proj", "entry", "index_k"
_MARK = "_torch_kvcm2_v4_forward"


@dataclass(frozen=True)
class V4Spec:
    """What the V4 streams and forward need to know about a model."""

    arch: str
    num_layers: int
    layer_types: tuple
    csa_rate: int
    hca_rate: int
    head_dim: int
    index_head_dim: int
    index_topk: int
    sliding_window: int
    dtype: object

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def rate(self, layer: int) -> int:
        kind = self.layer_types[layer]
        return self.csa_rate if kind == CSA else self.hca_rate if kind == HCA else 1

    def proj_elements(self, layer: int) -> int:
        """Elements of a token's stored projections: CSA kv + gate (2 head_dim each) and the
        indexer's (2 index_head_dim each); HCA kv + gate (head_dim each)."""
        kind = self.layer_types[layer]
        if kind == CSA:
            return 4 * self.head_dim + 4 * self.index_head_dim
        return 2 * self.head_dim if kind == HCA else 0

    @property
    def rates(self) -> tuple:
        return tuple(sorted({1} | {self.rate(i) for i in range(self.num_layers)}))


def window_layer(i: int) -> str:
    return f"layer{i}.window"


def state_layer(i: int) -> str:
    return f"layer{i}.state"


def entry_layer(i: int) -> str:
    return f"layer{i}"


def csa_group(i: int) -> str:
    return f"csa{i}"


def describe_v4(model, allow_untested: bool = False) -> V4Spec:
    """The ``V4Spec`` of a ``DeepseekV4ForCausalLM``; ValueError for what the forward does not
    handle (an attention implementation other than eager, a rate that does not divide an
    entry's bytes into token rows of whole 4-byte words)."""
    import_transformers(allow_untested)
    if type(model).__name__ != "DeepseekV4ForCausalLM":
        raise TypeError(f"describe_v4: a DeepseekV4ForCausalLM, not {type(model).__name__}")
    config = model.config
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation != "eager":
        raise ValueError(f"torch_kvcm2.models: DeepSeek-V4 runs with eager attention (the only "
                         f"one it declares), not {implementation!r}")
    rates = config.compress_rates
    spec = V4Spec(arch="v4", num_layers=config.num_hidden_layers,
                  layer_types=tuple(config.layer_types), csa_rate=rates[CSA],
                  hca_rate=rates[HCA], head_dim=config.head_dim,
                  index_head_dim=config.index_head_dim, index_topk=config.index_topk,
                  sliding_window=config.sliding_window,
                  dtype=next(model.parameters()).dtype)
    for kind in set(spec.layer_types):
        if kind not in (CSA, HCA, SLIDING):
            raise ValueError(f"torch_kvcm2.models: unknown DeepSeek-V4 layer type {kind!r}")
    for i in range(spec.num_layers):
        r = spec.rate(i)
        for what, elements in (("entry", spec.head_dim), ("index key", spec.index_head_dim)):
            if r > 1 and (elements * spec.itemsize) % (4 * r):
                raise ValueError(f"torch_kvcm2.models: layer {i}: a {what} of "
                                 f"{elements * spec.itemsize} bytes does not split into {r} "
                                 f"token rows of whole 4-byte words")
    return spec


def _ceil_to(value: int, step: int) -> int:
    return -(-value // step) * step


def stream_configs(spec: V4Spec, *, max_rows: int, max_tokens_per_row: int,
                   tokens_per_page: Optional[int] = None, window_page_tokens: int = 16,
                   hot_entries: Optional[int] = None, prefill_chunk: Optional[int] = None,
                   device="cpu") -> dict:
    """The ``CacheConfig`` of each rate for ``spec`` (module docstring): budgets sized for
    ``max_rows`` requests of ``max_tokens_per_row`` tokens; ``tokens_per_page`` the compressed
    streams' pages, a multiple of every rate (default: the largest rate, at least 64);
    ``window_page_tokens`` the rate-1 stream's (the windows and the compressor states: small
    pages keep what a window holds close to the window); ``hot_entries`` cell slots per request
    and CSA layer (default twice ``index_topk``, at least ``index_topk`` + 1: the selection and
    the entry in flight, rounded up to whole pages); ``prefill_chunk``: the windowed pools hold
    each row's peak during a prefill in chunks of that many tokens
    (``lengths.windowed_peak_pages``; admit with ``can_fit(..., prefill_chunk=)``) instead of
    every token of a row."""
    rates = spec.rates
    P = tokens_per_page or max(64, max(rates))
    if any(P % r for r in rates):
        raise ValueError(f"stream_configs: tokens_per_page ({P}) must be a multiple of every "
                         f"rate {rates}")
    pages = {r: window_page_tokens if r == 1 else P for r in rates}

    def windowed_tokens(window: int) -> int:  # what a row holds of a windowed buffer, at most
        whole = _ceil_to(max_tokens_per_row, pages[1])
        if prefill_chunk is None:
            return whole
        return min(whole, windowed_peak_pages(window, 0, prefill_chunk, pages[1]) * pages[1])
    isz, hd = spec.itemsize, spec.head_dim
    layers = {r: [] for r in rates}
    gpu = {r: 0 for r in rates}
    host = {r: 0 for r in rates}
    for i in range(spec.num_layers):
        kind, r = spec.layer_types[i], spec.rate(i)
        tokens = max_rows * _ceil_to(stream_max_tokens(max_tokens_per_row, r), P)
        layers[1].append(kv.LayerSpec(window_layer(i), [kv.BufferSpec(KV, hd * isz)],
                                      window=spec.sliding_window))
        gpu[1] += max_rows * windowed_tokens(spec.sliding_window) * hd * isz
        if kind == SLIDING:
            continue
        state_window = 2 * r if kind == CSA else r
        layers[1].append(kv.LayerSpec(state_layer(i),
                                      [kv.BufferSpec(PROJ, spec.proj_elements(i) * isz)],
                                      window=state_window))
        gpu[1] += max_rows * windowed_tokens(state_window) * spec.proj_elements(i) * isz
        if kind == HCA:
            layers[r].append(kv.LayerSpec(entry_layer(i), [kv.BufferSpec(ENTRY, hd * isz // r)]))
            gpu[r] += tokens * hd * isz // r
            continue
        width = spec.index_topk
        slots = hot_entries if hot_entries is not None else 2 * width
        slots = _ceil_to(max(slots, width + 1), P // r)
        sparse = kv.SparseSpec(tokens_per_unit=r, width=width, slots=slots,
                               max_inflight_tokens=r, selection_id=csa_group(i))
        layers[r].append(kv.LayerSpec(entry_layer(i), [
            kv.BufferSpec(ENTRY, hd * isz // r, sparse=True),
            kv.BufferSpec(INDEX_KEYS, spec.index_head_dim * isz // r)], sparse=sparse))
        gpu[r] += tokens * spec.index_head_dim * isz // r + max_rows * slots * hd * isz
        host[r] += tokens * hd * isz // r
    configs = {}
    for r in rates:
        # tables, residency state and staging are small: a quarter more and 8 MiB cover them
        configs[r] = kv.CacheConfig(
            tokens_per_page=pages[r], layers=layers[r], max_rows=max_rows,
            max_tokens_per_row=stream_max_tokens(max_tokens_per_row, r),
            gpu_budget_bytes=gpu[r] * 5 // 4 + (8 << 20),
            host_budget_bytes=host[r] * 5 // 4 + (8 << 20), device=device)
    return configs


def install_v4(model, allow_untested: bool = False) -> V4Spec:
    """Give every attention module of a ``DeepseekV4ForCausalLM`` the forward that uses a
    ``V4Cache`` (any other cache, or none: the stock forward). Idempotent; returns the spec."""
    spec = describe_v4(model, allow_untested)
    for i, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        attention._torch_kvcm2_layer = i
        if getattr(attention, _MARK, False):
            continue
        attention.forward = types.MethodType(_v4_forward, attention)
        setattr(attention, _MARK, True)
    return spec


def _v4_forward(self, hidden_states, position_embeddings, position_ids, attention_mask,
                past_key_values=None, **kwargs):
    if not isinstance(past_key_values, V4Cache):
        return type(self).forward(self, hidden_states, position_embeddings, position_ids,
                                  attention_mask, past_key_values=past_key_values, **kwargs)
    modeling = sys.modules[type(self).__module__]
    rope = modeling.apply_rotary_pos_emb
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    cos, sin = position_embeddings[self.rope_layer_type]
    q_residual = self.q_a_norm(self.q_a_proj(hidden_states))
    q = self.q_b_norm(self.q_b_proj(q_residual).view(*hidden_shape).transpose(1, 2))
    q = rope(q, cos, sin)
    kv_states = self.kv_norm(self.kv_proj(hidden_states)).view(*hidden_shape).transpose(1, 2)
    kv_states = rope(kv_states, cos, sin)
    keys, mask = past_key_values.attend(self, hidden_states, q_residual, kv_states[:, 0],
                                        position_ids)
    out, _ = modeling.eager_attention_forward(self, q, keys, keys, mask, scaling=self.scaling,
                                              dropout=0.0, sliding_window=self.sliding_window,
                                              s_aux=self.sinks)
    out = rope(out.transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = out.reshape(*input_shape, self.config.o_groups, -1)
    return self.o_b_proj(self.o_a_proj(grouped).flatten(2)), None


@dataclass
class V4Step:
    """What ``prepare_step`` knows about the step that every layer reads."""

    positions: torch.Tensor      # int32[R, S] the step's token positions (BAD: padding)
    history: list                # the rows' token histories before the step (host ints)
    counts: list                 # the rows' new tokens (host ints)
    decode_row: torch.Tensor     # bool[R]
    prefill_row: torch.Tensor    # bool[R]
    any_prefill: bool
    window_keys: torch.Tensor    # int32[R, Lw] the window's key positions (BAD: padding)
    window_mask: torch.Tensor    # [R, 1, S, Lw] 0 where a query sees a window key, else min
    entries: dict                # rate -> Entries of the step


@dataclass
class Entries:
    """A compressed stream's entries in one step, the same for every layer of its rate."""

    closing: torch.Tensor  # int64[R, K] the windows the step's tokens close (BAD: none)
    every: torch.Tensor    # int64[R, T] every entry each row has after the step (BAD past it)
    before: torch.Tensor   # int64[R] the entries each row had before the step
    any_closing: bool      # some row closes a window (else no entry is computed or written)


def _step_entries(history: torch.Tensor, counts: torch.Tensor, rate: int, device) -> Entries:
    """``Entries`` of a rate from the rows' token histories and new tokens (int64[R], host)."""
    first, end = history // rate, (history + counts) // rate
    K, T = max(int((end - first).max()), 1), int(end.max())
    closing = first[:, None] + torch.arange(K)
    closing = torch.where(closing < end[:, None], closing, BAD)
    every = torch.arange(T).expand(len(end), -1)
    every = torch.where(every < end[:, None], every, BAD)
    return Entries(closing.to(device), every.to(device), first.to(device),
                   bool((end > first).any()))


def _entries(paged: torch.Tensor, rate: int) -> torch.Tensor:
    """A rate-``rate`` buffer's pages or cells ``[pages, 1, P, B]`` as ``[pages, 1, P / rate,
    rate * B]``: one row per entry (``rate`` consecutive token rows, never split by a page),
    the layout ``read_rows`` / ``write_rows`` take, as a view."""
    return paged.unflatten(2, (-1, rate)).flatten(3, 4)


class V4Cache:
    """A ``StreamBatch`` presented to a ``DeepseekV4ForCausalLM`` as its cache.

    ``V4Cache(model, batch)``: the batch's managers built from ``stream_configs(describe_v4(
    model), ...)``. A step: ``inputs = cache.prepare_step({row: token_ids})`` (publishes; each
    row's token capacity must be its history plus its new tokens), ``model.model(**inputs,
    past_key_values=cache)``, ``cache.finish_step()``, then ``batch.poll()``."""

    is_compileable = False
    static_length = None

    def __init__(self, model, batch: StreamBatch, allow_untested: bool = False):
        self.spec = spec = install_v4(model, allow_untested)
        if not isinstance(batch, StreamBatch):
            raise TypeError("V4Cache: batch must be a torch_kvcm2.stream_set.StreamBatch")
        if set(batch.batches) != set(spec.rates):
            raise ValueError(f"V4Cache: the batch has streams of rates {sorted(batch.batches)}, "
                             f"the model needs {spec.rates}; build it with stream_configs")
        self.model, self.batch, self.dtype = model, batch, spec.dtype
        self.rows, self.device = batch.max_rows, batch.config.device
        self.step: Optional[V4Step] = None

    # ---- the step, driver side ----
    def prepare_step(self, tokens: Mapping[int, Sequence[int]]) -> dict:
        batch, R, W = self.batch, self.rows, self.spec.sliding_window
        batch.publish()
        counts, history = step_rows(batch, tokens, R, "V4Cache.prepare_step")
        S = max(max(counts), 1)
        kept = [min(h, W - 1) for h in history]  # the stock window keeps W - 1 older keys
        Lw = max(max(k + n for k, n in zip(kept, counts)), 1)
        ids = torch.zeros(R, S, dtype=torch.long)
        positions = torch.full((R, S), BAD, dtype=torch.int32)
        keys = torch.full((R, Lw), BAD, dtype=torch.int32)
        for row, new in tokens.items():
            n, h = counts[row], history[row]
            ids[row, :n] = torch.as_tensor(list(new), dtype=torch.long)
            positions[row, :n] = torch.arange(h, h + n, dtype=torch.int32)
            keys[row, :kept[row] + n] = torch.arange(h - kept[row], h + n, dtype=torch.int32)
        p, k = positions[:, :, None], keys[:, None, :]
        sees = (k >= 0) & (k <= p) & (k > p - W)
        mask = torch.where(sees, torch.zeros((), dtype=self.dtype),
                           torch.finfo(self.dtype).min)[:, None]
        counts_t, history_t = torch.tensor(counts), torch.tensor(history)
        dev = self.device
        entries = {rate: _step_entries(history_t, counts_t, rate, dev)
                   for rate in self.spec.rates if rate > 1}
        self.step = V4Step(positions=positions.to(dev), history=history, counts=counts,
                           decode_row=(counts_t == 1).to(dev), prefill_row=(counts_t > 1).to(dev),
                           any_prefill=any(n > 1 for n in counts), window_keys=keys.to(dev),
                           window_mask=mask.to(dev), entries=entries)
        position_ids = positions.clamp(min=0).long().to(dev)
        # the model takes a prebuilt mask dict as is; this forward builds its own masks
        return {"input_ids": ids.to(dev), "position_ids": position_ids,
                "attention_mask": {SLIDING: self.step.window_mask}}

    def finish_step(self) -> None:
        """Declare a prefill's host-direct entries, flush each stream's in-flight tokens and
        advance every stream by the windows the step's tokens closed."""
        step = self.step
        self.batch.finish_step(step.history, step.counts, host_writes=step.any_prefill)

    # ---- what transformers asks a cache ----
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max((r.history_length for r in self.batch.members().values()), default=0)

    # ---- pools ----
    def _pool(self, rate: int, layer: str, role: str):
        batch = self.batch.batches[rate]
        return batch, batch.manager.buffer_view(layer, role)

    def _put_tokens(self, layer: str, role: str, values: torch.Tensor) -> None:
        """The step's tokens' ``values`` [R, S, E] into a rate-1 dense pool."""
        batch, pages = self._pool(1, layer, role)
        index = batch.host_token_indices(layer, role, self.step.positions)
        write_rows(pages, index.flatten(), values.reshape(-1, values.shape[-1]).to(self.dtype))

    def _get_tokens(self, layer: str, role: str, positions: torch.Tensor) -> torch.Tensor:
        batch, pages = self._pool(1, layer, role)
        return read_rows(pages, batch.host_token_indices(layer, role, positions), self.dtype)

    def _entry_index(self, rate: int, layer: str, role: str, entries: torch.Tensor):
        """Pool entry indices of entry ordinals ``entries`` (BAD stays BAD)."""
        batch = self.batch.batches[rate]
        first = torch.where(entries >= 0, entries * rate, BAD).int()
        index = batch.host_token_indices(layer, role, first)
        return torch.where(index >= 0, index // rate, BAD)

    # ---- one layer ----
    def attend(self, module, hidden, q_residual, kv_states, position_ids):
        """One layer's cache work: the window and compressed keys [R, 1, L, head_dim] and the
        additive mask [R, 1, S, L] the stock attention math takes."""
        i, step = module._torch_kvcm2_layer, self.step
        self._put_tokens(window_layer(i), KV, kv_states)
        keys = self._get_tokens(window_layer(i), KV, step.window_keys)[:, None]
        mask = step.window_mask
        compressor = module.compressor
        if compressor is None:
            return keys, mask
        kind = self.spec.layer_types[i]
        compressed, bias = (self._csa(i, compressor, hidden, q_residual, position_ids)
                            if kind == CSA else self._hca(i, compressor, hidden, position_ids))
        return (torch.cat([keys, compressed[:, None]], dim=2),
                torch.cat([mask, bias.to(mask.dtype)[:, None]], dim=-1))

    def _projections(self, i, proj, windows, rate, lo, hi, overlap):
        """Stored projections ``proj[..., lo:hi]`` (kv then gate halves) of the tokens of
        ``windows`` [R, K], laid out as the stock compressor lays them out: [R, K, w, D]
        windows of kv and gate (with the position bias), w = 2r with the previous window's
        first half in front (``overlap``: zero kv, -inf gate where there is none), else r."""
        R, K = windows.shape
        offsets = torch.arange(rate, device=self.device)
        tokens = torch.where(windows[..., None] >= 0, windows[..., None] * rate + offsets, BAD)
        rows = self._get_tokens(state_layer(i), PROJ, tokens.flatten(1).int())
        rows = rows.view(R, K, rate, -1)[..., lo:hi]
        width = (hi - lo) // 2
        kv_part, gate_part = rows[..., :width], rows[..., width:] + proj.position_bias
        if not overlap:
            return kv_part, gate_part
        half = width // 2
        prev = torch.where(windows[..., None] >= 1, (windows[..., None] - 1) * rate + offsets,
                           BAD)
        before = self._get_tokens(state_layer(i), PROJ, prev.flatten(1).int())
        before = before.view(R, K, rate, -1)[..., lo:hi]
        has = (windows >= 1)[..., None, None]
        kv_prev = torch.where(has, before[..., :half], 0.0)
        gate_prev = torch.where(has, (before[..., width:] + proj.position_bias)[..., :half],
                                float("-inf"))
        new_kv = torch.cat([kv_prev, kv_part[..., half:]], dim=2)
        new_gate = torch.cat([gate_prev, gate_part[..., half:]], dim=2)
        return new_kv, new_gate

    def _compress(self, module, new_kv, new_gate, windows, rate):
        """The stock compressor's entry of each window: the gated sum, its norm, then RoPE at
        the window's first position. [R, K, D]."""
        modeling = sys.modules[type(module).__module__]
        compressed = module.kv_norm((new_kv * new_gate.softmax(dim=2, dtype=torch.float32)
                                     .to(new_kv.dtype)).sum(dim=2))
        positions = windows.clamp(min=0) * rate
        cos, sin = module.rotary_emb(compressed, position_ids=positions, layer_type="compress")
        return modeling.apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin).squeeze(1)

    def _hca(self, i, compressor, hidden, position_ids):
        rate, hd, step = self.spec.hca_rate, self.spec.head_dim, self.step
        self._put_tokens(state_layer(i), PROJ, torch.cat([compressor.kv_proj(hidden),
                                                          compressor.gate_proj(hidden)], -1))
        windows, every = step.entries[rate].closing, step.entries[rate].every
        name = entry_layer(i)
        rows = _entries(self._pool(rate, name, ENTRY)[1], rate)
        if step.entries[rate].any_closing:
            new_kv, new_gate = self._projections(i, compressor, windows, rate, 0, 2 * hd, False)
            entries = self._compress(compressor, new_kv, new_gate, windows, rate)
            index = self._entry_index(rate, name, ENTRY, windows)
            write_rows(rows, index.flatten(), entries.reshape(-1, hd))
        compressed = read_rows(rows, self._entry_index(rate, name, ENTRY, every), self.dtype)
        threshold = (step.positions.long() + 1) // rate  # entries a query may see
        every = torch.arange(every.shape[1], device=self.device)
        bias = torch.where(every < threshold[..., None], 0.0, float("-inf"))
        return compressed, bias.to(self.dtype)

    def _csa(self, i, compressor, hidden, q_residual, position_ids):
        spec, step, rate = self.spec, self.step, self.spec.csa_rate
        hd, ihd = spec.head_dim, spec.index_head_dim
        indexer = compressor.indexer
        self._put_tokens(state_layer(i), PROJ, torch.cat([
            compressor.kv_proj(hidden), compressor.gate_proj(hidden),
            indexer.kv_proj(hidden), indexer.gate_proj(hidden)], -1))
        windows, every = step.entries[rate].closing, step.entries[rate].every
        closing = step.entries[rate].any_closing
        name, group = entry_layer(i), csa_group(i)
        batch = self.batch.batches[rate]
        key_rows = _entries(batch.manager.buffer_view(name, INDEX_KEYS), rate)
        if closing:  # this step's entries and index keys, from the stored projections
            new_kv, new_gate = self._projections(i, compressor, windows, rate, 0, 4 * hd, True)
            entries = self._compress(compressor, new_kv, new_gate, windows, rate)
            new_kv, new_gate = self._projections(i, indexer, windows, rate, 4 * hd,
                                                 4 * hd + 4 * ihd, True)
            index_keys = self._compress(indexer, new_kv, new_gate, windows, rate)
            write_rows(key_rows, self._entry_index(rate, name, INDEX_KEYS, windows).flatten(),
                       index_keys.reshape(-1, ihd))
        # the indexer's top-k over the row's entries, as the stock indexer takes it
        T = every.shape[1]
        all_keys = read_rows(key_rows, self._entry_index(rate, name, INDEX_KEYS, every),
                             self.dtype)
        topk = self._indexer(indexer, hidden, q_residual, position_ids, all_keys, T)
        # resolve the decode rows' selection (every layer of the group: this one) and fetch it
        width = spec.index_topk
        selected = torch.where(step.decode_row[:, None] & (topk[:, 0] >= 0), topk[:, 0], BAD)
        selected = torch.nn.functional.pad(selected, (0, width - selected.shape[1]), value=BAD)
        index = batch.resolve(group, selected.int(), fetch=True)
        table, start = batch.write_indices(group)
        # this step's entries: the in-flight one into its cell, a prefill's others to host pages
        cells = _entries(batch.cells(name, ENTRY), rate)
        host_rows = _entries(batch.manager.buffer_view(name, ENTRY), rate)
        if closing:
            first = torch.where(windows >= 0, windows * rate, BAD)
            inflight = (windows >= 0) & (first >= start[:, None].long())
            cell = table[:, :1].long().expand_as(windows)
            write_rows(cells, torch.where(inflight, cell // rate, BAD).flatten(),
                       entries.reshape(-1, hd))
            if step.any_prefill:
                direct = torch.where((windows >= 0) & ~inflight, windows, BAD)
                put_rows(host_rows, self._entry_index(rate, name, ENTRY, direct).flatten(),
                         entries.reshape(-1, hd))
        # the compressed keys: decode rows' selection from the cells, prefill rows' every entry
        compressed = torch.zeros(self.rows, T + 1, hd, dtype=self.dtype,
                                 device=self.device)  # column T takes the unplaced
        placed = torch.where(index >= 0, selected.long(), T)
        compressed.scatter_(1, placed[..., None].expand(-1, -1, hd),
                            read_rows(cells, index.long(), self.dtype))
        if step.any_prefill:
            before = step.entries[rate].before
            old = torch.where(step.prefill_row[:, None] & (every < before[:, None]), every, BAD)
            got = read_rows(host_rows, self._entry_index(rate, name, ENTRY, old), self.dtype)
            compressed.scatter_(1, torch.where(old >= 0, old, T)[..., None].expand(-1, -1, hd),
                                got)
            if closing:
                mine = torch.where(step.prefill_row[:, None] & (windows >= 0), windows, T)
                compressed.scatter_(1, mine[..., None].expand(-1, -1, hd), entries)
        valid = topk >= 0
        safe = torch.where(valid, topk, T)
        bias = torch.full((self.rows, topk.shape[1], T + 1), float("-inf"), dtype=self.dtype,
                          device=self.device)
        bias.scatter_(-1, safe, 0.0)
        return compressed[:, :T], bias[..., :T]

    def _indexer(self, indexer, hidden, q_residual, position_ids, keys, T):
        """The stock lightning indexer's top-k over ``keys`` [R, T, index_head_dim]: int64[R, S,
        k] entry ordinals, -1 where a query may not see them."""
        modeling = sys.modules[type(indexer).__module__]
        R, S = hidden.shape[:2]
        cos, sin = indexer.rotary_emb(hidden, position_ids=position_ids, layer_type="compress")
        q = indexer.q_b_proj(q_residual).view(R, S, -1, indexer.head_dim).transpose(1, 2)
        q = modeling.apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)
        scores = indexer.scorer(q, keys, hidden)  # [R, S, T]
        threshold = (position_ids + 1) // indexer.compress_rate
        entries = torch.arange(T, device=scores.device)
        scores = scores.masked_fill(entries.view(1, 1, -1) >= threshold[..., None], float("-inf"))
        topk = scores.topk(min(indexer.index_topk, T), dim=-1).indices
        return torch.where(topk >= threshold[..., None], -1, topk)


__all__ = ["V4Cache", "V4Spec", "describe_v4", "install_v4", "stream_configs"]
