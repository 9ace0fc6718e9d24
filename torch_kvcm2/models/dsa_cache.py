"""``SparseMLACache``: a torch_kvcm2 ``Batch`` as a DSA model's ``past_key_values`` (MOD-1, MOD-2).

The model runs with the replacement attention forward of ``attention.py`` (``install``), which
hands this object the layer's projections; the stock indexer runs unchanged and reaches its keys
through ``update_indexer``. Per layer and step:

1. the indexer's keys of the step's tokens go into the dense pool (``indexer_k``, through the
   page table: ``Batch.host_token_indices`` on a dense buffer), and the keys of every position
   come back from it for the indexer's scores and top-k;
2. on the first layer of a selection group, the decode rows' selection (the top-k within the
   causal mask) is resolved and fetched for every layer of the group
   (``Batch.resolve(group, selected, fetch=True)``); a "shared" GLM layer reuses it;
3. the step's latents are written: tokens below the in-flight start (a prefill chunk) straight
   to their host pages (``host_token_indices`` on the sparse buffer, declared by
   ``finish_step(host_writes=True)``), the in-flight token into its cell (``write_indices``);
4. attention reads the selected latents from the cells through the index table
   (``Batch.cells``) -- a prefill row reads its selected history from the host pages and its
   chunk from the activations -- and either puts them back at their positions and runs the
   stock attention (``mode="scatter"``: bit for bit the stock dense cache where transformers
   caches latents), or attends over the K selected latents with MLA weight absorption
   (``mode="absorbed"``: what a FlashMLA-style sparse decode kernel computes).

Every per-layer operation has fixed shapes for a decode step (one token per row, a static
``kv_length``), so such a step can be compiled with ``fullgraph=True`` or captured.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from .layout import INDEXER_KEYS, LATENT, group_id, indexer_bytes, latent_bytes, layer_name
from .support import describe

MODES = ("scatter", "absorbed")
KERNELS = (None, "sparse_mla", "reference")
BAD = -1


def as_rows(paged: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A token-major paged uint8 buffer or cells ``[pages, 1, P, B]`` as one row of ``dtype``
    per token index (token index i is page i // P, row i % P)."""
    return paged.flatten(0, 2).view(dtype)


def write_rows(paged: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``paged``'s token ``index[n]`` = ``values[n]`` for every index that is not BAD, with fixed
    shapes (compilable and capturable): each token's bytes, as int32 words, get the difference
    new - old added at valid indices and 0 at BAD ones (sent to token 0). Integer sums wrap
    exactly and valid indices are distinct, so the result is the new bits exactly. For device
    memory (cells, dense pools): it adds with atomics, which host pages mapped into a GPU's
    address space need not honour (``put_rows``)."""
    words = as_rows(paged, torch.int32)
    new = values.contiguous().view(torch.int32)
    valid = index >= 0
    safe = torch.where(valid, index, 0).long()
    words.index_add_(0, safe, torch.where(valid[:, None], new - words[safe], 0))


def put_rows(paged: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``write_rows`` for host pages (the prefill path, eager only): an indexed store of the
    valid rows, no atomics, its shape data-dependent."""
    valid = index >= 0
    as_rows(paged, values.dtype)[index[valid].long()] = values[valid]


def read_rows(paged: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``index[...]`` of ``paged`` as ``dtype`` (zeros where the index is BAD)."""
    got = as_rows(paged, dtype)[index.clamp(min=0).long()]
    return torch.where((index >= 0)[..., None], got, torch.zeros((), dtype=dtype,
                                                                  device=got.device))


def step_rows(batch, tokens: Mapping[int, Sequence[int]], rows: int, where: str) -> tuple:
    """Each row's new tokens and history (lists of ``rows`` ints, 0 for rows without tokens)
    of a step that brings ``tokens`` (row -> token ids); ValueError naming ``where`` for a row
    without a member, without tokens, or whose capacity is not its history plus its tokens."""
    members = batch.members()
    counts, histories = [0] * rows, [0] * rows
    for row, ids in tokens.items():
        cache = members.get(row)
        if cache is None:
            raise ValueError(f"{where}: row {row} has no member")
        n, h = len(ids), cache.history_length
        if n == 0:
            raise ValueError(f"{where}: row {row} brings no tokens")
        if cache.capacity != h + n:
            raise ValueError(f"{where}: row {row} brings {n} token(s) but its cache has history "
                             f"{h} and capacity {cache.capacity}; resize(capacity=history + {n}) "
                             f"first")
        counts[row], histories[row] = n, h
    return counts, histories


@dataclass
class StepState:
    """What ``prepare_step`` knows about the step that every layer reads."""

    positions: torch.Tensor      # int32[R, S] the step's token positions (BAD: padding)
    kv_positions: torch.Tensor   # int32[R, T] 0..T-1 per row (the indexer's keys)
    allowed: torch.Tensor        # bool[R, S, T] causal mask (a padding query sees position 0)
    mask: torch.Tensor           # the model's 4D mask: bool (sdpa) or 0 / min (eager)
    history: torch.Tensor        # int32[R] history per row (0 for holes)
    decode_row: torch.Tensor     # bool[R] rows with one token this step
    prefill_row: torch.Tensor    # bool[R] rows with more than one token
    accepted: torch.Tensor       # int32[R] tokens each row adds to its history
    any_prefill: bool
    any_decode: bool
    kv_length: int


class SparseMLACache:
    """A ``Batch`` presented to a DeepSeek-V3.2 or GLM-MoE-DSA model as its cache.

    ``SparseMLACache(model, batch, mode="scatter", kernel=None, static_length=None)``: the
    batch's manager must have been built from ``layout.cache_config(describe(model), ...)``.
    ``mode``: "scatter" (the selected latents put back at their positions, then the stock
    attention math) or "absorbed" (MLA weight absorption over the K selected latents).
    ``kernel`` (absorbed decode only): None for this module's torch computation, "sparse_mla"
    for ``torch_kvcm2.models.sparse_mla.sparse_mla_decode`` reading the cells through the index
    table (its Triton kernel on a GPU, its torch implementation elsewhere; the 512 + 64 latent
    row of the real models only), "reference" for that module's plain reference.
    ``static_length``: every step's key length (positions beyond a row's capacity masked), so
    decode steps have one shape (compile, CUDA graphs); None sizes each step to its longest
    row, as transformers' dynamic cache does.

    A step: ``inputs = cache.prepare_step({row: token_ids})`` (publishes the batch; each row's
    capacity must be its history plus its new tokens), ``model.model(**inputs,
    past_key_values=cache)``, ``cache.finish_step()`` (flush and advance on the device), then
    ``batch.poll()`` where the caller waits for its sampled tokens.
    """

    is_compileable = True

    def __init__(self, model, batch, mode: str = "scatter", kernel: Optional[str] = None,
                 static_length: Optional[int] = None, allow_untested: bool = False):
        if mode not in MODES:
            raise ValueError(f"SparseMLACache: mode must be one of {MODES}, got {mode!r}")
        if kernel not in KERNELS:
            raise ValueError(f"SparseMLACache: kernel must be one of {KERNELS}, got {kernel!r}")
        if kernel is not None and mode != "absorbed":
            raise ValueError("SparseMLACache: a kernel computes the absorbed decode; pass "
                             "mode='absorbed'")
        self.spec = spec = describe(model, allow_untested)
        self.model, self.batch, self.manager = model, batch, batch.manager
        self.mode, self.kernel, self.static_length = mode, kernel, static_length
        self.config = config = batch.config
        self.device, self.rows, self.dtype = config.device, batch.max_rows, spec.dtype
        self._check_layout(config)
        if static_length is not None and not 0 < static_length <= config.max_tokens_per_row:
            raise ValueError(f"SparseMLACache: static_length must be in [1, "
                             f"{config.max_tokens_per_row}], got {static_length!r}")
        self._decode_kernel = _load_kernel(kernel)
        self.step: Optional[StepState] = None
        self._groups = {}  # group id -> (index table, selected positions) of this step
        self.indexing = layer_name(0)  # the layer whose indexer runs (attention.py sets it)
        self._kept = {}  # (S, T) -> the step's tensors with fixed addresses (static_length)
        from .attention import install
        install(model)

    def _check_layout(self, config) -> None:
        """The manager's config must be ``layout.cache_config``'s for this model."""
        spec = self.spec
        if latent_bytes(spec) % 4 or indexer_bytes(spec) % 4:
            raise ValueError("SparseMLACache: a token's latent and indexer key must be whole "
                             "4-byte words (write_rows adds int32 words)")
        for i in range(spec.num_layers):
            name = layer_name(i)
            try:
                layer = config.layer(name)
            except KeyError:
                raise ValueError(f"SparseMLACache: the manager's config has no layer {name!r}; "
                                 f"build it with torch_kvcm2.models.cache_config") from None
            sizes = {b.role: b.bytes_per_token for b in layer.buffers}
            want = {LATENT: latent_bytes(spec)}
            if spec.has_indexer(i):
                want[INDEXER_KEYS] = indexer_bytes(spec)
            sparse = layer.sparse
            if (sizes != want or sparse is None or sparse.selection_id != group_id(spec.leader[i])
                    or sparse.tokens_per_unit != 1 or sparse.width != spec.index_topk):
                raise ValueError(f"SparseMLACache: layer {name!r} of the manager's config does not "
                                 f"match the model (buffers {sizes}, want {want}); build it with "
                                 f"torch_kvcm2.models.cache_config")

    # ---- the step, driver side ----
    def prepare_step(self, tokens: Mapping[int, Sequence[int]]) -> dict:
        """Publish the batch and build the model's inputs for one step: ``tokens`` maps each
        seated row that runs this step to its new token ids (a prefill chunk, or the one token
        of a decode step), which go at positions ``[history, history + n)``; the row's capacity
        must be ``history + n`` (``KVCache.resize``). Returns ``input_ids``, ``position_ids`` and
        ``attention_mask`` (4D) for ``model.model(**inputs, past_key_values=self)``."""
        batch = self.batch
        batch.publish()
        R = self.rows
        counts, histories = step_rows(batch, tokens, R, "SparseMLACache.prepare_step")
        S = max(counts) if any(counts) else 1
        longest = max(h + n for h, n in zip(histories, counts))
        T = self.static_length or longest
        if longest > T:
            raise ValueError(f"SparseMLACache.prepare_step: a row reaches {longest} tokens, past "
                             f"static_length {T}")
        ids = torch.zeros(R, S, dtype=torch.long)  # built on the host, then copied once
        positions = torch.full((R, S), BAD, dtype=torch.int32)
        for row, new in tokens.items():
            n, h = counts[row], histories[row]
            ids[row, :n] = torch.as_tensor(list(new), dtype=torch.long)
            positions[row, :n] = torch.arange(h, h + n, dtype=torch.int32)
        kv = torch.arange(T, dtype=torch.int32)
        allowed = (kv <= positions[..., None]) & (positions >= 0)[..., None]
        allowed |= (positions < 0)[..., None] & (kv == 0)  # a padding query sees position 0
        if self.spec.attn_implementation == "eager":
            mask = torch.where(allowed, torch.zeros((), dtype=self.dtype),
                               torch.finfo(self.dtype).min)[:, None]
        else:
            mask = allowed[:, None]
        counts_t = torch.tensor(counts, dtype=torch.int32)
        host = {"input_ids": ids, "position_ids": positions.clamp(min=0).long(),
                "positions": positions, "kv_positions": kv.expand(R, T).contiguous(),
                "allowed": allowed, "mask": mask,
                "history": torch.tensor(histories, dtype=torch.int32),
                "decode_row": counts_t == 1, "prefill_row": counts_t > 1, "accepted": counts_t}
        tensors = self._on_device(host, (S, T))
        self.step = StepState(
            positions=tensors["positions"], kv_positions=tensors["kv_positions"],
            allowed=tensors["allowed"], mask=tensors["mask"], history=tensors["history"],
            decode_row=tensors["decode_row"], prefill_row=tensors["prefill_row"],
            accepted=tensors["accepted"], any_prefill=any(n > 1 for n in counts),
            any_decode=any(n == 1 for n in counts), kv_length=T)
        self._groups = {}
        return {"input_ids": tensors["input_ids"], "position_ids": tensors["position_ids"],
                "attention_mask": tensors["mask"]}

    def _on_device(self, host: dict, shape: tuple) -> dict:
        """The step's tensors on the batch's device. A decode step (one token per row) with a
        ``static_length`` copies them into tensors kept for that shape, whose addresses never
        change (a captured decode step reads them); other steps get fresh ones."""
        if self.static_length is None or shape[0] != 1:
            return {name: t.to(self.device) for name, t in host.items()}
        kept = self._kept.get(shape)
        if kept is None:
            kept = self._kept[shape] = {name: t.to(self.device) for name, t in host.items()}
        else:
            for name, t in host.items():
                kept[name].copy_(t, non_blocking=True)
        return kept

    def finish_step(self) -> None:
        """End the step on the device: declare a prefill's host-direct tokens (when there were
        any), flush each row's in-flight token and advance history over the step's tokens
        (``Batch.finish_step``). Then the caller reads its sampled tokens and ``Batch.poll()``s."""
        self.batch.finish_step(self.step.accepted, host_writes=self.step.any_prefill)

    # ---- what transformers asks a cache ----
    def get_seq_length(self, layer_idx: int = 0) -> int:
        members = self.batch.members()
        return max((c.history_length for c in members.values()), default=0)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple:
        return (self.step.kv_length if self.step is not None else query_length), 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def update_indexer(self, keys: torch.Tensor, layer_idx) -> torch.Tensor:
        """The indexer's cache call: write ``keys`` [R, S, D] (the step's tokens) into the dense
        pool and return every position's key [R, T, D] read back from it (zeros past a row's
        capacity)."""
        # the layer whose attention forward runs this indexer (it names it before the call:
        # the stock indexer passes its layer_idx, which a compiled step may see symbolic)
        name, step, batch = self.indexing, self.step, self.batch
        pages = self.manager.buffer_view(name, INDEXER_KEYS)
        index = batch.host_token_indices(name, INDEXER_KEYS, step.positions)
        write_rows(pages, index.flatten(), keys.reshape(-1, keys.shape[-1]).to(self.dtype))
        every = batch.host_token_indices(name, INDEXER_KEYS, step.kv_positions)
        return read_rows(pages, every, self.dtype)

    # ---- the cache work of one layer (attention.py calls it) ----
    def resolve(self, group: str, selected: torch.Tensor) -> torch.Tensor:
        """Resolve the decode rows' selection and fetch it into every layer of the group."""
        return self.batch.resolve(group, selected, fetch=True)

    def write_latents(self, name: str, latents: torch.Tensor, table: torch.Tensor,
                      start: torch.Tensor) -> None:
        """The step's latents [R, S, C]: positions below a row's in-flight ``start`` straight to
        host pages, the rest into the cells at ``table`` (``Batch.write_indices``)."""
        positions, batch = self.step.positions, self.batch
        flat = latents.reshape(-1, latents.shape[-1])
        if self.step.any_prefill:
            host = torch.where(positions < start[:, None], positions, BAD)
            index = batch.host_token_indices(name, LATENT, host)
            put_rows(self.manager.buffer_view(name, LATENT), index.flatten(), flat)
        column = (positions - start[:, None]).long()
        slot = table.gather(1, column.clamp(0, table.shape[1] - 1))
        inflight = (positions >= 0) & (column >= 0) & (column < table.shape[1])
        write_rows(self.batch.cells(name, LATENT), torch.where(inflight, slot, BAD).flatten(),
                   flat)

    def attend(self, module, q_pass, q_rot, k_pass, k_rot, topk, attention_mask, kwargs):
        """One layer's cache work and attention: ``q_pass`` [R, H, S, nope], ``q_rot`` [R, H, S,
        rope], the step's latent ``k_pass`` [R, 1, S, kv_lora] and rope part ``k_rot`` [R, 1, S,
        rope], the indexer's ``topk`` int32[R, S, k]. Returns the attention output [R, S, H,
        v_head_dim] (before ``o_proj``)."""
        spec, step, batch = self.spec, self.step, self.batch
        name, group, leads = module_layer(module)
        chosen = step.allowed.gather(-1, topk.long())  # the selection within the causal mask
        if leads:
            decode = chosen[:, 0] & step.decode_row[:, None]
            selected = torch.where(decode, topk[:, 0], BAD)
            width = spec.index_topk
            if selected.shape[1] < width:  # fewer keys than top-k: pad
                selected = torch.nn.functional.pad(selected, (0, width - selected.shape[1]),
                                                   value=BAD)
            index = self.resolve(group, selected)
            table, start = batch.write_indices(group)
            self._groups[group] = (index, selected, table, start)
        index, selected, table, start = self._groups[group]
        latents = torch.cat([k_pass[:, 0], k_rot[:, 0]], dim=-1)  # [R, S, C]
        self.write_latents(name, latents, table, start)
        cells = batch.cells(name, LATENT)
        if self.mode == "absorbed" and not step.any_prefill:
            return self._absorbed(module, q_pass, q_rot, cells, index)
        out = self._dense(module, q_pass, q_rot, latents, topk, chosen, cells, index, selected,
                          attention_mask, kwargs)
        if self.mode == "absorbed" and step.any_decode:
            absorbed = self._absorbed(module, q_pass, q_rot, cells, index)
            first = torch.where(step.decode_row[:, None, None, None], absorbed, out[:, :1])
            out = torch.cat([first, out[:, 1:]], dim=1)
        return out

    def _dense(self, module, q_pass, q_rot, latents, topk, chosen, cells, index, selected,
               attention_mask, kwargs):
        """Scatter-back: the selected latents at their positions of a [R, 1, T, ...] latent
        cache (zeros elsewhere, which the mask hides), then the stock attention math."""
        spec, step = self.spec, self.step
        R, S, C = latents.shape
        T, L = step.kv_length, spec.kv_lora_rank
        dense = latents.new_zeros(R, T + 1, C)  # column T takes what is not placed

        def place(columns, values):
            dense.scatter_(1, columns.long()[..., None].expand(-1, -1, C), values)

        # decode rows: their selection, read from the cells through the index table
        place(torch.where(index >= 0, selected, T), read_rows(cells, index, self.dtype))
        if step.any_prefill:
            # prefill rows: the selected history from the host pages, the chunk as computed
            history = (chosen & step.prefill_row[:, None, None]
                       & (topk < step.history[:, None, None]))
            wanted = torch.where(history, topk, BAD).flatten(1)
            name = module_layer(module)[0]
            host = self.batch.host_token_indices(name, LATENT, wanted)
            place(torch.where(host >= 0, wanted, T),
                  read_rows(self.manager.buffer_view(name, LATENT), host, self.dtype))
            mine = (step.positions >= 0) & step.prefill_row[:, None]
            place(torch.where(mine, step.positions, T), latents)
        k_pass = dense[:, None, :T, :L].contiguous()
        k_rot = dense[:, None, :T, L:].contiguous()
        return stock_attention(module, q_pass, q_rot, k_pass, k_rot, topk, attention_mask,
                               kwargs)

    def _absorbed(self, module, q_pass, q_rot, cells, index):
        """MLA weight absorption over the K selected latents of each decode row's query (the
        first query token): scores q_nope W_UK . latent + q_rope . rope, the output latent
        softmax-weighted, then W_UV. Computed in fp32. Returns [R, 1, H, v]."""
        spec = self.spec
        H, L, nope = spec.num_heads, spec.kv_lora_rank, spec.nope_dim
        weight = module.kv_b_proj.weight.view(H, nope + spec.v_dim, L)
        q_latent = torch.einsum("rhn,hnc->rhc", q_pass[:, :, 0].float(),
                                weight[:, :nope].float())
        q_rope = q_rot[:, :, 0].float()
        if self._decode_kernel is not None:
            rows = as_rows(cells, self.dtype)
            query = torch.cat([q_latent, q_rope], dim=-1).to(rows.dtype)
            out_latent = self._decode_kernel(query, rows, index, module.scaling).float()
        else:
            picked = read_rows(cells, index, self.dtype).float()  # [R, K, C]
            scores = (torch.einsum("rhc,rkc->rhk", q_latent, picked[..., :L])
                      + torch.einsum("rhd,rkd->rhk", q_rope, picked[..., L:])) * module.scaling
            scores = scores.masked_fill((index < 0)[:, None, :], float("-inf"))
            weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a hole selects nothing
            out_latent = torch.einsum("rhk,rkc->rhc", weights, picked[..., :L])
        out = torch.einsum("rhc,hvc->rhv", out_latent, weight[:, nope:].float())
        return out.to(self.dtype)[:, None]


def module_layer(module) -> tuple:
    """(torch_kvcm2 layer name, selection group id, whether the layer's own indexer selects)
    of an attention module, as ``attention.install`` recorded them: strings and a bool, which
    a compiled step reads as constants (a module's ``layer_idx`` may be traced symbolic)."""
    return module._torch_kvcm2_layer


def stock_attention(module, q_pass, q_rot, k_pass, k_rot, topk, attention_mask, kwargs):
    """transformers' own attention math of a DSA layer over a latent cache ``k_pass`` [R, 1, T,
    kv_lora] / ``k_rot`` [R, 1, T, rope]: ``expand_kv``, the indexer's selection folded into
    the mask, and the configured attention function (sdpa or eager), as the stock forward
    does after its cache update. Returns [R, S, H, v]."""
    modeling = sys.modules[type(module).__module__]
    R, S = q_pass.shape[0], q_pass.shape[2]
    query_states = torch.cat((q_pass, q_rot), dim=-1)
    key_states, value_states = module.expand_kv(k_pass, k_rot)
    index_mask = (topk.new_ones((R, S, key_states.shape[2]), dtype=torch.bool)
                  .scatter(-1, topk.long(), False).unsqueeze(1))
    if attention_mask.dtype == torch.bool:
        attention_mask = attention_mask & ~index_mask
    else:
        attention_mask = attention_mask.masked_fill(index_mask, torch.finfo(q_pass.dtype).min)
    interface = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
        module.config._attn_implementation, modeling.eager_attention_forward)
    out, _ = interface(module, query_states, key_states, value_states, attention_mask,
                       dropout=0.0, scaling=module.scaling, indices=None, **kwargs)
    return out


def _load_kernel(kernel: Optional[str]):
    if kernel is None:
        return None
    try:
        from . import sparse_mla
    except ImportError as error:
        raise RuntimeError(f"SparseMLACache: kernel={kernel!r} needs "
                           f"torch_kvcm2.models.sparse_mla ({error})") from error
    return (sparse_mla.sparse_mla_decode if kernel == "sparse_mla"
            else sparse_mla.sparse_mla_decode_reference)
