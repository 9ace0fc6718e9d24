"""P-SERVE (ENG-5, docs/REQUIREMENTS.md): decode throughput of a DeepSeek-V3.2-shaped stand-in model
with torch_kvcm2 (sparse latents on host pages, a GPU working set of cells per request) against
the dense baseline (every token's KV in paged GPU pools, what an engine does without offload),
same model, same budgets, same selections.

    python benchmarks/serve.py [--json out.json] [--plot out.png] [--contexts 32768,131072]
    python benchmarks/serve.py --quick        # CPU, tiny shapes, about a minute (tested in CI)
    python benchmarks/serve.py --overlap      # torch_kvcm2 also with the fetches overlapped
    python benchmarks/serve.py --slots-sweep 2112,4096,8192  # torch_kvcm2 again at each S
    python benchmarks/serve.py --attention mla  # DeepSeek-V3.2's attention modules (transformers)

The stand-in model, per layer and decode step (each part a flag, defaults below):

* weights: a GEMM of the batch against the GPU's share of the layer's weights -- the attention
  and shared expert (``--dense-weight-mb``), plus the routed experts the node's tokens touch:
  of ``--experts-per-gpu`` local experts of ``--expert-mb`` each, 8 of 256 routed per token,
  over the batch of every GPU of the node (``--node-gpus``, data-parallel attention), the
  expected number touched, ``E (1 - (1 - 8/256)^(B x gpus))``: the fixed cost batching
  amortises;
* the indexer: each row's query scores every dense indexer key of its context (``--key-bytes``
  per token per layer, read from its GPU pages once; a key's score is the low 20 bits of its
  int32 words' sum) and takes the top K (``--top-k``) with the radix select of benchmarks/topk.py
  (an engine's kind of top-k: ``torch.topk`` over these int32 scores took 1.18 ms per layer at
  116 requests and 32K on the H200, 2026-12-02); with ``--attention mla`` (float logits) with
  ``torch.topk`` instead, faster than the radix select there at every shape measured (H100,
  2026-12-08; benchmarks/topk.py has the figures); ``--topk radix|torch`` forces one. The query's
  preference is the locality model's (benchmarks/locality.py: each step ``--turnover`` of the
  top K replaced, ``--returning`` of the entering units ones that left a geometric
  ``--reuse-age`` steps before, the rest new; the defaults fit the published LRU miss rates at
  top-k 2048: 30% / 13.4% / 6.7% with 2048 / 4096 / 8192 slots): its selection is added to the
  scores as a bias, so the top-K the step uses is the top-K the indexer computed, and it equals
  the locality model's selection (checked); with ``--attention mla`` the indexer is
  DeepSeek-V3.2's own (64 heads of 128 over 132-byte FP8 keys, ``torch_kvcm2.models.
  indexer_logits``; the selection overwrites its positions of the logits, and each level checks
  the kernel's logits over the pool against their definition);
* attention: the K selected ``--latent-bytes`` rows per layer, gathered as int32 words through
  the index table from the cells (torch_kvcm2) or through the page table from the dense pool
  (baseline), summed; with ``--attention mla``, DeepSeek-V3.2's own attention modules instead
  (benchmarks/serve_mla.py: transformers' ``DeepseekV32Attention`` with random weights at real
  shapes, absorbed over the K selected 656-byte FP8 rows by the project's sparse MLA kernel, the
  output projection; ``--dense-weight-mb`` then defaults to the shared expert's 44 MB), its
  output checked against the kernel's reference over the rows written. Gathers and scores move int32 words: a byte gather ran attention at 146
  GB/s on the H200, an order below the FP8 kernel it stands for (docs/DESIGN.md, "The serving
  benchmark").

torch_kvcm2's step adds, per selection group (``--layers-per-indexer`` layers share one;
DeepSeek-V3.2 has one indexer per layer), ``resolve`` with the fetch of the misses from host
pages, the new token's latent written into its cell, ``flush`` of it to host pages and
``advance``; the baseline writes the new token into its pool and advances. Both run their whole
device step as one CUDA graph per concurrency (eagerly on the CPU), with the host's ``publish``
before and ``record_advance`` after each replay and a synchronisation per step (an engine reads
each step's sampled tokens): TPOT is that wall time per step; "host ms" is the part of it in
``publish`` and ``record_advance``.

``--overlap`` runs every torch_kvcm2 level twice, the second time (rows ``kv+ov``, ``overlap``
in the JSON) with each layer's fetch on a side stream (``kv.FetchStream``): layer l+1's
indexer, resolve and fetch are issued before layer l's attention (one layer of lookahead: the
stand-in's indexer reads only the keys), so its misses cross PCIe while layer l's weights GEMM
and attention run; each layer's attention waits for its own fetch by an event, inside the one
captured graph. The summary gives TPOT p50 with over without, per level (``overlap_tpot_ratio``).

``--kernels N`` runs the timed steps of the levels of 1-2 requests under ``torch.profiler`` and
reports their N costliest kernels (operators on the CPU) in µs a step (a progress line and
``kernels_us`` in the JSON): where the difference between the two sides at low concurrency
goes. Those levels' TPOT then includes the profiler's cost.

``--slots-sweep`` runs torch_kvcm2 again at each S (cells per row and layer; default 4096, 2x
the top-k, as vLLM's hot buffer) at its best concurrency of the sweep (fewer where S's cells
leave room for fewer): the hit rate counted against the model's and the published one, the
step time and the most requests S leaves room for (``print_slots``). S must exceed K: the
published 2048-slot point is S = 2112 here (the decoded token's cell, a page of units over).

Each level is set against its physical bound (``step_bound``): the fastest its step could run
with every part overlapped, the slowest of its HBM bytes (weights, indexer keys, the gathered
rows) at the device-copy rate, its FLOPs (the weights' product) at a bf16 GEMM's rate, and its
misses over PCIe at the slower of the copy engine and the GPU's own gather from pinned memory,
all measured at the start of the same run (``measure_ceilings``; the gather's rate differs from
host to host). The table gives the bound, the term that sets it and the step's fraction of it
("of bound": 1.0 is the GPU's limit); the summary gives each side's at its best throughput. With
``--attention mla`` the bound adds the modules' weights to the bytes and their products, the
indexer's 2 * 64 * 128 FLOPs per key and the attention kernel's to the FLOPs; without it the
bound is the stand-in's (a word gather with none of MLA's arithmetic).

Budgets, the same for both sides: the KV GPU budget one H200 of an 8xH200 node has left after
DeepSeek-V3.2's weights (FP8, ~690 GB over 8 GPUs = 86 GB; 10 GB of activations and workspace:
``--gpu-kv-gb`` 45 of 141 GB) and one GPU's share of a 2 TiB host (``--host-gb`` 240 of 256,
16 for the OS and the engine). With ``--layers`` below ``--model-layers`` (61) both budgets and
the weights scale by layers/61, so concurrency is the full model's and the per-step costs are
the run's layers' share (tokens/s is then the scaled model's; the ratios carry over). The GPU
machine has 128 GiB of host memory: the H200 run uses 4 layers (a 15.7 GB host budget).

Per context, concurrency is swept 1, 2, 4, ... and then each side's maximum at ``--layers``;
then 1 and 2 requests again with ``--low-layers`` (default all 61: at 1-2 requests the host's
per-step work is a fixed cost that a 4-layer run would weigh 15x too heavily against the GPU's;
the low-concurrency figure is taken from these). Each level: requests of ``context`` tokens
(prompt; ``--output`` tokens of decode each) admitted by ``KVCacheManager.can_fit`` into a batch
of that many rows, until the pools (or the batch's cells) refuse: the binding resource is the
medium that refused. Prefill is not timed: every request's history is written straight to its
pages (host pages for torch_kvcm2's latents). Each level decodes ``--steps`` timed steps after a
warm-up. Checks, every level: what attention gathered in the last step equals the bytes the
stand-in model wrote for those tokens (sampled rows, first and last layer); the indexer's top-K
equals the locality model's selection; the misses counted by ``manager.metrics()`` are within
5% of the locality model's under a plain LRU of S slots (``lru_misses``: the resolve breaks ties
between units touched in one step its own way); every decoded token's latent reached its pages
(host pages, read back) and its indexer key its pool page (in the pool's layout) bit for bit;
after the level every pool slot and batch byte is back (``stats()``).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_kvcm2 as kv  # noqa: E402
from torch_kvcm2.memory import (batch_memory_bytes, batch_reserve_bytes,  # noqa: E402
                                pool_group_count)
from harness import Result, pick_device, write_json  # noqa: E402
from locality import Reuse  # noqa: E402
from serve_mla import MLA, mla_param_bytes  # noqa: E402
from serve_model import (DecodeStep, key_words, latent_words, token_rows, write_keys,  # noqa: E402
                         write_tokens)
from serve_report import (measure_ceilings, plot, print_slots, print_table,  # noqa: E402,F401
                          step_bound, summarize)

@dataclass
class Shape:
    """One run's geometry, budgets and stand-in model (argument docs in ``parse_args``)."""
    layers: int = 61
    model_layers: int = 61
    latent_bytes: int = 656
    key_bytes: int = 132
    top_k: int = 2048
    slots: int = 4096
    page: int = 64
    layers_per_indexer: int = 1
    turnover: float = Reuse.turnover
    returning: float = Reuse.returning
    reuse_age: float = Reuse.age
    topk: str = "auto"  # the indexer's top-k: "radix" (benchmarks/topk.py), "torch" (torch.topk) or
    # "auto": the one measured faster on the scores the attention mode gives (module docstring)
    attention: str = "gather"  # "mla": DeepSeek-V3.2's attention modules (benchmarks/serve_mla.py)
    model_hidden: int = 7168  # the modules' shapes (--attention mla)
    heads: int = 128
    q_lora: int = 1536
    nope: int = 128
    v_dim: int = 128
    index_heads: int = 64
    output: int = 2048
    steps: int = 16
    warmup: int = 12  # the LRU set fills in ~10 steps at S = 8192 (benchmarks/locality.py)
    gpu_kv_gb: float = 45.0
    host_gb: float = 240.0
    dense_weight_mb: float = 67.0
    expert_mb: float = 44.0
    experts_per_gpu: int = 32
    node_gpus: int = 8
    hidden: int = 4096
    max_concurrency: int = 512
    overlap: bool = False  # also run torch_kvcm2's levels with the fetches on a side stream
    gpu_history_gb: float = 0.0  # torch_kvcm2's GPU-resident history (RSD-1), of gpu_kv_gb
    kernels: int = 0  # at 1-2 requests, the timed steps under the profiler: this many kernels

    @property
    def scale(self) -> float:
        return self.layers / self.model_layers

    @property
    def topk_kind(self) -> str:
        """The top-k both sides run: ``topk``, "auto" resolved by the attention mode."""
        if self.topk != "auto":
            return self.topk
        return "torch" if self.attention == "mla" else "radix"

    @property
    def reuse(self) -> Reuse:
        """The selection locality model (benchmarks/locality.py)."""
        return Reuse(self.turnover, self.returning, self.reuse_age)

    @property
    def level_steps(self) -> int:
        """Steps one level runs: the warm-up, the timed ones and the eager step timed by part."""
        return self.warmup + self.steps + 1

    def weight_bytes(self, rows: int) -> int:
        """Bytes of weights one layer's GEMMs read for a batch of ``rows`` (module docstring)."""
        touched = self.experts_per_gpu * (1 - (1 - 8 / 256) ** (rows * self.node_gpus))
        return int((self.dense_weight_mb + self.expert_mb * touched) * 1e6)


QUICK = Shape(layers=2, model_layers=3, latent_bytes=64, key_bytes=16, top_k=32, slots=64, page=16,
              output=256, steps=4, warmup=6, gpu_kv_gb=0.0009, host_gb=0.00225, dense_weight_mb=0.05,
              expert_mb=0.01, experts_per_gpu=4, hidden=64, max_concurrency=64, model_hidden=64,
              heads=2, q_lora=32, nope=16, v_dim=16, index_heads=4)
MLA_DENSE_WEIGHT_MB = 44.0  # the shared expert (FP8) when the attention's weights are the modules'
# --quick --attention mla: the kernel's 656-byte FP8 rows, budgets grown to hold them
QUICK_MLA = replace(QUICK, latent_bytes=656, key_bytes=132, gpu_kv_gb=0.005, host_gb=0.012)


def plan_rows(shape: Shape, side: str, device: str, context: int) -> tuple:
    """(the most requests of ``context`` + ``output`` tokens the budgets hold, the medium that
    binds): a manager reserves its batch memory (the cells on torch_kvcm2's side, the GPU
    history pages) for ``max_rows`` rows at construction (``batch_reserve_bytes``), so the rows
    and the requests' pages share each budget; the largest count that fits both, by bisection."""
    config = build_config(shape, side, device, context, 1)
    pages = -(-(context + shape.output) // shape.page)
    # a request's page of every buffer, per medium: sparse buffers in host pools, dense in GPU
    request = {"gpu": 0, "host": 0}
    for layer in config.layers:
        for buf in layer.buffers:
            request["host" if buf.sparse else "gpu"] += pages * config.tokens_per_page * buf.bytes_per_token
    budget = {"gpu": shape.gpu_kv_gb * 1e9 * shape.scale, "host": shape.host_gb * 1e9 * shape.scale}
    groups = pool_group_count(config)

    def short(rows: int) -> list:
        """The media whose budget ``rows`` requests and their batch memory overrun."""
        reserve = batch_reserve_bytes(build_config(shape, side, device, context, rows), groups)
        return [m for m in budget if reserve[m] + rows * request[m] > budget[m]]

    lo, hi = 0, shape.max_concurrency + 1  # lo fits (0 rows: nothing to hold), hi does not
    if not short(shape.max_concurrency):
        return shape.max_concurrency, None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if not short(mid) else (lo, mid)
    per_row = batch_memory_bytes(config, groups, 1)
    binding = " and ".join(f"{'GPU' if m == 'gpu' else 'host'} memory ({request[m] / 1e6:.1f} MB "
                           f"of pages per request, {per_row[m] / 1e6:.1f} MB of batch memory "
                           f"per row)" for m in short(hi))
    return lo, binding


def build_config(shape: Shape, side: str, device: str, context: int, rows: int) -> kv.CacheConfig:
    """Per layer a latent (sparse on torch_kvcm2's side, a dense GPU buffer on the baseline's)
    and a dense indexer key; budgets as the module docstring says."""
    layers, spec = [], None
    for i in range(shape.layers):
        if side == "kvcm2":
            if i % shape.layers_per_indexer == 0:
                spec = kv.SparseSpec(tokens_per_unit=1, width=shape.top_k, slots=shape.slots,
                                     max_inflight_tokens=1, selection_id=f"i{i}")
            buffers = [kv.BufferSpec("kv", shape.latent_bytes, sparse=True),
                       kv.BufferSpec("ik", shape.key_bytes)]
            layers.append(kv.LayerSpec(f"l{i}", buffers, sparse=spec))
        else:
            layers.append(kv.LayerSpec(f"l{i}", [kv.BufferSpec("kv", shape.latent_bytes),
                                                 kv.BufferSpec("ik", shape.key_bytes)]))
    history = int(shape.gpu_history_gb * 1e9 * shape.scale) if side == "kvcm2" else 0
    return kv.CacheConfig(tokens_per_page=shape.page, layers=layers, max_rows=rows,
                          max_tokens_per_row=context + shape.output + 4 * shape.page,
                          gpu_budget_bytes=int(shape.gpu_kv_gb * 1e9 * shape.scale),
                          host_budget_bytes=int(shape.host_gb * 1e9 * shape.scale),
                          device=torch.device(device), gpu_history_bytes=history)


@dataclass
class Level:
    side: str
    context: int
    rows: int
    layers: int
    step_ms: list = field(default_factory=list)
    host_ms: list = field(default_factory=list)  # per step: publish + record_advance
    parts_ms: dict = field(default_factory=dict)
    hit_rate: float = 1.0
    model_hit_rate: float = 1.0  # the locality model's under a plain LRU of S slots
    slots: int = 0  # torch_kvcm2's cells per row and layer (S) in a slots sweep's level, else 0
    fetched_bytes_per_step: float = 0.0
    checked_tokens: int = 0
    gpu_rows: int = 0  # torch_kvcm2's rows on GPU history pages (RSD-1)
    kernels_us: dict = field(default_factory=dict)  # --kernels: the costliest, µs a step
    maximum: bool = False  # the side's largest concurrency
    overlap: bool = False  # torch_kvcm2 with each layer's fetch on a side stream (FetchStream)
    binding: str = ""  # at the maximum: what binds it
    bound_ms: float = 0.0  # the physical bound of the step (``step_bound``)
    bound_by: str = ""  # the term that sets it: HBM, GEMM or PCIe
    bound_terms: dict = field(default_factory=dict)  # each term's ms
    attention_bytes: float = 0.0  # per layer and step: the attention modules' weights (mla)
    attention_flops: float = 0.0  # per layer and step: their products and the kernel's (mla)

    @property
    def of_bound(self) -> float:
        """The bound over the measured TPOT p50: 1.0 is a step at what the GPU allows."""
        return self.bound_ms / self.tpot_p50 if self.bound_ms else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.rows * 1e3 / statistics.mean(self.step_ms)

    @property
    def tpot_p50(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def host_p50(self) -> float:
        return statistics.median(self.host_ms)

    @property
    def tpot_p99(self) -> float:
        ordered = sorted(self.step_ms)
        return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


class Side:
    """One side (``kvcm2`` or ``dense``) at one context: a manager, its admitted requests (with
    their histories written) and, per concurrency, a batch and its captured step."""

    def __init__(self, shape: Shape, side: str, device: str, context: int):
        self.shape, self.side, self.device, self.context = shape, side, device, context
        self.max_rows, self.planned_binding = plan_rows(shape, side, device, context)
        if self.max_rows < 1:
            raise SystemExit(f"{side} at {context} tokens: not even one request fits the budgets")
        self.config = build_config(shape, side, device, context, self.max_rows)
        self.manager = kv.KVCacheManager(self.config)
        self.caches: list = []
        self.names = [layer.name for layer in self.config.layers]
        self.weights = [torch.zeros(shape.weight_bytes(shape.max_concurrency) // 2 // shape.hidden + 1,
                                    shape.hidden, dtype=torch.bfloat16, device=device)
                        for _ in self.names]
        # DeepSeek-V3.2's attention modules, the same weights on both sides (--attention mla)
        self.mla = MLA(shape, len(self.names), device) if shape.attention == "mla" else None
        self.binding = None  # which medium refused the next request or batch

    # ---- admission ----
    def admit(self, count: int) -> bool:
        """Requests up to ``count``, each with its history written and its reserve set; False
        (nothing half-done) when the pools refuse one."""
        sh = self.shape
        while len(self.caches) < count:
            need = self.context + sh.output
            if not self.manager.can_fit(need):
                self.binding = self.refusing_medium(need)
                return False
            cache = self.manager.create_cache()
            # pages for the prompt and, as the reserve that advance moves through on the
            # device, for every output token: what the request holds at its last token
            cache.set_reserve(sh.output)
            if not cache.resize(capacity=self.context + 1):
                cache.close()
                self.binding = self.refusing_medium(need)
                return False
            self.write_history(cache, len(self.caches))
            if self.side == "kvcm2":
                cache.record_host_write(self.context)  # the sparse latents' host pages
            assert cache.resize(history=self.context)
            assert cache.resize(capacity=self.context)
            self.caches.append(cache)
        return True

    def refusing_medium(self, tokens: int) -> str:
        """The medium whose free bytes are short of one more request of ``tokens`` tokens."""
        stats = self.manager.stats()
        short = []
        for g in stats["pool_groups"]:
            need = -(-tokens // self.config.tokens_per_page)
            if g["free_slots"] < need:
                short.append("host pages" if g["medium"] == "host" else "GPU pages")
        return " and ".join(sorted(set(short))) or "the batch reserve"

    def write_history(self, cache, rid: int) -> None:
        """Every layer's latent and key of prompt tokens [0, context): straight to the pages
        (on CUDA the host pages through their device-mapped view)."""
        pos = torch.arange(self.context, device=self.device)
        r = torch.tensor(rid, device=self.device)
        for li, name in enumerate(self.names):
            for role in ("kv", "ik"):
                view = self.manager.buffer_view(name, role)
                pages = torch.as_tensor(cache.host_pages(name, role), device=self.device)
                for start in range(0, self.context, 1 << 16):  # bounded temporaries
                    p = pos[start:start + (1 << 16)]
                    page, tok = token_rows(view, pages, p)
                    if role == "kv":
                        write_tokens(view, page, tok, latent_words(self.shape, r, p, li))
                    else:
                        write_keys(self.shape, view, page, tok, key_words(self.shape, r, p, li))

    # ---- one concurrency level ----
    def run_level(self, rows: int, overlap: bool = False) -> Level | None:
        """``rows`` requests decoding ``steps`` timed steps in a batch of ``rows`` rows (with
        ``overlap``, each layer's fetch on a side stream); None when they do not fit
        (``binding`` says why)."""
        if not self.admit(rows):
            return None
        batch = kv.Batch(self.manager, max_rows=rows)  # within the reserve plan_rows sized
        try:
            level = self.decode(batch, rows, overlap)
        except BaseException:
            batch.close(discard=True)  # the failure is what matters, not the tokens in flight
            raise
        batch.close()
        return level

    def decode(self, batch, rows: int, overlap: bool = False) -> Level:
        sh = self.shape
        members = self.caches[:rows]
        for cache in members:
            h = cache.history_length
            # what is left of the output's room, so a request holds context + output in all
            cache.set_reserve(self.context + sh.output - h - 1)
            assert cache.resize(capacity=h + 1)  # the next token's room
            batch.add(cache)
        batch.publish()
        step = DecodeStep(self, batch, members, overlap)
        level = Level(self.side, self.context, rows, sh.layers, overlap=overlap)
        if self.mla:
            level.attention_bytes = self.mla.param_bytes
            span = -(-(self.context + sh.output) // sh.page) * sh.page  # the keys scored
            level.attention_flops = self.mla.flops(rows, sh.top_k, span)
        # rows whose history moved onto GPU pages at that publish: no miss from them (RSD-1)
        level.gpu_rows = batch.row_counts()["gpu_history"]
        cuda = self.device == "cuda"
        graph = None
        for _ in range(sh.warmup):
            batch.publish()
            step()
            if cuda:
                batch.record_advance()
        if cuda:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            batch.publish()
            with torch.cuda.graph(graph, stream=stream):
                step()
            torch.cuda.synchronize()
        before = self.counted()
        profiled = sh.kernels and rows <= 2
        profiler = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA
                                                       if cuda else torch.profiler.ProfilerActivity.CPU])
                    if profiled else contextlib.nullcontext())
        with profiler:
            self.timed_steps(batch, step, graph, level)
        if profiled:
            level.kernels_us = costliest(profiler, cuda, sh.steps, sh.kernels)
        batch.poll()
        level.parts_ms = step.parts(batch)  # eager, timed by part; advances the rows too
        batch.poll()
        hits, misses, fetched = (a - b for a, b in zip(self.counted(), before))
        if self.side == "kvcm2":
            groups = len(self.config.selection_groups)
            # the model's LRU misses over the counted steps (the timed ones and the parts step)
            # of the rows on cells (rows [0, gpu_rows) are on GPU pages: promoted in row order)
            counted = step.model_misses[sh.warmup:].sum(0)
            want = int(counted[step.pattern_of[level.gpu_rows:]].sum()) * groups
            level.hit_rate = hits / max(1, hits + misses)
            level.model_hit_rate = 1 - want / max(1, hits + misses)
            # the resolve breaks ties between units touched in one step its own way
            assert abs(misses - want) <= 0.05 * want + rows * groups, \
                f"{misses} misses counted by metrics(), the locality model's LRU makes {want}"
            level.fetched_bytes_per_step = fetched / (sh.steps + 1)
        level.checked_tokens = step.check(batch)
        assert batch.advance_counters.tolist() == [0, 0], "a row was refused or ran short"
        for cache in members:
            h = cache.history_length
            cache.set_reserve(self.context + sh.output - h)  # held: context + output
            assert cache.resize(capacity=h)  # nothing in flight between levels
            batch.remove(cache)
        return level

    def timed_steps(self, batch, step, graph, level: Level) -> None:
        """The level's timed steps: each its publish, then its graph replay (or the eager step)
        and the advance, the engine's synchronisation on its sampled tokens included."""
        for _ in range(self.shape.steps):
            start = time.perf_counter()
            batch.publish()
            host = time.perf_counter() - start
            if graph is not None:
                graph.replay()
                replayed = time.perf_counter()
                batch.record_advance()
                host += time.perf_counter() - replayed
                torch.cuda.synchronize()  # an engine reads each step's sampled tokens
            else:
                step()
            level.step_ms.append((time.perf_counter() - start) * 1e3)
            level.host_ms.append(host * 1e3)

    def counted(self) -> tuple:
        """(hits, misses, bytes fetched host to device) since the manager started, summed over
        the selection groups, from ``manager.metrics()`` (what an operator's dashboard reads)."""
        groups = self.manager.metrics()["selection_groups"].values()
        return tuple(sum(g[key] for g in groups) for key in ("hits", "misses", "fetched_bytes"))

    def close(self, check: bool = True) -> None:
        self.weights, self.mla = [], None  # freed before the next side allocates its own
        for cache in self.caches:
            cache.close()
        self.caches.clear()
        if not check:  # after a failure: free everything, report the failure
            self.manager.close()
            return
        stats = self.manager.stats()
        for g in stats["pool_groups"]:
            assert g["used_slots"] == 0 and g["shared_slots"] == 0, ("a slot leaked", g)
        assert stats["gpu"]["batch_bytes_in_use"] == 0 and stats["host"]["batch_bytes_in_use"] == 0
        self.manager.close()


def costliest(profiler, cuda: bool, steps: int, most: int) -> dict:
    """The ``most`` costliest kernels (CUDA) or operators (CPU, self time) the profiler saw, in
    µs a step, by name: where the time of a small step goes (``--kernels``)."""
    totals = {}
    for event in profiler.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us > 0:
            totals[event.key] = totals.get(event.key, 0.0) + us / steps
    return dict(sorted(totals.items(), key=lambda kv: -kv[1])[:most])


def levels_for(limit: int) -> list:
    out, c = [], 1
    while c < limit:
        out.append(c)
        c *= 2
    return out


def run_context(shape: Shape, device: str, context: int, progress) -> list:
    """Both sides at one context: concurrency 1, 2, 4, ... below the side's maximum, then the
    maximum (``plan_rows``: the most rows whose batch memory and requests fit both budgets),
    every request admitted by ``can_fit`` (a level whose requests are refused fails the run)."""
    results = []
    for name in ("dense", "kvcm2"):
        side = Side(shape, name, device, context)
        try:
            for rows in levels_for(side.max_rows) + [side.max_rows]:
                progress(f"{context} tokens, {name}: concurrency {rows} of {side.max_rows}")
                for overlap in (False, True) if shape.overlap and name == "kvcm2" else (False,):
                    run = side.run_level(rows, overlap)
                    if run is None:
                        raise AssertionError(f"{name}: {rows} requests planned to fit and did "
                                             f"not ({side.binding})")
                    results.append(run)
                    level = run if not overlap else level
                    progress(f"  {'overlap: ' if overlap else ''}{run.tokens_per_s:.0f} tokens/s, "
                             f"TPOT p50 {run.tpot_p50:.2f} ms p99 {run.tpot_p99:.2f} ms, hit rate "
                             f"{run.hit_rate:.3f} (model {run.model_hit_rate:.3f}), parts ms "
                             + " ".join(f"{k} {v:.2f}" for k, v in run.parts_ms.items()))
                    if run.kernels_us:
                        progress("  kernels, us a step: " + "; ".join(
                            f"{k[:60]} {v:.1f}" for k, v in run.kernels_us.items()))
            level.maximum = True
            level.binding = side.planned_binding
            if side.max_rows >= shape.max_concurrency:
                level.binding = f"the sweep's cap ({shape.max_concurrency})"
        except BaseException:
            side.close(check=False)
            raise
        side.close()
    return results


def check_gpu_fits(shapes: list, device: str) -> None:
    """Refuse, before any run, a shape whose KV budget and stand-in weights (``Side``'s, at its
    ``max_concurrency``) exceed the GPU's free memory: the defaults are an H200's (about 83 GB
    for the full model's run); a smaller GPU needs a smaller ``--gpu-kv-gb``, or
    ``--low-layers 0`` to leave that run out."""
    if device != "cuda":
        return
    free = torch.cuda.mem_get_info()[0]
    for sh in shapes:
        kv_bytes = sh.gpu_kv_gb * 1e9 * sh.scale
        weights = sh.layers * (sh.weight_bytes(sh.max_concurrency)
                               + (mla_param_bytes(sh) if sh.attention == "mla" else 0))
        if kv_bytes + weights > 0.95 * free:  # the rest: activations and the allocator's slack
            raise SystemExit(
                f"serve.py: {sh.layers} layers need {(kv_bytes + weights) / 1e9:.1f} GB of GPU "
                f"memory (KV budget {kv_bytes / 1e9:.1f} GB, stand-in weights "
                f"{weights / 1e9:.1f} GB) and {torch.cuda.get_device_name()} has "
                f"{free / 1e9:.1f} GB free: lower --gpu-kv-gb"
                + (", or leave the full model's run out with --low-layers 0"
                   if sh.layers == sh.model_layers else ""))


def sweep(shape: Shape, device: str, contexts: list, low_layers: int, progress) -> list:
    """Every context's levels: the sweep at ``shape.layers`` and, when ``low_layers`` differs,
    concurrency 1 and 2 again with that many layers (the full model: its budgets, weights and
    per-step host costs as they are, not scaled). Returns the levels, each with its physical
    bound (``step_bound``), and the ceilings measured for them (``measure_ceilings``)."""
    low = replace(shape, layers=low_layers, max_concurrency=2)
    check_gpu_fits([shape] + ([low] if low_layers and low_layers != shape.layers else []), device)
    ceiling = measure_ceilings(device, shape, device == "cpu")
    progress("ceilings: " + ", ".join(f"{k} {v:.1f}" for k, v in ceiling.items()))
    levels = []
    for context in contexts:
        levels += run_context(shape, device, context, progress)
        if low_layers and low_layers != shape.layers:
            levels += run_context(low, device, context, progress)
    for level in levels:
        level.bound_ms, level.bound_by, level.bound_terms = step_bound(shape, level, ceiling)
    return levels, ceiling


def slots_sweep(shape: Shape, device: str, levels: list, slots: list, progress) -> list:
    """torch_kvcm2 again at each ``slots`` count (S: cells per row and layer), per context at
    the concurrency of its best throughput in ``levels`` (fewer where S's cells leave room for
    fewer): the hit rate against the locality model's and the published one, and what it costs
    in step time and concurrency."""
    out = []
    for context in sorted({lv.context for lv in levels}):
        best = max((lv for lv in levels if lv.context == context and lv.side == "kvcm2"
                    and lv.layers == shape.layers and not lv.overlap),
                   key=lambda lv: lv.tokens_per_s)
        for S in slots:
            sh = replace(shape, slots=S)
            side = Side(sh, "kvcm2", device, context)
            try:
                rows = min(best.rows, side.max_rows)
                progress(f"{context} tokens, kvcm2, S = {S}: concurrency {rows} (of {side.max_rows})")
                level = side.run_level(rows)
                assert level is not None, f"S = {S}: {rows} requests planned to fit and did not"
                level.slots, level.binding = S, f"{side.max_rows} requests at most"
                out.append(level)
                progress(f"  {level.tokens_per_s:.0f} tokens/s, hit rate {level.hit_rate:.3f} "
                         f"(model {level.model_hit_rate:.3f})")
            except BaseException:
                side.close(check=False)
                raise
            side.close()
    return out


def bench_serve(device: str, quick: bool) -> list:
    """benchmarks/run.py's P-SERVE rows: one per context, the sweep run as ``main`` runs it
    (the H200 default: 4 layers, 32K and 128K tokens, 1-2 requests also with all 61), its four
    target figures in the note."""
    shape, contexts = (QUICK, [256, 512]) if quick else (Shape(layers=4), [32768, 131072])
    levels, _ = sweep(shape, device, contexts, shape.model_layers, lambda what: None)
    out = []
    for context, s in summarize(levels, shape).items():
        mc, bt = s["max_concurrency"], s["best_tokens_per_s"]
        low = min(s["low_concurrency_ratio"].values(), default=0.0)
        best = max((lv for lv in levels if lv.context == context and lv.side == "kvcm2"),
                   key=lambda lv: lv.tokens_per_s)
        # the targets of P-SERVE (docs/PERFORMANCE.md): each side's best at >= 0.8 of its bound
        met = (mc["ratio"] >= 3 and bt["ratio"] >= 3 and low >= 1.0
               and s["tpot_p99_over_p50"] <= 1.2
               and all(v["of_bound"] >= 0.8 for v in s["of_bound_at_best"].values()))
        out.append(Result(
            "P-SERVE", f"{context} tokens: TPOT p50 at kvcm2's best ({best.rows} requests)",
            best.tpot_p50 * 1e3, target="3x conc. and tokens/s, 1.0x at 1-2, 0.8 of bound", passed=met if device == "cuda" else None,
            extra={**s, "note": f"{context} tokens: max concurrency {mc['kvcm2']} vs {mc['dense']} "
                                f"({mc['ratio']:.2f}x), best tokens/s {bt['kvcm2']:.0f} vs "
                                f"{bt['dense']:.0f} ({bt['ratio']:.2f}x), at 1-2 requests "
                                f"({s['low_concurrency_layers']} layers) {low:.2f}x, TPOT p99/p50 {s['tpot_p99_over_p50']:.2f}"}))
    return out


def quick_shape(args) -> Shape:
    """The CPU smoke run's shape with the flags it honours."""
    base = QUICK_MLA if args.attention == "mla" else QUICK
    return replace(base, overlap=args.overlap, topk=args.topk, gpu_history_gb=args.gpu_history_gb,
                   attention=args.attention, kernels=args.kernels)


def parse_args(argv=None):
    d = Shape()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU, tiny shapes (about a minute)")
    p.add_argument("--contexts", default="32768,131072", help="prompt tokens, comma-separated")
    p.add_argument("--layers", type=int, default=4, help="layers run (budgets scale by layers/61)")
    p.add_argument("--model-layers", type=int, default=d.model_layers)
    p.add_argument("--low-layers", type=int, default=None,
                   help="layers of the runs at 1-2 requests (default --model-layers; 0: none)")
    p.add_argument("--latent-bytes", type=int, default=d.latent_bytes, help="sparse latent per token per layer")
    p.add_argument("--key-bytes", type=int, default=d.key_bytes, help="indexer key per token per layer")
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--slots", type=int, default=d.slots, help="cells per request per layer (S)")
    p.add_argument("--slots-sweep", type=lambda v: [int(x) for x in v.split(",")], default=[],
                   help="comma-separated S: torch_kvcm2 again at each, at its best concurrency "
                        "(hit rate against the locality model's and the published)")
    p.add_argument("--topk", choices=("auto", "radix", "torch"), default=d.topk,
                   help="the indexer's top-k on both sides: the radix select of benchmarks/topk.py, "
                        "torch.topk, or (default) the faster of them on the mode's scores: "
                        "torch.topk over --attention mla's float logits, the radix select over "
                        "the stand-in's int32 scores")
    p.add_argument("--layers-per-indexer", type=int, default=d.layers_per_indexer)
    p.add_argument("--turnover", type=float, default=d.turnover,
                   help="share of each row's top-K replaced every step (benchmarks/locality.py)")
    p.add_argument("--returning", type=float, default=d.returning,
                   help="share of the entering units that were selected before")
    p.add_argument("--reuse-age", type=float, default=d.reuse_age,
                   help="mean steps since a returning unit left the selection")
    p.add_argument("--output", type=int, default=d.output, help="decode tokens per request")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps per level")
    p.add_argument("--gpu-kv-gb", type=float, default=d.gpu_kv_gb)
    p.add_argument("--host-gb", type=float, default=d.host_gb)
    p.add_argument("--dense-weight-mb", type=float, default=None,
                   help=f"the stand-in's weights read per layer besides the routed experts "
                        f"(default {d.dense_weight_mb}: attention and shared expert in FP8; "
                        f"{MLA_DENSE_WEIGHT_MB} with --attention mla: the shared expert alone, "
                        f"the attention's weights being the modules')")
    p.add_argument("--attention", choices=("gather", "mla"), default=d.attention,
                   help="gather: the stand-in's word gather of the selected rows (default); "
                        "mla: DeepSeek-V3.2's attention modules over them (benchmarks/serve_mla.py; "
                        "needs transformers)")
    p.add_argument("--expert-mb", type=float, default=d.expert_mb)
    p.add_argument("--experts-per-gpu", type=int, default=d.experts_per_gpu)
    p.add_argument("--max-concurrency", type=int, default=d.max_concurrency)
    p.add_argument("--overlap", action="store_true",
                   help="also run torch_kvcm2's levels with each layer's fetch on a side stream "
                        "(FetchStream: layer l+1's misses in flight while layer l attends); "
                        "rows kv+ov and the summary's overlap_tpot_ratio")
    p.add_argument("--gpu-history-gb", type=float, default=0.0,
                   help="torch_kvcm2's GPU-resident history (RSD-1), taken from --gpu-kv-gb: "
                        "rows whose history fits there never miss; 0 (default) offloads all")
    p.add_argument("--kernels", type=int, default=0,
                   help="at 1-2 requests, run the timed steps under torch.profiler and report "
                        "this many costliest kernels (operators on the CPU), us a step; the "
                        "TPOT of those levels then includes the profiler's cost")
    p.add_argument("--json")
    p.add_argument("--plot", help="PNG path (needs matplotlib: pip install -e .[bench])")
    args = p.parse_args(argv)
    if args.gpu_history_gb < 0:
        p.error("argument --gpu-history-gb: must be >= 0")
    if args.dense_weight_mb is None:
        args.dense_weight_mb = MLA_DENSE_WEIGHT_MB if args.attention == "mla" else d.dense_weight_mb
    if args.quick:
        shape, contexts = quick_shape(args), [256, 512]
    else:
        shape = Shape(**{k: getattr(args, k) for k in (
            "layers", "model_layers", "latent_bytes", "key_bytes", "top_k", "slots",
            "layers_per_indexer", "turnover", "returning", "reuse_age", "topk", "output", "steps", "gpu_kv_gb", "host_gb",
            "dense_weight_mb", "expert_mb", "experts_per_gpu", "max_concurrency", "overlap",
            "gpu_history_gb", "attention", "kernels")})
        contexts = [int(c) for c in args.contexts.split(",")]
    for name in ("layers", "top_k", "slots", "output", "steps", "layers_per_indexer"):
        if getattr(shape, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: must be >= 1")
    if args.low_layers is not None and args.low_layers < 0:
        p.error("argument --low-layers: must be >= 0")
    for name in ("turnover", "returning"):
        if not 0 < getattr(shape, name) <= 1:
            p.error(f"argument --{name}: must be in (0, 1]")
    if shape.reuse_age < 1:
        p.error("argument --reuse-age: must be >= 1 (steps)")
    for S in [shape.slots] + args.slots_sweep:
        if S < shape.top_k + 1:
            p.error(f"argument --slots / --slots-sweep: {S} must exceed --top-k (the new token "
                    "needs a cell)")
    return args, shape, contexts


def main(argv=None) -> int:
    args, shape, contexts = parse_args(argv)
    device, _ = pick_device(args.quick)
    quick = args.quick
    if device == "cpu" and not quick:
        print("no CUDA kernels or GPU: running --quick", file=sys.stderr)
        shape, contexts, quick = quick_shape(args), [256, 512], True
    started = time.perf_counter()

    def progress(what: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {what}", file=sys.stderr, flush=True)

    low_layers = shape.model_layers if args.low_layers is None or quick else args.low_layers
    levels, ceiling = sweep(shape, device, contexts, low_layers, progress)
    summary = summarize(levels, shape)
    swept = slots_sweep(shape, device, levels, args.slots_sweep, progress) if args.slots_sweep else []
    for level in swept:
        level.bound_ms, level.bound_by, level.bound_terms = step_bound(shape, level, ceiling)
    title = ("CPU smoke run: numbers are not claims" if device == "cpu"
             else f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}")
    print_table(levels, summary, shape, title)
    if swept:
        print_slots(swept, shape)
    print("# ceilings of this run (the bounds' rates): HBM copy {hbm:.0f} GB/s (read + write), "
          "copy engine H2D {h2d:.1f} GB/s, GPU gather of latent rows from pinned memory "
          "{gather:.1f} GB/s (a torch gather through the UVA view), bf16 GEMM {gemm:.1f} TFLOP/s; "
          "the PCIe term runs at the {slower}".format(
              **ceiling, slower="gather" if ceiling["gather"] < ceiling["h2d"] else "copy engine"))
    if args.plot:
        plot([lv for lv in levels if lv.layers == shape.layers], args.plot, f"P-SERVE: {title}")
    if args.json:
        write_json(args.json, {"device": title, "shape": shape.__dict__, "summary": summary,
                               "ceilings": ceiling,
                               "levels": [{**lv.__dict__, "tokens_per_s": lv.tokens_per_s,
                                           "tpot_p50": lv.tpot_p50, "tpot_p99": lv.tpot_p99,
                                           "host_p50": lv.host_p50, "of_bound": lv.of_bound}
                                          for lv in levels + swept]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
