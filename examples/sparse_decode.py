"""End-to-end sparse-attention decoding with torch_kvcm2, checked against a dense reference.

A small DSA/NSA-style decoder (deterministic random weights) whose layers keep their latent KV
history in host pages and attend, each step, only to the units their selection group's indexer
picked, read back from the request's GPU cells. Layers 0-1 share indexer "g0", layers 2-3 share
"g1" (with the defaults); a group's first layer runs the indexer and the one resolve of the
group. Per layer two buffers:

* ``indexer_k``: dense, in a paged GPU pool; the indexer scores a query against the indexer keys
  of every history unit (a unit's score is the best of its tokens) and picks its top-K units;
* ``kv``: the sparse MLA-style latent (float16, stored as bytes), one row of latent per token.

Each query attends to its top-K earlier units plus the unit it is in (always, as in MoBA), all
read from the cells through the index table of ``Batch.resolve``. Prompts are prefilled (their
attention runs on the activations, as an engine's prefill kernel does; the cache only stores
them), then N tokens are decoded on the fast path. A decode step is one function of fixed-address
tensors (``SparseDecoder.decode_step``: the step's tokens, sampling noise and accepted counts in,
the next tokens out) with no host work: per selection group its indexer (the new indexer key
written into the dense pool, every key read back through the page table, the top-K units),
resolve and write indices; per layer fetch, the new token's latent written into its cell,
attention over the cells; then ``Batch.finish_step``: the flush of the accepted tokens and the
advance, which moves history and capacity on the device inside a page reserve kept per row
(``--reserve-pages``).
The host's part of a step is: the step's inputs into those tensors, page work only when a row
may run out of its reserve (then it waits for the device's lengths, and the publish takes the
row's next pages), ``publish`` (a no-op in steady state), and the step: called (eager), or
replayed as one CUDA graph (``--graph``) followed by ``record_advance``.

Every decode attention output is compared with a dense reference that keeps every token's
latent in an ordinary tensor; every indexer key read from the pool and, at the end, every history
token on the host pages are compared bit for bit, and no row may have been refused or cut short
by ``advance``. Any mismatch exits with status 1. The checks are not timed: eagerly they run
after each step; with ``--graph`` each replay's outputs are copied aside and checked after the
loop. The script prints tokens/s and the host time per step (median wall time of the host's part
of a step, as above), in every mode. Before building anything it estimates the memory the flags
need (``memory_parts``) and refuses, as a usage error naming the flag, a run the machine cannot
hold; phases that last more than a few seconds report their progress on stderr.

``--compile [reduce-overhead]`` runs each decode layer's cache work and attention
(``decode_layer``) as one ``torch.compile(fullgraph=True)`` module (or CUDA-graph replays),
checked against eager; ``--graph`` (CUDA) captures the whole step once as a CUDA graph;
``--draft-tokens N`` decodes speculatively (T = N + 1 query tokens per row, one resolve of all
their selections, a seeded accepted prefix of 1..T). examples/README.md describes each mode.

    python examples/sparse_decode.py [--graph | --compile [reduce-overhead]] [--draft-tokens N]
                                     [--device cpu] [--help]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import numpy as np
import torch

import torch_kvcm2 as kv
from torch_kvcm2 import BAD, ops

from flags import (add_device_flag, check_memory, chosen_device, cuda_usable, given,
                   needs_gpu, pick_device, positive_int, prompt_lengths, seed,
                   usage_error)  # examples/flags.py
from running import Progress, Timer, announce  # examples/running.py
from sparse_config import KEY_DTYPE, KV_DTYPE, build_config, memory_parts  # the cache config


class CheckFailed(Exception):
    pass


def check(ok: bool, what: str) -> None:
    if not ok:  # not `assert`: the checks must survive python -O
        raise CheckFailed(what)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", type=positive_int, default=4, help="requests decoded together")
    p.add_argument("--layers", type=positive_int, default=4, help="decoder layers")
    p.add_argument("--group-size", type=positive_int, default=2,
                   help="layers per selection group (layers sharing one indexer)")
    p.add_argument("--prompt-lengths", type=prompt_lengths, default="100,250,500,1000",
                   help="comma-separated prompt lengths, cycled over the rows")
    p.add_argument("--steps", type=positive_int, default=64, help="decode steps")
    p.add_argument("--topk", "-K", type=positive_int, default=8,
                   help="history units the indexer picks per row (the current unit comes on top)")
    p.add_argument("--slots", "-S", type=positive_int, default=argparse.SUPPRESS,
                   help="cell slots per request and selection group (default: 32, or with "
                        "--draft-tokens N, if more, the fewest that seat N + 1 selections)")
    p.add_argument("--tokens-per-unit", "-U", type=positive_int, default=4,
                   help="tokens per unit (what the indexer selects)")
    p.add_argument("--tokens-per-page", "-P", type=positive_int, default=16, help="tokens per page")
    p.add_argument("--inflight", type=positive_int, default=8,
                   help="max in-flight tokens per row (I)")
    p.add_argument("--d-model", type=positive_int, default=64, help="model width")
    p.add_argument("--heads", type=positive_int, default=4, help="attention heads")
    p.add_argument("--latent", type=positive_int, default=32,
                   help="latent KV width (float16 values; even)")
    p.add_argument("--index-dim", type=positive_int, default=16,
                   help="indexer key width (float32)")
    p.add_argument("--vocab", type=positive_int, default=512, help="vocabulary size")
    p.add_argument("--seed", type=seed, default=0, help="seed of the weights and the sampling")
    p.add_argument("--reserve-pages", type=positive_int, default=2,
                   help="pages each row keeps allocated beyond its capacity, so that the device "
                        "advances its lengths without the host (Batch.advance)")
    p.add_argument("--draft-tokens", type=int, default=0, metavar="N",
                   help="speculative decoding: each step the model proposes N draft tokens "
                        "after each row's next token (N + 1 query tokens per row, resolved "
                        "together) and a seeded verification accepts a random prefix of 1..N+1 "
                        "of them; 0: one token per row per step")
    add_device_flag(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--compile", nargs="?", const="default", choices=("default", "reduce-overhead"),
                      help="run each decode layer's cache ops and attention under "
                           "torch.compile(fullgraph=True) (mode 'default', or 'reduce-overhead': "
                           "CUDA graphs, GPU only), checked against eager")
    mode.add_argument("--graph", action="store_true",
                      help="capture the whole decode step once as one CUDA graph and replay it "
                           "for every step after the first (GPU only)")
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.draft_tokens < 0:
        p.error(f"argument --draft-tokens: {args.draft_tokens} is not >= 0")
    args.query_tokens = args.draft_tokens + 1  # T: query tokens per row per step
    if args.latent % 2:
        p.error(f"argument --latent: {args.latent} is odd; it must be even (the compiled cell "
                f"write moves 4-byte words)")
    if (args.compile or args.graph) and args.steps < 2:
        mode = "--graph" if args.graph else "--compile"
        p.error(f"argument --steps: {args.steps} is too few with {mode}: the first step "
                f"{'runs before the capture' if args.graph else 'compiles'} and is timed apart, "
                f"so at least 2 are needed")
    check_draft_flags(p, args)
    check_cache_flags(p, args, argv)
    # before anything is built: a config of absurd sizes takes long to build, and more to fill
    check_memory(p, argv, memory_parts(args), chosen_device(args.device))
    args.prompts = [args.prompt_lengths[i % len(args.prompt_lengths)] for i in range(args.rows)]
    try:  # any rule the checks above do not state: the library's own message
        build_config(args, torch.device("cpu"))
    except ValueError as error:
        p.error(f"these flags make an invalid cache config: {error}")
    return args


def check_cache_flags(p: argparse.ArgumentParser, args, argv) -> None:
    """The cache config's sparse rules (CFG-3), stated in this script's flags: the library would
    reject the same values with a ValueError naming its own fields. Without --slots the slots
    follow from other flags (those given on the command line ``argv`` are the ones named)."""
    P, U, K, I, T = (args.tokens_per_page, args.tokens_per_unit, args.topk, args.inflight,
                     args.query_tokens)
    if P % U:
        p.error(f"argument --tokens-per-unit/-U: {U} must divide --tokens-per-page/-P ({P})")
    units_per_page = P // U
    # the selection is the top-K units plus the query's own one: width K + 1; a step of T query
    # tokens per row seats the union of T selections (MTP-1)
    need = T * (K + 1) + kv.SparseSpec(tokens_per_unit=U, width=K + 1, slots=1,
                                       max_inflight_tokens=I).max_inflight_units
    derived = getattr(args, "slots", None) is None
    if derived:  # 32, or the fewest whole pages' units seating T, in whole pages
        args.slots = -(-max(32, need) // units_per_page) * units_per_page
    S = args.slots
    if derived and S > 65535:
        drivers = [("--topk", "-K"), ("--draft-tokens",), ("--inflight",),
                   ("--tokens-per-unit", "-U"), ("--tokens-per-page", "-P")]
        named = ["/".join(d) for d in drivers if given(argv, *d)] or ["/".join(drivers[0])]
        tokens = "(--draft-tokens + 1) x " if T > 1 else ""
        p.error(f"argument {', '.join(named)}: the cache would need {tokens}(--topk + 1) + "
                f"ceil(--inflight / --tokens-per-unit) + 1 = {need} slots per request and "
                f"selection group ({S} in whole pages), above its limit of 65535")
    if S % units_per_page:
        p.error(f"argument --slots/-S: {S} must be a multiple of the units per page "
                f"(--tokens-per-page / --tokens-per-unit = {units_per_page})")
    if S < need:
        tokens, what = (("(--draft-tokens + 1) x ", "the union of a step's selections") if T > 1
                        else ("", "a full selection"))
        p.error(f"argument --slots/-S: {S} is too small: the cache needs at least {tokens}"
                f"(--topk + 1) + ceil(--inflight / --tokens-per-unit) + 1 = {need} slots, so that "
                f"{what} fits next to a full in-flight range")
    if S > 65535:
        p.error(f"argument --slots/-S: {S} is above the cache's limit of 65535")


def check_draft_flags(p: argparse.ArgumentParser, args) -> None:
    """--draft-tokens N: every query token of a step is in flight (MTP-1), and half a row's
    reserve (rounded up) holds the most one step advances (T = N + 1 tokens): the batch tops a
    row's pages up only once more than half its reserve is used, so after a publish a row has
    room for ceil(reserve / 2) tokens at least, and ``advance`` needs no host."""
    T = args.query_tokens
    if T > args.inflight:
        p.error(f"argument --draft-tokens: {args.draft_tokens} drafts make {T} query tokens per "
                f"row, more than --inflight ({args.inflight}): every query token of a step is "
                f"in flight")
    reserve = args.reserve_pages * args.tokens_per_page
    if -(-reserve // 2) < T:
        p.error(f"argument --reserve-pages: {args.reserve_pages} page(s) of "
                f"{args.tokens_per_page} tokens is too few with --draft-tokens "
                f"{args.draft_tokens}: a row's pages are topped up once more than half its "
                f"reserve is used, so half of it must hold the {T} tokens one step may accept "
                f"(a reserve of at least {2 * T - 1} tokens)")


def pick_device_for(args) -> torch.device:
    device = pick_device(args.device)
    what = ("--compile reduce-overhead (CUDA graphs)" if args.compile == "reduce-overhead" else
            "--graph (one CUDA graph per decode step)" if args.graph else None)
    if what and device.type != "cuda":
        if cuda_usable():
            usage_error(f"{what} needs a GPU: drop --device cpu")
        needs_gpu(what)  # what is missing, as --device cuda says
    return device


def as_tokens(paged: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A paged uint8 buffer [pages, 1, P, B] (chunks=1: token-major) as one row of ``dtype`` per
    token index: token index i is page i // P, row i % P."""
    return paged.flatten(0, 2).view(dtype)


def write_tokens(target: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """target[index[r, j]] = values[r, j] for every index that is not BAD."""
    ok = index >= 0
    target[index[ok].long()] = values[ok]


# ---------------------------------------------------------------- the model

def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Model:
    """Token embeddings, and per layer: q = W_q x (H heads over the latent), latent = W_kv x,
    output W_o; a group's first layer also has the indexer's query and key projections."""

    def __init__(self, args, config, device):
        g = torch.Generator().manual_seed(args.seed)

        def weight(rows, cols):
            return (torch.randn(rows, cols, generator=g) / math.sqrt(rows)).to(device)

        d, H, D = args.d_model, args.heads, args.latent
        self.heads = H
        self.embedding = torch.randn(args.vocab, d, generator=g).to(device)
        self.w = {}
        shown = Progress("making the weights", len(config.layers), "layers",
                         flags=("--layers", "--d-model", "--heads", "--latent", "--vocab"))
        for group in config.selection_groups:
            for i, layer in enumerate(group.layers):
                shown.update(len(self.w))
                w = {"q": weight(d, H * D), "kv": weight(d, D), "o": weight(H * D, d)}
                if i == 0:
                    w.update(iq=weight(d, args.index_dim), ik=weight(d, args.index_dim))
                self.w[layer] = w

    def attention_inputs(self, layer, x):
        """(normed x, q float32[..., H, D], latent KV_DTYPE[..., D]) of tokens x[..., d]."""
        h, w = rms_norm(x), self.w[layer]
        q = (h @ w["q"]).unflatten(-1, (self.heads, -1))
        return h, q, (h @ w["kv"]).to(KV_DTYPE)

    def indexer_inputs(self, layer, h):
        w = self.w[layer]
        return h @ w["iq"], (h @ w["ik"]).to(KEY_DTYPE)

    def residual(self, layer, x, attended):
        return x + attended.flatten(-2) @ self.w[layer]["o"]

    def sample(self, x, noise):
        """The next token per row of hidden states x[R, d]: int64[R, 1] drawn from the softmax of
        unit-variance logits by the Gumbel-max rule with ``noise`` float32[R, vocab] (Gumbel
        samples, ``gumbel_noise``): argmax(logits + noise). Tensor ops only: capturable."""
        logits = rms_norm(x) @ self.embedding.T * x.shape[-1] ** -0.5
        return (logits.float() + noise).argmax(-1, keepdim=True)

    def propose(self, token, noise):
        """The draft head of speculative decoding: N tokens after ``token`` int64[R, 1], each
        sampled (``sample``, with ``noise[n]`` of float32[N, R, vocab]) from the previous
        token's embedding alone, a guess that skips the layers. Returns int64[R, N]. Tensor ops
        only: capturable."""
        drafts = []
        for n in range(noise.shape[0]):
            token = self.sample(self.embedding[token[:, 0]], noise[n])
            drafts.append(token)
        return torch.cat(drafts, 1)


def at_last_accepted(x, accepted):
    """Hidden states x[R, T, d] at each row's last accepted query token (``accepted``
    int32[R], 1..T): float32[R, d], where the next token is sampled. Fixed shapes."""
    if x.shape[1] == 1:
        return x[:, 0]
    last = (accepted - 1).long()[:, None, None].expand(-1, 1, x.shape[-1])
    return x.gather(1, last)[:, 0]


def gumbel_noise(shape, generator) -> torch.Tensor:
    """Standard Gumbel samples -log(-log(u)), u uniform in (0, 1), on the CPU."""
    u = torch.rand(shape, generator=generator, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
    return (-(-u.log()).log()).float()


# ---------------------------------------------------------------- indexer and attention

def select_units(query, keys, key_ok, qpos, K: int, U: int) -> torch.Tensor:
    """The indexer: per query (float32[R, Tq, Di] at positions qpos[R, Tq]) its own unit, then
    its top-K earlier units by the best score of their tokens' keys (keys[R, T, Di], key_ok[R, T]).
    Returns int32[R, Tq, K + 1] unit ordinals, -1 where fewer than K earlier units exist."""
    R, T = keys.shape[:2]
    scores = torch.einsum("rqd,rtd->rqt", query, keys.float())
    scores = scores.masked_fill(~key_ok[:, None, :], -math.inf)
    unit_scores = scores.unflatten(-1, (T // U, U)).amax(-1)
    current = qpos.div(U, rounding_mode="floor")
    earlier = torch.arange(T // U, device=keys.device) < current[..., None]
    # a short context has fewer than K units in all: pick what there is, pad the rest
    top = unit_scores.masked_fill(~earlier, -math.inf).topk(min(K, T // U), dim=-1)
    picks = torch.where(top.values > -math.inf, top.indices, BAD)
    padding = picks.new_full((*picks.shape[:-1], K - picks.shape[-1]), BAD)
    return torch.cat([current[..., None], picks, padding], -1).int()


def per_token(mask: torch.Tensor, U: int) -> torch.Tensor:
    """[..., W] per unit -> [..., W*U] per token (each entry repeated U times; no
    data-dependent shape)."""
    return mask[..., None].expand(*mask.shape, U).flatten(-2)


def unit_tokens(units: torch.Tensor, U: int) -> torch.Tensor:
    """[..., W] unit numbers u -> [..., W*U] token numbers u*U + t: with entries these are cell
    token indices (entry*U + t mod U), with ordinals token positions."""
    return (units[..., None].long() * U + torch.arange(U, device=units.device)).flatten(-2)


def softmax_attend(q, kv, valid):
    """Attention of q[..., H, D] over kv[..., N, D] where valid[..., N], in float32. The latent
    is both key and value (MLA with the projections absorbed)."""
    scores = torch.einsum("...hd,...nd->...hn", q, kv) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~valid[..., None, :], -math.inf)
    return torch.einsum("...hn,...nd->...hd", scores.softmax(-1), kv)


def write_rows(paged: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """paged's token index[r] = values[r] (one row of a whole number of 4-byte words per token)
    for every index that is not BAD, in a paged uint8 buffer or cells [n, 1, P, B], with fixed
    shapes (compilable, capturable): each token's bytes as int32 words get (new - old) added at
    valid indices and 0 at BAD ones (routed to token 0). Integer adds wrap exactly, and rows
    write distinct tokens, so the result is the new bits exactly. ``index_add_`` adds with
    atomics (``index_put_(accumulate=True)`` sorts the indices first and, in older torch
    versions, checks their range on the host, which a capture forbids)."""
    words = as_tokens(paged, torch.int32)
    new = values.contiguous().view(torch.int32)
    valid = index >= 0
    safe = torch.where(valid, index, 0).long()
    delta = torch.where(valid[:, None], new - words[safe], 0)
    words.index_add_(0, safe, delta)


def decode_layer(batch, group: int, layer: str, resolve: bool, selected, q, latent, positions,
                 U: int):
    """One decode layer's cache work and attention, as --compile compiles it, for T query tokens
    per row at ``positions`` int32[R, T] (in flight): on the group's first layer (``resolve``)
    the resolve of ``selected`` int32[R, T, W] (one resolve for all T) and write indices; then
    the layer's fetch, the T tokens' latents[R, T, D] written into their cells, and attention
    of every query token q[R, T, H, D] over its selected units read from the cells (causal: a
    query token sees the step's tokens up to its own)."""
    if resolve:
        batch.resolve(group, selected)
        batch.write_indices(group)
    state = batch.group(group)
    table = state.write_table
    batch.fetch(layer)
    cells = batch.cells(layer, "kv")
    column = (positions - state.inflight_start[:, None]).long()
    slot = table.gather(1, column.clamp(0, table.shape[1] - 1))
    write_rows(cells, torch.where((column >= 0) & (column < table.shape[1]), slot, BAD).flatten(),
               latent.flatten(0, 1))
    index = state.index_views[selected.shape[1] - 1]  # resolve's table, [R, T, W]
    return attend_cells(q, cells, index, selected, positions + 1, U)


def attend_cells(q, cells, index, selected, limit, U: int):
    """Decode attention of q[R, T, H, D] over the selected units, read from a layer's cells
    (uint8[cells, 1, P, B]) through the index table (int32[R, T, W] entries) of
    ``Batch.resolve``; ``selected`` (its unit ordinals) masks each unit's tokens at or past
    ``limit`` int32[R, T] (a query token's position + 1). A pure tensor function with fixed
    shapes."""
    latent = as_tokens(cells, KV_DTYPE)
    tokens = unit_tokens(index.clamp(min=0), U)
    valid = per_token(index >= 0, U) & (unit_tokens(selected, U) < limit[..., None])
    return softmax_attend(q, latent[tokens].float(), valid)


def attend_dense(q, kv, selected, qpos, U: int):
    """Attention of q[R, Tq, H, D] at positions qpos[R, Tq] over the selected units' tokens at
    or before qpos, taken from a dense latent kv[R, T, D] (prefill activations, the reference)."""
    positions = unit_tokens(selected, U)  # [R, Tq, W*U]
    valid = per_token(selected >= 0, U) & (positions <= qpos[..., None])
    rows = torch.arange(kv.shape[0], device=kv.device)[:, None, None]
    positions = positions.clamp(0, kv.shape[1] - 1)  # a unit may run past a prompt: masked
    return softmax_attend(q, kv[rows, positions].float(), valid)


# ---------------------------------------------------------------- dense reference

class DenseReference:
    """Every token's latent and indexer key in ordinary [rows, max_tokens, ...] tensors."""

    def __init__(self, config, args, device):
        R, T = args.rows, config.max_tokens_per_row
        self.kv = {layer.name: torch.zeros(R, T, args.latent, dtype=KV_DTYPE, device=device)
                   for layer in config.layers}
        self.keys = {g.layers[0]: torch.zeros(R, T, args.index_dim, dtype=KEY_DTYPE, device=device)
                     for g in config.selection_groups}

    @staticmethod
    def store(table, positions, values):
        ok = positions >= 0
        rows = torch.arange(table.shape[0], device=table.device)[:, None].expand_as(positions)
        table[rows[ok], positions[ok].long()] = values[ok]


# ---------------------------------------------------------------- the decoder

class SparseDecoder:
    """The model running on a torch_kvcm2 cache, with the dense reference alongside."""

    def __init__(self, args, device):
        self.args, self.device = args, device
        self.config = build_config(args, device)
        self.manager = kv.KVCacheManager(self.config)
        self.batch = kv.Batch(self.manager)
        self.model = Model(args, self.config, device)
        self.ref = DenseReference(self.config, args, device)
        self.caches = [self.manager.create_cache() for _ in args.prompts]
        for cache in self.caches:  # pages beyond capacity, so that advance needs no host
            cache.set_reserve(args.reserve_pages * args.tokens_per_page)
        R, T = args.rows, self.config.max_tokens_per_row
        self.all_positions = torch.arange(T, dtype=torch.int32, device=device).repeat(R, 1)
        # The static inputs of a decode step (a captured graph reads them at fixed addresses):
        # each row's token (the step writes the next one), the sampling noise, the draft head's
        # noise, and the query tokens each row accepts (its one token, or with drafts the
        # verification's prefix of 1..T).
        self.T, N = args.query_tokens, args.draft_tokens
        self.offsets = torch.arange(self.T, dtype=torch.int32, device=device)  # in a step
        self.tokens = torch.zeros(R, 1, dtype=torch.long, device=device)
        self.noise = torch.zeros(R, args.vocab, device=device)
        self.draft_noise = torch.zeros(N, R, args.vocab, device=device)
        self.accepted = torch.ones(R, dtype=torch.int32, device=device)
        self.sampler = torch.Generator().manual_seed(args.seed + 1)  # the prompts
        # Gumbel noise of every sampling (the prefill's, then each step's), made up front
        self.gumbel = gumbel_noise((args.steps + 1, R, args.vocab),
                                   torch.Generator().manual_seed(args.seed + 2)).to(device)
        # the verification's verdicts, made up front: plan[s, r] query tokens row r accepts
        # at step s (a random prefix of 1..T); the draft head's noise of every step
        self.plan = torch.ones(args.steps, R, dtype=torch.int32)
        self.draft_gumbel = None
        if N:
            verdicts = torch.Generator().manual_seed(args.seed + 3)
            self.plan = torch.randint(1, self.T + 1, (args.steps, R), generator=verdicts,
                                      dtype=torch.int32)
            self.draft_gumbel = gumbel_noise((args.steps, N, R, args.vocab), verdicts).to(device)
        # each row's tokens accepted before step s (host arithmetic for make_room and the checks)
        self.advanced = np.concatenate([np.zeros((1, R), dtype=np.int64),
                                        self.plan.numpy().astype(np.int64).cumsum(0)])
        self.plan = self.plan.to(device)
        self.decode_layer = decode_layer
        if args.compile:
            # one compiled graph per layer (its cells are guarded by identity) and per role
            torch._dynamo.config.recompile_limit = max(8, 2 * args.layers)
            self.decode_layer = torch.compile(decode_layer, fullgraph=True, dynamic=False,
                                              mode=args.compile)
        self.graph = None  # --graph: the captured decode step, and the outputs it writes
        self.graph_probes = None
        self.start_history = None  # each row's history when decoding starts
        self.checked, self.max_error, self.first_s = 0, 0.0, 0.0
        self.host_s = []  # host time of each timed step
        self.waits = 0  # steps whose host waited for the device's lengths (page work)
        self.replays = 0
        self.timer = Timer(device)  # runs during decode only

    # ---- cache access ----
    def token_indices(self, layer, role, positions):
        """Token indices of ``positions`` (int32[rows, N], -1 = none) in the buffer's paged view,
        through the page table of its pool group (OP-INDEX, token form)."""
        buf = self.manager.buffer(layer, role)
        out = torch.empty_like(positions)
        ops.convert_token_indices(out, positions, self.batch.page_table(layer, role),
                                  self.batch.capacity, buf.scale, buf.pos,
                                  self.config.tokens_per_page)
        return out

    def read_indexer_keys(self, layer):
        """Every row's indexer keys for all positions, read from the dense pool through the page
        table, and a mask of those that exist (below capacity). Fixed shapes."""
        index = self.token_indices(layer, "indexer_k", self.all_positions)
        keys = as_tokens(self.manager.buffer_view(layer, "indexer_k"), KEY_DTYPE)
        return keys[index.clamp(min=0).long()], index >= 0

    def check_indexer_keys(self, layer, keys, ok):
        check(torch.equal(keys[ok], self.ref.keys[layer][ok]), f"{layer}: indexer keys differ")

    def write_kv(self, layer, positions, latent, table, start):
        """Tokens at ``positions`` [rows, N] (-1 = none): [history, start) straight to their host
        pages (the prefill path), [start, capacity) into their cells (write_indices)."""
        host = torch.where((positions >= 0) & (positions < start[:, None]), positions, BAD)
        pages = as_tokens(self.manager.buffer_view(layer, "kv"), KV_DTYPE)
        write_tokens(pages, self.batch.host_token_indices(layer, "kv", host), latent)
        column = (positions - start[:, None]).long()
        in_cells = (positions >= 0) & (column >= 0)
        index = torch.where(in_cells, table.gather(1, column.clamp(0, table.shape[1] - 1)), BAD)
        write_tokens(as_tokens(self.batch.cells(layer, "kv"), KV_DTYPE), index, latent)

    # ---- the prefill (eager, host path) ----
    def prefill(self) -> None:
        """Seat every request with its prompt as new tokens, run the prompts through every layer
        (attention over the activations; KV into host pages and cells), flush, take history
        over them with room for the first decode step's T query tokens, and sample the first
        decoded token into ``self.tokens``."""
        batch, U, K = self.batch, self.args.tokens_per_unit, self.args.topk
        for cache, length in zip(self.caches, self.args.prompts):
            check(cache.resize(capacity=length), "resize: out of pages")  # the whole prompt is new
            batch.add(cache)
        R, N = self.args.rows, max(self.args.prompts)
        tokens = torch.randint(self.args.vocab, (R, N), generator=self.sampler).to(self.device)
        qpos = torch.arange(N, dtype=torch.int32, device=self.device).repeat(R, 1)
        lengths = torch.tensor(self.args.prompts, device=self.device)
        positions = torch.where(qpos < lengths[:, None], qpos, BAD)
        batch.publish()
        x = self.model.embedding[tokens]
        shown, done = Progress("prefill", len(self.config.layers), "layers",
                               flags=("--prompt-lengths", "--rows", "--layers")), 0
        for group in self.config.selection_groups:
            for i, layer in enumerate(group.layers):
                h, q, latent = self.model.attention_inputs(layer, x)
                if i == 0:  # the group's indexer, shared by its layers
                    iq, ik = self.model.indexer_inputs(layer, h)
                    self.ref.store(self.ref.keys[layer], positions, ik)
                    view = as_tokens(self.manager.buffer_view(layer, "indexer_k"), KEY_DTYPE)
                    write_tokens(view, self.token_indices(layer, "indexer_k", positions), ik)
                    keys, key_ok = self.read_indexer_keys(layer)
                    self.check_indexer_keys(layer, keys, key_ok)
                    selected = select_units(iq, keys, key_ok, qpos, K, U)
                    # a prefill has no history to select from: resolve seats its tail
                    batch.resolve(group.index, torch.full_like(selected[:, 0], BAD))
                    table, start = batch.write_indices(group.index)
                self.ref.store(self.ref.kv[layer], positions, latent)
                batch.fetch(layer)  # every layer of the group, after each resolve
                self.write_kv(layer, positions, latent, table, start)
                out = attend_dense(q, latent, selected, qpos, U)
                x = self.model.residual(layer, x, out)
                done += 1
                shown.update(done)
        batch.record_host_writes()  # the prefill wrote [history, start) to host pages
        batch.flush()
        for cache in self.caches:  # flushed: history advances; room for the next T tokens
            check(cache.resize(history=cache.capacity, capacity=cache.capacity + self.T),
                  "resize: out of pages")
        batch.publish()
        last = x[torch.arange(R, device=self.device), lengths - 1]
        self.tokens.copy_(self.model.sample(last, self.gumbel[0]))
        self.start_history = np.array([c.history_length for c in self.caches], dtype=np.int64)

    # ---- one decode step ----
    def decode_step(self) -> dict:
        """One whole decode step on the static inputs ``tokens``, ``noise``, ``draft_noise``
        and ``accepted``, with no host work and fixed shapes, so that it can be captured as one
        CUDA graph (and traced with fullgraph=True). Each row runs T query tokens at positions
        history + 0..T-1, its in-flight range: its next token, then (with --draft-tokens) the
        draft head's N proposals after it. Per selection group its indexer (the T tokens'
        indexer keys into the dense pool, every key read back through the page table, each
        query token's top-K units), one resolve of all T selections and write indices; per
        layer fetch, the T tokens' latents into their cells, attention of every query token
        over the cells; ``finish_step``: the flush of the accepted tokens only and the advance
        of the lengths by them on the device (capacity stays history + T: rejected positions
        are in flight again next step, and rewritten); the next token sampled at each row's last accepted query
        token into ``tokens``. Needs the batch published (``host_part``).

        Returns what the checks read (``check_step``), by name: a replayed graph's outputs,
        overwritten by its next replay."""
        batch, model, U, K = self.batch, self.model, self.args.tokens_per_unit, self.args.topk
        qpos = batch.history[:, None] + self.offsets  # int32[R, T]: capacity is history + T
        probes = {"qpos": qpos}
        tokens = self.tokens
        if self.T > 1:
            tokens = torch.cat([tokens, model.propose(tokens, self.draft_noise)], 1)
        x = model.embedding[tokens]
        for group in self.config.selection_groups:
            for i, layer in enumerate(group.layers):
                h, q, latent = model.attention_inputs(layer, x)
                if i == 0:  # the group's indexer and its one resolve, shared by its layers
                    iq, ik = model.indexer_inputs(layer, h)
                    index = self.token_indices(layer, "indexer_k", qpos)
                    write_rows(self.manager.buffer_view(layer, "indexer_k"), index.flatten(),
                               ik.flatten(0, 1))
                    keys, key_ok = self.read_indexer_keys(layer)
                    selected = select_units(iq, keys, key_ok, qpos, K, U)
                    probes.update({f"ik:{layer}": ik, f"keys:{layer}": keys,
                                   f"key_ok:{layer}": key_ok, f"selected:{group.name}": selected})
                out = self.decode_layer(batch, group.index, layer, i == 0, selected, q, latent,
                                        qpos, U)
                if self.args.compile == "reduce-overhead":
                    out = out.clone()  # a CUDA-graph output is overwritten by the next replay
                probes.update({f"q:{layer}": q, f"latent:{layer}": latent, f"out:{layer}": out})
                x = model.residual(layer, x, out)
        # only the accepted tokens go to host pages, then history over them and capacity
        # history + T, on the device (flush to history + accepted, then advance)
        batch.finish_step(self.accepted)
        self.tokens.copy_(model.sample(at_last_accepted(x, self.accepted), self.noise))
        return probes

    def host_part(self, step: int, run=None) -> dict:
        """The host's part of decode step ``step`` (numbered from 0) around the step: ``run``
        None calls ``decode_step`` eagerly; else ``run()`` is the step run without the host (a
        graph replay, or a traced ``decode_step``) and returns its probes. In order: the step's
        noise into its static tensor; page work only when a row may need it (``make_room``);
        ``publish`` (nothing to upload in steady state: it takes a finished length read-back and
        allocates the next pages of rows that reached their reserve); the step; after a step run
        without the host, ``record_advance``, which queues the read-back of what the step's
        flush and advance moved on the device (lengths and the written watermark: with a
        read-back pending, ``poll`` would queue just that again)."""
        self.noise.copy_(self.gumbel[step + 1])
        if self.T > 1:  # the draft head's noise and the verification's verdicts
            self.draft_noise.copy_(self.draft_gumbel[step])
            self.accepted.copy_(self.plan[step])
        self.make_room(step)
        self.batch.publish()
        if run is None:
            return self.decode_step()  # eager: flush and advance do their host records
        probes = run()
        self.batch.record_advance()
        return probes

    def make_room(self, step: int) -> None:
        """Before step ``step``, which advances each row by the tokens it accepts (1, or with
        drafts the verification's 1..T, known to the host up front) on the device within its
        allocated pages: the host mirror (``Batch.host_tables``) holds the lengths of the last
        read-back the host took, ``behind`` tokens ago; a row it cannot show has room for this
        step's advance makes the host wait for the latest read-back (``Batch.poll``), after
        which ``publish`` allocates that row's next pages. With a reserve of a few pages this
        happens once every few dozen steps at most, and only when the device's lengths never
        came back in time (the device is that far behind the host)."""
        lengths = self.batch.host_tables()["lengths"]  # history, capacity, lease, ..., allocated
        history, capacity, allocated = (lengths[i].astype(np.int64) for i in (0, 1, 5))
        behind = self.start_history + self.advanced[step] - history
        moves = self.advanced[step + 1] - self.advanced[step]  # this step's advance per row
        if (allocated - capacity - behind < moves).any():
            self.batch.poll()
            self.waits += 1

    # ---- the checks (not timed) ----
    def check_step(self, probes: dict) -> None:
        """A decode step's outputs: the reference takes the T query tokens' latents and indexer
        keys (overwriting the rejected drafts of the step before at the same positions);
        every indexer key the step read from the pool equals the reference's; every attention
        output equals attention over the dense reference (and, with --compile, eager attention
        over the same cells, which hold what they held during the step until the next one)."""
        U, qpos = self.args.tokens_per_unit, probes["qpos"]
        for group in self.config.selection_groups:
            leader = group.layers[0]
            self.ref.store(self.ref.keys[leader], qpos, probes[f"ik:{leader}"])
            self.check_indexer_keys(leader, probes[f"keys:{leader}"], probes[f"key_ok:{leader}"])
            selected = probes[f"selected:{group.name}"]
            for layer in group.layers:
                q, out = probes[f"q:{layer}"], probes[f"out:{layer}"]
                self.ref.store(self.ref.kv[layer], qpos, probes[f"latent:{layer}"])
                if self.args.compile:
                    eager = attend_cells(q, self.batch.cells(layer, "kv"),
                                         self.batch.group(group.index).index_views[self.T - 1],
                                         selected, qpos + 1, U)
                    torch.testing.assert_close(out, eager,
                                               msg=lambda m: f"{layer}: compiled != eager\n{m}")
                want = attend_dense(q, self.ref.kv[layer], selected, qpos, U)
                torch.testing.assert_close(out, want,
                                           msg=lambda m: f"{layer}: cells != dense reference\n{m}")
                self.max_error = max(self.max_error, (out - want).abs().max().item())
                self.checked += out.shape[0] * out.shape[1]  # rows x query tokens

    # ---- the run ----
    def capture(self) -> None:
        """--graph: capture ``decode_step`` once (capture runs nothing: no state changes). The
        batch must be published; the step's kernels ran once before (the first step, eagerly)."""
        self.batch.publish()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.graph_probes = self.decode_step()

    def replay(self) -> dict:
        self.graph.replay()
        self.replays += 1
        return self.graph_probes

    def decode(self, steps: int) -> None:
        """Decode ``steps`` tokens per row. With --compile the first step compiles (and, in
        reduce-overhead mode, the next two record the CUDA graphs); with --graph it runs eagerly
        and is followed by the capture: either is timed apart. Eagerly each step is checked after
        it ran; with --graph each replay's outputs are copied aside (untimed) and checked after
        the loop."""
        kept = []
        shown = Progress("decode", steps, flags=("--steps",))
        for step in range(steps):
            first = step == 0 and bool(self.args.compile or self.args.graph)
            if first:
                self.timer.stop()
                if self.args.compile:
                    announce("compiling the decode step (first step, may take a minute)...")
                started = time.perf_counter()
            begin = time.perf_counter()
            probes = self.host_part(step, self.replay if self.graph else None)
            host = time.perf_counter() - begin
            if self.graph is None:
                with self.timer.paused():
                    self.check_step(probes)
            else:
                with self.timer.paused(sync=False):  # copies queued after the replay
                    kept.append({name: t.clone() for name, t in probes.items()})
            if first:
                if self.args.graph:
                    self.capture()
                self.first_s = time.perf_counter() - started
                self.timer.start()
            else:
                self.host_s.append(host)
            shown.update(step + 1)
        self.timer.stop()
        checking = Progress("checking the replays", len(kept), flags=("--steps",))
        for number, probes in enumerate(kept):
            self.check_step(probes)
            checking.update(number + 1)

    def verify(self) -> int:
        """After decoding: no row was refused or cut short by advance; every row's history is
        its prompt plus the tokens it accepted, and its written watermark is its history (the
        flushes wrote back no rejected draft); every history token of every layer is on its host
        pages, bit for bit. Returns the tokens x layers verified."""
        batch = self.batch
        refused, short = batch.advance_counters.tolist()
        check(refused == 0 and short == 0, f"advance refused {refused} and cut short {short} rows")
        batch.poll()  # the lengths the device's last advance left (getters read the last poll)
        history = [c.history_length for c in self.caches]
        expected = (self.start_history + self.advanced[-1]).tolist()
        check(history == expected, f"history {history} after decoding, expected {expected}")
        written = [c.written for c in self.caches]
        check(written == history, f"written watermarks {written} after decoding, expected the "
                                  f"histories {history}")
        batch.publish()
        history = torch.tensor(history, device=self.device)
        positions = torch.where(self.all_positions < history[:, None], self.all_positions, BAD)
        shown = Progress("verifying the host pages", len(self.ref.kv), "layers",
                         flags=("--prompt-lengths", "--steps", "--rows"))
        for number, layer in enumerate(self.ref.kv):
            shown.update(number)
            index = batch.host_token_indices(layer, "kv", positions)
            pages = as_tokens(self.manager.buffer_view(layer, "kv"), KV_DTYPE)
            ok = index >= 0
            check(torch.equal(ok, positions >= 0), f"{layer}: a history token has no host page")
            check(torch.equal(pages[index[ok].long()], self.ref.kv[layer][ok]),
                  f"{layer}: host pages differ from the reference")
        return int(history.sum()) * len(self.ref.kv)


def report(run: SparseDecoder, args, host_tokens: int) -> None:
    batch, config = run.batch, run.config
    print(f"checks passed: {run.checked} decode attention outputs match the dense reference "
          f"(max abs diff {run.max_error:.1e}){' and eager' if args.compile else ''}; "
          f"{host_tokens} history tokens x layer verified on host pages")
    # each query token's own unit is in flight, hence resident: a hit every step, counted once
    # per row however many of the step's query tokens it holds
    U, T = args.tokens_per_unit, run.T
    first = run.start_history + run.advanced[:-1]  # [steps, R]: each step's first position
    own = int(((first + T - 1) // U - first // U + 1).sum())
    whose = "the query's own unit" if T == 1 else "the query tokens' own units"
    for group in config.selection_groups:
        s = batch.hit_rate(group.index)
        print(f"hit rate {group.name} ({', '.join(group.layers)}): {s['hit_rate']:.2f} "
              f"({s['hits']} hits, {own} of them {whose}; {s['misses']} misses; "
              f"{s['invalid']} invalid)")
    B = args.latent * KV_DTYPE.itemsize
    cells = args.slots * args.tokens_per_unit * B
    longest = max(c.history_length for c in run.caches)
    dense = longest * B
    print(f"GPU bytes per request per sparse layer: cells {cells:,} B ({args.slots} slots x "
          f"{args.tokens_per_unit} tokens x {B} B) vs a dense layout {dense:,} B ({longest} "
          f"tokens of history x {B} B): {cells / dense:.0%}; all {args.layers} layers: "
          f"{cells * args.layers:,} B vs {dense * args.layers:,} B")
    apart = bool(args.compile or args.graph)  # the first step is timed apart
    tokens = int(run.advanced[-1].sum() - run.advanced[int(apart)].sum())  # accepted, timed
    note = ""
    if args.compile:
        note = f"; the first step, which compiled ({args.compile} mode), took {run.first_s:.1f} s"
    elif args.graph:
        note = f"; the first step, run eagerly, and the capture took {run.first_s:.2f} s"
    note += " and is not counted" if apart else ""
    rate = f"{tokens / run.timer.elapsed:.0f} tokens/s" if run.timer.elapsed > 0 else "-"
    host = f"{statistics.median(run.host_s) * 1e6:.0f} us" if run.host_s else "-"
    print(f"decode: {tokens} tokens in {run.timer.elapsed:.2f} s = {rate}, host time per step "
          f"{host} (median) ({args.rows} row{'s' if args.rows != 1 else ''}; checks not "
          f"counted{note})")


def report_drafts(run: SparseDecoder, args) -> None:
    """--draft-tokens: how many query tokens the verification accepted per row per step."""
    total, steps = int(run.advanced[-1].sum()), args.steps * args.rows
    queries = steps * run.T
    print(f"speculative: {args.draft_tokens} draft token(s) per row per step ({run.T} query "
          f"tokens, one resolve per selection group); accepted {total / steps:.2f} tokens per row "
          f"per step on average ({total} of {queries} query tokens; {queries - total} rejected, "
          f"kept out of history and rewritten the next step)")


def check_graph(run: SparseDecoder, args) -> None:
    """--graph really replayed: one replay per step after the first."""
    check(run.replays == args.steps - 1, f"--graph: {run.replays} replays for {args.steps} steps")
    print(f"graph: the whole decode step captured once as one CUDA graph, replayed "
          f"{run.replays} times; {args.reserve_pages} reserve page(s) per row; the host waited "
          f"for the device's lengths before {run.waits} step(s)")


def check_compiled(args) -> None:
    """The compiled module really ran compiled: at most two graphs per layer (its group's first
    layer resolves, the others do not), none skipped by CUDA graphs."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    check(0 < graphs <= 2 * args.layers, f"--compile: {graphs} graphs for {args.layers} layers")
    skips = counters["inductor"]["cudagraph_skips"]
    check(args.compile != "reduce-overhead" or skips == 0, f"--compile: {skips} CUDA-graph skips")
    print(f"compiled: {graphs} graphs ({args.compile} mode), "
          f"{'0 CUDA-graph skips' if args.compile == 'reduce-overhead' else 'no CUDA graphs'}")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = pick_device_for(args)
    run = SparseDecoder(args, device)
    groups = [f"{g.name}: {', '.join(g.layers)}" for g in run.config.selection_groups]
    groups = "; ".join(groups if len(groups) <= 4 else groups[:2] + [f"... {len(groups)} groups"])
    print(f"device {device}: {args.rows} request(s), prompts {args.prompts}, {args.layers} layers "
          f"({groups}); units of {args.tokens_per_unit} tokens, top-{args.topk} units + the "
          f"current one, {args.slots} slots per request"
          f"{f'; {args.draft_tokens} draft token(s) per step' if args.draft_tokens else ''}",
          flush=True)
    try:
        run.prefill()
        run.timer.start()
        run.decode(args.steps)
        host_tokens = run.verify()
        if args.compile:
            check_compiled(args)
        if args.graph:
            check_graph(run, args)
    except (CheckFailed, AssertionError) as error:
        sys.stderr.write(f"\nCHECK FAILED: {error}\n")
        return 1
    report(run, args, host_tokens)
    if args.draft_tokens:
        report_drafts(run, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
