"""A fake serving engine over one KVCacheManager and one Batch (ENG-1/2/4, docs/REQUIREMENTS.md),
shipped with the examples, not the library: ``examples/serve.py`` runs it and the engine-day tests
import it from here.

``run_day(Workload(...))`` drives "an engine day": requests arrive (closed loop at a target
concurrency, or open loop at a rate per step), are admitted by ``KVCacheManager.can_fit``, are
prefilled in chunks, decode (some speculatively, accepting 1..T query tokens per step), share
system prompts and continue finished conversations through the prefix cache, get preempted when
pages run out (the newest running request is suspended, its dense pages offloaded to the host
tier, and resumed later), abort, and finish.
The model is a stand-in: the KV bytes of a token are a hash of (layer, position, token id), so
what any request wrote can be recomputed from its token ids; its indexer is DSA-like: per row
and selection group a top-K of history units that repeats from step to step (``locality``) and
drifts toward the newest tokens. Its "attention" gathers the selected units' tokens from the
cells through the index table, and the engine checks every gathered token (ENG-2).

One step, in order (docs/ENGINE.md maps each event to its calls and docs/HOST_PATH.md gives the
reasons):

1. host: arrivals, resumes and admissions (``Batch.add``, ``KVCache.resume``, ``resize``);
2. ``publish``; host-direct writes of prefill chunks below each group's in-flight start
   (``Batch.host_token_indices``) and of the dense indexer keys; ``record_host_writes``;
   ``publish`` again, so that the device watermark sees the declarations before the flush to a
   tensor of targets;
3. the device step (``EngineStep.__call__``, fixed shapes, no host work, capturable as one CUDA
   graph): per selection group ``resolve(fetch=True)`` and ``write_indices``; per layer the
   in-flight tokens' KV into the cells, the gather of the selected units; then ``flush`` of the
   accepted tokens (a tensor of targets);
4. host: ``Batch.poll()`` (the step's one device -> host call), the checks; per row
   ``resize(history=target)``, finish (verify the host history, commit,
   close), abort (``close()`` or ``remove(discard=True)``); then the next step's capacity per
   row, oldest first, preempting the newest running request when ``resize`` fails.

Lengths advance on the host with ``KVCache.resize`` rather than on the device with
``Batch.advance``: an engine day changes most rows' lengths by different rules every step
(prefill chunks, admissions, resumes, speculative acceptance, shrinking away rejected drafts
before a preemption) and needs each refusal at once to preempt, which only the host call
reports; the device-side advance serves a steady decode batch (examples/sparse_decode.py). The
flush still takes a tensor of targets, so the captured step needs nothing from the host, and
after a replay ``Batch.record_advance`` brings the device's watermarks back.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from torch_kvcm2 import BAD, Batch, BufferSpec, CacheConfig, KVCacheManager, LayerSpec, SparseSpec

KV_WORDS, KEY_WORDS = 4, 2  # int32 words per token: sparse latent (16 B), dense indexer key (8 B)
DELAY_OPS = ("publish", "resolve", "write", "attend", "flush")


@dataclass(frozen=True)
class Workload:
    """The knobs of an engine day. Lengths are in tokens; shares and rates are probabilities.

    Geometry: ``max_rows`` rows, ``tokens_per_page`` P; selection group "g0" (layers l0, l1,
    units of 4 tokens) and "g1" (layer l2, units of 2); ``top_k`` units per query token (its own
    in-flight unit included); ``max_inflight_tokens`` I; ``pool_pages`` pages per pool group (the
    host pool of the sparse latents and the GPU pool of the dense indexer keys are both bounded
    by it: small values force preemptions)."""

    seed: int = 0
    steps: int = 300  #: steps with arrivals; then the engine drains (no arrivals) until idle
    arrival: str = "closed"  #: "closed" (keep ``concurrency`` requests in the system) or "open"
    concurrency: int = 6  #: closed loop: requests waiting, running or suspended
    arrival_rate: float = 0.3  #: open loop: mean arrivals per step (Poisson)
    prompt_lengths: tuple = (16, 768)  #: log-uniform prompt length range
    output_lengths: tuple = (4, 48)  #: uniform output length range
    prefill_chunk: int = 96  #: prompt tokens per prefill step
    locality: float = 0.9  #: share of a row's top-K kept from the step before
    speculative_share: float = 0.3  #: share of requests that decode speculatively
    draft_tokens: int = 2  #: drafts per speculative step: T = draft_tokens + 1, accept 1..T
    continuation_share: float = 0.15  #: share of arrivals continuing a finished conversation
    system_prompt_share: float = 0.3  #: share of arrivals starting with a shared system prompt
    system_prompts: int = 2  #: distinct system prompts
    system_prompt_length: int = 160
    abort_rate: float = 0.005  #: per running or suspended request per step
    delay_ops: tuple = ()  #: ops of DELAY_OPS the delay hook runs before
    delay_cycles: int = 20_000  #: CUDA: torch.cuda._sleep cycles per injected delay
    max_rows: int = 8
    tokens_per_page: int = 16
    top_k: int = 6
    max_inflight_tokens: int = 8
    pool_pages: int = 140
    max_tokens_per_row: int = 1536
    device: str = "cpu"
    graph: bool = False  #: CUDA: capture the device step once as one CUDA graph, replay it
    max_drain_steps: int = 2000
    #: GPU-resident history (RSD-1): page ordinals of the batch's GPU history pages (0: off)
    gpu_history_pages: int = 0

    @property
    def query_tokens(self) -> int:
        return self.draft_tokens + 1 if self.speculative_share > 0 else 1


class EngineDayFailed(AssertionError):
    """A check of an engine day failed; the message holds the seed, the step and the knobs."""


class CheckFailed(AssertionError):
    pass


class DayDidNotDrain(CheckFailed):
    """Requests were still in the system ``max_drain_steps`` after arrivals stopped: the load,
    not a wrong byte (a caller can tell the two apart)."""


def check(ok: bool, what: str) -> None:
    if not ok:  # not `assert`: checks must survive python -O
        raise CheckFailed(what)


def token_words(layer: int, positions: np.ndarray, tokens: np.ndarray, words: int) -> np.ndarray:
    """The stand-in model's KV: int32[N, words] of tokens ``tokens`` at ``positions`` in layer
    buffer ``layer`` (a hash; equal prefixes give equal bytes, so shared pages are right)."""
    x = (tokens.astype(np.uint64)[:, None] * np.uint64(0x9E3779B1)
         + positions.astype(np.uint64)[:, None] * np.uint64(0x85EBCA77)
         + np.uint64(layer * 0xC2B2AE3D + 1)
         + np.arange(words, dtype=np.uint64)[None, :] * np.uint64(0x27D4EB2F))
    x ^= x >> np.uint64(29)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(32)
    return (x & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)


def as_words(paged: torch.Tensor, words: int) -> torch.Tensor:
    """A paged uint8 buffer or cells [n, 1, P, B] as int32[n*P, words]: token index i is row i."""
    return paged.flatten(0, 2).view(torch.int32).view(-1, words)


def write_cells(cells: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """cells' token index[j] = values[j] where index[j] is not BAD, with fixed shapes (capturable):
    each token's words get (new - old) added, 0 at BAD indices (routed to token 0); the indices
    of valid tokens are distinct, so the result is the new bits exactly."""
    words = as_words(cells, values.shape[-1])
    valid = index >= 0
    safe = torch.where(valid, index, 0).long()
    words.index_add_(0, safe, torch.where(valid[:, None], values - words[safe], 0))


def gather_units(cells: torch.Tensor, index: torch.Tensor, U: int) -> torch.Tensor:
    """The stand-in attention's read: every token of every selected unit through the index table
    (int32[R, T, K] entries): int32[R, T, K, U, KV_WORDS] (BAD entries read token 0)."""
    tokens = index.clamp(min=0).long()[..., None] * U + torch.arange(U, device=index.device)
    return as_words(cells, KV_WORDS)[tokens]


@dataclass
class Request:
    """A request's host state: its token ids so far (prompt, then accepted tokens)."""

    rid: int
    tokens: np.ndarray  # int64: the prompt now; accepted tokens are appended
    prompt_length: int
    output_length: int
    query_tokens: int  # T_r: 1, or draft_tokens + 1
    origin: str  # "fresh", "system" or "continuation"
    cache: object = None
    generated: int = 0
    admitted_at: int = -1
    selection: dict = field(default_factory=dict)  # group index -> list of history units
    step_tokens: Optional[np.ndarray] = None  # token ids of [history, capacity) this step
    committed: bool = False


@dataclass
class DayResult:
    """What an engine day did (ENG-1/2): counts, rates and the checks passed."""

    workload: Workload
    steps: int = 0
    request_steps: int = 0
    tokens_generated: int = 0
    prefill_tokens: int = 0
    admitted: int = 0
    finished: int = 0
    preemptions: int = 0
    offloads: int = 0  #: preemptions that moved dense pages to the host tier (TIER-1)
    resumes: int = 0
    recomputes: int = 0
    aborts: int = 0
    refused_admissions: int = 0
    prefix_hits: int = 0
    prefix_tokens: int = 0
    accepted: dict = field(default_factory=dict)  # tokens accepted per speculative step -> count
    kept_selections: int = 0
    drawn_selections: int = 0
    checked_tokens: int = 0
    verified_history_tokens: int = 0
    graph_replays: int = 0  #: decode steps run by replaying the captured graph
    delays: dict = field(default_factory=dict)
    hit_rates: dict = field(default_factory=dict)
    gpu_history: dict = field(default_factory=dict)  #: metrics()["gpu_history"] at the end
    cached_slots_at_end: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_generated / self.seconds if self.seconds else 0.0

    @property
    def concurrency(self) -> float:
        return self.request_steps / self.steps if self.steps else 0.0

    @property
    def locality(self) -> float:
        total = self.kept_selections + self.drawn_selections
        return self.kept_selections / total if total else 0.0

    def summary(self) -> str:
        rates = ", ".join(f"{g} {r:.2f}" for g, r in self.hit_rates.items())
        return (f"{self.steps} steps, {self.request_steps} request-steps, {self.tokens_generated} "
                f"tokens generated ({self.tokens_per_second:.0f} tokens/s), concurrency "
                f"{self.concurrency:.2f}, {self.finished} finished, {self.preemptions} preempted, "
                f"{self.resumes} resumed, {self.aborts} aborted, {self.prefix_hits} prefix hits "
                f"({self.prefix_tokens} tokens), hit rate {rates}")


def build_config(w: Workload) -> CacheConfig:
    """Two selection groups, one sparse latent per layer and a dense indexer key per group."""
    T, I, K = w.query_tokens, w.max_inflight_tokens, w.top_k
    layers, specs = [], {}
    for name, group, U, leader in (("l0", "g0", 4, True), ("l1", "g0", 4, False),
                                   ("l2", "g1", 2, True)):
        units_per_page = w.tokens_per_page // U
        need = T * K + -(-I // U) + 1
        slots = -(-need // units_per_page) * units_per_page
        spec = specs.setdefault(group, SparseSpec(
            tokens_per_unit=U, width=K, slots=slots, max_inflight_tokens=I, selection_id=group,
            max_query_tokens=T))
        buffers = [BufferSpec("kv", 4 * KV_WORDS, sparse=True)]
        if leader:
            buffers.append(BufferSpec("ik", 4 * KEY_WORDS))
        layers.append(LayerSpec(name, buffers, sparse=spec))
    gpu_history = w.gpu_history_pages * w.tokens_per_page * 4 * KV_WORDS * len(layers)
    probe = CacheConfig(tokens_per_page=w.tokens_per_page, layers=layers, max_rows=w.max_rows,
                        max_tokens_per_row=w.max_tokens_per_row, gpu_budget_bytes=1 << 26,
                        host_budget_bytes=1 << 26, device=torch.device(w.device),
                        gpu_history_bytes=gpu_history)
    # budgets: the batch reserve (read from a probe manager) plus exactly pool_pages slots
    manager = KVCacheManager(probe)
    stats = manager.stats()
    manager.close()
    budgets = {}
    for medium in ("gpu", "host"):
        page = sum(g["page_bytes"] * g["scale"] for g in stats["pool_groups"]
                   if g["medium"] == medium)
        budgets[medium] = stats[medium]["reserved_bytes"] + w.pool_pages * page
    budgets["host"] += host_tier_bytes(probe, w)
    return CacheConfig(tokens_per_page=w.tokens_per_page, layers=layers, max_rows=w.max_rows,
                       max_tokens_per_row=w.max_tokens_per_row,
                       gpu_budget_bytes=budgets["gpu"], host_budget_bytes=budgets["host"],
                       device=torch.device(w.device), gpu_history_bytes=gpu_history)


def host_tier_bytes(config: CacheConfig, w: Workload) -> int:
    """The host tier (TIER-1) of an engine day: room for as many dense pages as the GPU pools
    hold (``pool_pages`` pages of every dense buffer), on top of the sparse host pools."""
    dense = sum(b.bytes_per_token for layer in config.layers for b in layer.buffers if not b.sparse)
    return w.pool_pages * w.tokens_per_page * dense


class EngineStep:
    """The decode step's device part over static tensors (fixed addresses and shapes, no host
    work): capturable as one CUDA graph that keeps working across membership changes (BAT-1).
    Inputs: ``selected[g]`` int32[R, T, K], ``values[layer]`` int32[R, I+U-1, KV_WORDS] (the KV
    of in-flight token ``start + j``), ``targets`` int32[R] (each row's new history). Outputs:
    ``index[g]`` (the resolve's table) and ``out[layer]`` (``gather_units``)."""

    def __init__(self, batch: Batch, T: int, delay: Callable[[str], None]):
        self.batch, self.delay = batch, delay
        config, dev, R = batch.config, batch.config.device, batch.max_rows
        self.groups = config.selection_groups
        self.selected, self.values, self.out, self.index = {}, {}, {}, {}
        for g in self.groups:
            sp = g.sparse
            self.selected[g.index] = torch.full((R, T, sp.width), BAD, dtype=torch.int32, device=dev)
            width = batch.group(g.index).write_table.shape[1]
            for layer in g.layers:
                self.values[layer] = torch.zeros(R, width, KV_WORDS, dtype=torch.int32, device=dev)
        self.targets = torch.zeros(R, dtype=torch.int32, device=dev)

    def __call__(self) -> None:
        batch = self.batch
        for g in self.groups:
            self.delay("resolve")
            self.index[g.index] = batch.resolve(g.index, self.selected[g.index], fetch=True)
            table, _ = batch.write_indices(g.index)  # resolve's own tables: no launch
            for layer in g.layers:
                cells = batch.cells(layer, "kv")
                self.delay("write")
                write_cells(cells, table.flatten(), self.values[layer].flatten(0, 1))
                self.delay("attend")
                self.out[layer] = gather_units(cells, self.index[g.index], g.sparse.tokens_per_unit)
        self.delay("flush")
        batch.flush(self.targets)  # only the accepted tokens reach host pages


class Engine:
    """The scheduler loop of an engine day (see the module docstring for one step's order)."""

    def __init__(self, workload: Workload, delay_hook: Optional[Callable[[str], None]] = None):
        w = self.w = workload
        self.rng = np.random.default_rng(w.seed)
        self.config = build_config(w)
        self.manager = KVCacheManager(self.config,
                                      host_tier_bytes=host_tier_bytes(self.config, w))
        self.batch = Batch(self.manager)
        self.device = self.config.device
        self.T = w.query_tokens
        self.result = DayResult(workload=w, delays={op: 0 for op in w.delay_ops})
        self.delay_hook = delay_hook if delay_hook is not None else self.default_delay
        self.step_fn = EngineStep(self.batch, self.T, self.delay)
        self.graph = None
        self.layers = [layer.name for layer in self.config.layers]
        self.leaders = [g.layers[0] for g in self.config.selection_groups]
        self.waiting: list = []  # not admitted yet, arrival order
        self.running: list = []  # seated with a lease, admission order
        self.suspended: list = []  # preempted: not seated, dense pages offloaded, preemption order
        self.finished: list = []  # finished conversations, for continuations
        self.system_prompts = [self.rng.integers(1 << 20, size=w.system_prompt_length)
                               for _ in range(w.system_prompts)]
        self.step_index = 0
        self.next_rid = 0
        self.targets = np.zeros(w.max_rows, dtype=np.int32)
        self.check_seconds = 0.0
        self.warm, self.graph_delays = False, {}

    # ---- delays (ENG-1: a delay kernel before chosen ops) ----
    def default_delay(self, op: str) -> None:
        """On CUDA a sleep kernel on the current stream (captured with the step); on the CPU
        nothing (still called and counted)."""
        if self.device.type == "cuda":
            torch.cuda._sleep(self.w.delay_cycles)

    def delay(self, op: str) -> None:
        if op in self.w.delay_ops:
            self.result.delays[op] += 1
            self.delay_hook(op)

    # ---- arrivals ----
    def new_request(self) -> Request:
        w, rng = self.w, self.rng
        lo, hi = w.prompt_lengths
        length = int(np.exp(rng.uniform(np.log(lo), np.log(hi))))
        output = int(rng.integers(w.output_lengths[0], w.output_lengths[1] + 1))
        origin, prefix = "fresh", np.zeros(0, dtype=np.int64)
        draw = rng.random()
        if draw < w.continuation_share and self.finished:
            prefix, origin = self.finished.pop(int(rng.integers(len(self.finished)))), "continuation"
        elif draw < w.continuation_share + w.system_prompt_share and self.system_prompts:
            prefix, origin = self.system_prompts[int(rng.integers(len(self.system_prompts)))], "system"
        room = w.max_tokens_per_row - len(prefix) - output - self.T - w.tokens_per_page
        length = max(1, min(length, room))
        tokens = np.concatenate([prefix, rng.integers(1 << 20, size=length)]).astype(np.int64)
        T = self.T if rng.random() < w.speculative_share else 1
        request = Request(self.next_rid, tokens, len(tokens), output, T, origin)
        self.next_rid += 1
        return request

    def arrivals(self) -> None:
        w = self.w
        if self.step_index >= w.steps:
            return
        if w.arrival == "closed":
            count = w.concurrency - len(self.waiting) - len(self.running) - len(self.suspended)
        else:
            count = int(self.rng.poisson(w.arrival_rate))
        self.waiting.extend(self.new_request() for _ in range(max(0, count)))

    # ---- admission, resume, preemption ----
    def need(self, request: Request) -> int:
        """Tokens the next step adds to the request's capacity: a prefill chunk or T_r."""
        h = request.cache.history_length
        if h < request.prompt_length:
            return min(self.w.prefill_chunk, request.prompt_length - h)
        return request.query_tokens

    def free_row(self) -> bool:
        return len(self.batch.members()) < self.batch.max_rows

    def resume_suspended(self) -> None:
        """Resume preempted requests, oldest preemption first, while rows and pages allow."""
        while self.suspended and self.free_row():
            request = self.suspended[0]
            cache = request.cache
            if not self.manager.can_fit(self.need(request), resuming=[cache]):
                return
            self.batch.add(cache)
            if not cache.resume():  # a fresh, empty lease; the dense pages back on the GPU
                self.batch.remove(cache)
                return
            if not cache.resize(capacity=cache.history_length + self.need(request)):
                if not cache.suspend():  # back to the host tier; kept on the GPU when it is full
                    check(cache.suspend(offload=False), "a suspend keeping the pages failed")
                self.batch.remove(cache)
                return
            self.suspended.pop(0)
            self.running.append(request)
            self.result.resumes += 1

    def admit(self) -> None:
        """Admit waiting requests, arrival order, while rows and pages allow (STO-8)."""
        w = self.w
        while self.waiting and self.free_row() and not self.suspended:
            if w.arrival == "closed" and len(self.running) >= w.concurrency:
                return
            request = self.waiting[0]
            shared = self.manager.match(request.tokens)
            first = min(w.prefill_chunk, request.prompt_length - shared) or request.query_tokens
            if not self.manager.can_fit(first + request.query_tokens):
                self.result.refused_admissions += 1
                return
            cache = self.manager.create_cache(request.tokens)  # shares the committed prefix
            request.cache = cache
            if not cache.resize(capacity=cache.history_length + self.need(request)):
                cache.close()  # nothing was written
                request.cache = None
                self.result.refused_admissions += 1
                return
            self.waiting.pop(0)
            if cache.reused_tokens:
                self.result.prefix_hits += 1
                self.result.prefix_tokens += cache.reused_tokens
            self.batch.add(cache)
            request.admitted_at = self.step_index
            self.running.append(request)
            self.result.admitted += 1

    def preempt(self, request: Request) -> None:
        """Suspend a running request between steps (its history is final: drop the capacity
        beyond it first), give up its row. Its private dense pages move to the host tier
        (``suspend()`` offloads: the manager has one), freeing their GPU slots; when the tier is
        full they stay on the GPU (``offload=False``). Sparse pages stay on host pages."""
        cache = request.cache
        check(cache.resize(capacity=cache.history_length), "a shrink to history failed")
        if cache.suspend():
            self.result.offloads += cache.offloaded
        else:
            check(cache.suspend(offload=False), "a suspend keeping the pages failed")
        self.batch.remove(cache)
        self.running.remove(request)
        self.suspended.append(request)
        request.selection.clear()  # a fresh lease: the indexer starts again
        self.result.preemptions += 1

    def recompute_one(self) -> None:
        """Nothing runs and nothing can resume: drop the newest preempted request's pages and
        requeue it from its prompt (recompute preemption), so the day cannot deadlock."""
        request = self.suspended.pop()
        request.cache.close()
        request.cache, request.generated = None, 0
        request.tokens = request.tokens[:request.prompt_length]
        self.waiting.insert(0, request)
        self.result.recomputes += 1

    # ---- the step's inputs ----
    def plan_selection(self, request: Request, g, h: int) -> list:
        """The DSA-like indexer of one row and group: keep each unit of the last top-K with
        probability ``locality``; draw the rest from the history units, drifting toward the
        newest (a geometric distance back from the last whole history unit)."""
        U, K = g.sparse.tokens_per_unit, g.sparse.width
        units = h // U  # wholly history: selectable
        old = request.selection.get(g.index, [])
        keep = [u for u in old if u < units and self.rng.random() < self.w.locality]
        full = len(old) == K - 1  # measured on full top-Ks only (a short context still grows)
        self.result.kept_selections += len(keep) if full else 0
        chosen, tries = set(keep), 0
        while len(chosen) < min(K - 1, units) and tries < 4 * K:
            back = int(self.rng.geometric(0.15)) - 1
            u = units - 1 - back if back < units else int(self.rng.integers(units))
            tries += 1
            if u not in chosen:
                chosen.add(u)
                self.result.drawn_selections += 1 if full else 0
        request.selection[g.index] = sorted(chosen)
        return request.selection[g.index]

    def fill_inputs(self) -> list:
        """Per running request: this step's token ids (prefill: the prompt's next chunk; decode:
        T_r new tokens, the first the row's next token, the rest drafts), its selections (one
        per query token: its own in-flight unit, then the row's top-K history units) and its
        flush target (prefill: the chunk's end; decode: the verification's accepted prefix of
        1..T_r). Returns (row, request, h, c) per running request, admission order."""
        R, T, rows = self.batch.max_rows, self.T, []
        selected = {g.index: np.full((R, T, g.sparse.width), BAD, dtype=np.int32)
                    for g in self.config.selection_groups}
        targets = np.zeros(R, dtype=np.int32)
        for request in self.running:
            cache = request.cache
            row, h, c = self.batch.row_of(cache), cache.history_length, cache.capacity
            rows.append((row, request, h, c))
            if h < request.prompt_length:
                request.step_tokens = request.tokens[h:c]
                targets[row] = c
                continue  # a prefill selects nothing: resolve seats its in-flight tail
            request.step_tokens = self.rng.integers(1 << 20, size=c - h).astype(np.int64)
            accepted = int(self.rng.integers(1, c - h + 1))
            targets[row] = h + min(accepted, request.output_length - request.generated)
            for g in self.config.selection_groups:
                U, K = g.sparse.tokens_per_unit, g.sparse.width
                base = self.plan_selection(request, g, h)
                for t in range(c - h):
                    own = (h + t) // U  # in flight: always selectable
                    picks = [own] + [u for u in base if u != own][:K - 1]
                    selected[g.index][row, t, :len(picks)] = picks
        for g, sel in selected.items():
            self.step_fn.selected[g].copy_(torch.from_numpy(sel))
        self.step_fn.targets.copy_(torch.from_numpy(targets))
        self.targets = targets
        return rows

    def sequence(self, request: Request, h: int) -> np.ndarray:
        """Token ids of positions [0, capacity) this step: history, then this step's tokens."""
        return np.concatenate([request.tokens[:h], request.step_tokens])

    def host_writes(self, rows: list) -> None:
        """Per selection group: the in-flight tokens' KV into the step's ``values`` (written into
        cells by the device step), the prefill tokens below the group's in-flight start straight
        to the sparse latents' host pages, and every new token's dense indexer key into its
        page, both through ``host_token_indices``."""
        R, P = self.batch.max_rows, self.config.tokens_per_page
        for g in self.config.selection_groups:
            sp, spans, keys = g.sparse, [], []
            width = self.step_fn.values[g.layers[0]].shape[1]
            staged = {layer: torch.zeros(R, width, KV_WORDS, dtype=torch.int32) for layer in g.layers}
            for row, request, h, c in rows:
                s0, seq = sp.inflight_start(h, c), self.sequence(request, h)
                keys.append((row, np.arange(h, c), seq[h:c]))
                spans.append((row, np.arange(h, s0), seq[h:s0]))
                pos = np.arange(s0, c)
                for layer in g.layers:
                    staged[layer][row, :len(pos)] = torch.from_numpy(
                        token_words(self.layers.index(layer), pos, seq[s0:c], KV_WORDS))
            for layer in g.layers:
                self.write_host(layer, "kv", spans, KV_WORDS, R, P)
                self.step_fn.values[layer].copy_(staged[layer])
            self.write_host(g.layers[0], "ik", keys, KEY_WORDS, R, P)

    def write_host(self, layer: str, role: str, spans: list, words: int, R: int, P: int) -> None:
        """Write (row, positions, token ids) spans of one buffer straight to its pages."""
        width = max((len(p) for _, p, _ in spans), default=0)
        if width == 0:
            return
        positions = torch.full((R, width), BAD, dtype=torch.int32)
        values = torch.zeros(R, width, words, dtype=torch.int32)
        base = self.layers.index(layer) + (100 if role == "ik" else 0)
        for row, pos, toks in spans:
            positions[row, :len(pos)] = torch.from_numpy(pos.astype(np.int32))
            values[row, :len(pos)] = torch.from_numpy(token_words(base, pos, toks, words))
        index = self.batch.host_token_indices(layer, role, positions.to(self.device)).cpu()
        ok = positions >= 0
        check(bool((index[ok] >= 0).all()), f"{layer}/{role}: a new token has no page")
        view = as_words(self.manager.buffer_view(layer, role), words)
        view[index[ok].long().to(self.device)] = values[ok].to(self.device)

    # ---- one step ----
    def step(self) -> None:
        """One engine step (module docstring: the order and why)."""
        result = self.result
        self.arrivals()
        self.abort_suspended()
        self.resume_suspended()
        self.admit()
        if not self.running:
            if self.suspended:
                self.recompute_one()
            return
        rows = self.fill_inputs()
        self.delay("publish")
        self.batch.publish()
        self.host_writes(rows)
        self.batch.record_host_writes()  # [history, s0) of every prefill row, before the flush
        self.batch.publish()  # the device watermark sees the declarations (flush to a tensor)
        self.run_device_step()
        self.batch.poll()  # the step's one device -> host call: the flush's watermarks
        started = time.perf_counter()
        self.check_step(rows)
        self.check_seconds += time.perf_counter() - started
        self.end_step(rows)
        result.request_steps += len(rows)

    def run_device_step(self) -> None:
        """Eagerly, or (``graph``, CUDA) captured once after a warm-up step and replayed: the
        batch's tables keep their addresses across membership changes (BAT-1), so one graph
        serves every later step; ``record_advance`` brings back the watermarks its flush (to a
        tensor of targets) moved on the device."""
        if self.w.graph and self.graph is None and self.warm:
            before = dict(self.result.delays)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # capture runs nothing
                self.step_fn()
            self.graph_delays = {op: n - before[op] for op, n in self.result.delays.items()}
        if self.graph is not None:
            self.graph.replay()
            self.batch.record_advance()
            for op, n in self.graph_delays.items():
                self.result.delays[op] += n
            self.result.graph_replays += 1
        else:
            self.step_fn()
            self.warm = True

    # ---- checks (ENG-2) ----
    def check_step(self, rows: list) -> None:
        """Every decode row: each selected unit's tokens that exist (below capacity), read
        through the index table by the step's gather, equal what the request wrote there."""
        for g in self.config.selection_groups:
            U = g.sparse.tokens_per_unit
            selected = self.step_fn.selected[g.index].cpu().numpy()
            index = self.step_fn.index[g.index].cpu().numpy()
            outs = {layer: self.step_fn.out[layer].cpu().numpy() for layer in g.layers}
            for row, request, h, c in rows:
                if h < request.prompt_length:
                    continue
                sel, idx = selected[row, :c - h], index[row, :c - h]
                valid = sel >= 0
                check(bool((idx[valid] >= 0).all()),
                      f"request {request.rid} row {row} group {g.name}: a valid selection got BAD "
                      f"(selected {sel.tolist()}, index {idx.tolist()})")
                positions = sel[..., None].astype(np.int64) * U + np.arange(U)  # [T, K, U]
                exists = valid[..., None] & (positions < c)
                seq = self.sequence(request, h)
                for layer in g.layers:
                    got = outs[layer][row, :c - h][exists]
                    want = token_words(self.layers.index(layer), positions[exists],
                                       seq[positions[exists]], KV_WORDS)
                    if not np.array_equal(got, want):
                        bad = np.argwhere((got != want).any(-1))[:, 0]
                        raise CheckFailed(
                            f"request {request.rid} row {row} layer {layer}: attention read wrong "
                            f"KV for positions {positions[exists][bad][:8].tolist()} (history "
                            f"{h}, capacity {c})")
                    self.result.checked_tokens += int(exists.sum())

    def verify_history(self, request: Request) -> None:
        """A request's history on its pages, bit for bit: every sparse latent (host pages) and
        every dense indexer key (GPU pages), read through ``KVCache.host_pages``."""
        cache, P = request.cache, self.config.tokens_per_page
        h = cache.history_length
        t = np.arange(h)
        for layer, role, words, base in ([(layer, "kv", KV_WORDS, i)
                                          for i, layer in enumerate(self.layers)]
                                         + [(layer, "ik", KEY_WORDS, self.layers.index(layer) + 100)
                                            for layer in self.leaders]):
            pages = cache.host_pages(layer, role)
            index = torch.from_numpy(pages[t // P] * P + t % P)
            view = as_words(self.manager.buffer_view(layer, role, device_side=False), words)
            got = view[index.to(view.device)].cpu().numpy()
            want = token_words(base, t, request.tokens[:h], words)
            if not np.array_equal(got, want):
                bad = np.argwhere((got != want).any(-1))[:, 0]
                raise CheckFailed(f"request {request.rid} ({request.origin}, reused "
                                  f"{cache.reused_tokens}): {layer}/{role} history differs at "
                                  f"positions {bad[:8].tolist()} of {h}")
        self.result.verified_history_tokens += h

    def check_drained(self) -> None:
        """Every request finished: no member, every row published empty (BAD lease, zero
        lengths); per pool group no used or shared slot, cached slots exactly the committed
        prefix entries (each entry holds one slot of every pool group), the rest free, and no
        slot of a host tier (TIER-1) used; after
        ``Batch.close`` the batch reserve of both media (device tables, cells, pinned staging)
        is back."""
        check(not self.running and not self.suspended and not self.waiting,
              "requests are left after draining")
        check(not self.batch.members(), f"members left: {self.batch.members()}")
        self.batch.publish()
        lengths = self.batch.host_tables()["lengths"]
        check(bool((lengths[2] == BAD).all()), f"leases still granted: {lengths[2].tolist()}")
        check(not lengths[0].any() and not lengths[1].any(), "lengths of empty rows are not zero")
        stats = self.manager.stats()
        entries = stats["prefix"]["entries"]
        cached = []
        for g in stats["pool_groups"]:
            check(g["used_slots"] == 0 and g["shared_slots"] == 0,
                  f"pool group {g['index']}: {g['used_slots']} used, {g['shared_slots']} shared "
                  f"slots after every request finished")
            check(g["cached_slots"] == entries,
                  f"pool group {g['index']}: {g['cached_slots']} cached slots, {entries} entries")
            check(g["free_slots"] + g["cached_slots"] == g["slots"],
                  f"pool group {g['index']}: free + cached != slots")
            tier = g["host_tier"]
            check(tier is None or (tier["used_slots"] == 0 and tier["free_slots"] == tier["slots"]),
                  f"pool group {g['index']}: {tier and tier['used_slots']} host tier slots used "
                  f"after every request finished")
            cached.append(g["cached_slots"])
        self.result.cached_slots_at_end = cached
        self.batch.close()
        stats = self.manager.stats()
        for medium in ("gpu", "host"):
            check(stats[medium]["batch_bytes_in_use"] == 0,
                  f"{medium}: {stats[medium]['batch_bytes_in_use']} batch bytes in use after close")
            check(stats[medium]["used_bytes"] == 0, f"{medium}: {stats[medium]['used_bytes']} "
                                                    f"bytes used after every request finished")

    # ---- after the step ----
    def end_step(self, rows: list) -> None:
        """Pass 1, every row: abort, or history over the flushed tokens (then finish, or commit
        a completed shared system prompt). Pass 2, oldest first: capacity for the next step;
        when the pools cannot serve it, preempt the newest running request and try again."""
        w, result = self.w, self.result
        for row, request, h, c in rows:
            cache, target = request.cache, int(self.targets[row])
            if self.rng.random() < w.abort_rate:
                self.abort(request)
                continue
            check(cache.resize(history=target), "resize(history) over flushed tokens failed")
            if h < request.prompt_length:
                result.prefill_tokens += target - h
                if target == request.prompt_length and request.origin == "system":
                    cache.commit(request.tokens[:target])  # later requests share the prompt
            else:
                accepted = target - h
                request.tokens = np.concatenate([request.tokens, request.step_tokens[:accepted]])
                request.generated += accepted
                result.tokens_generated += accepted
                if request.query_tokens > 1:
                    result.accepted[accepted] = result.accepted.get(accepted, 0) + 1
                if request.generated >= request.output_length:
                    self.finish(request)
        for request in list(self.running):
            if request not in self.running:
                continue  # preempted for an older request in this pass
            cache = request.cache
            want = cache.history_length + self.need(request)
            while not cache.resize(capacity=want):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is request:
                    break

    def finish(self, request: Request) -> None:
        """Drop the rejected drafts beyond history, verify the history bit for bit, leave the
        batch, offer the whole pages for reuse (continuations) and close."""
        cache = request.cache
        h = cache.history_length
        check(cache.resize(capacity=h), "a shrink to history failed")
        self.verify_history(request)
        self.batch.remove(cache)
        cache.commit(request.tokens[:h])
        cache.close()
        self.running.remove(request)
        self.finished.append(request.tokens[:h].copy())
        del self.finished[:-16]
        self.result.finished += 1

    def abort(self, request: Request) -> None:
        """Drop the request and its in-flight tokens: ``close()`` (which leaves the batch
        discarding them) or ``remove(discard=True)`` then ``close()``, alternately."""
        cache = request.cache
        if self.result.aborts % 2 == 0:
            cache.close()
        else:
            self.batch.remove(cache, discard=True)
            cache.close()
        self.running.remove(request)
        self.result.aborts += 1

    def abort_suspended(self) -> None:
        for request in list(self.suspended):
            if self.rng.random() < self.w.abort_rate:
                request.cache.close()  # detached, history == capacity: nothing in flight
                self.suspended.remove(request)
                self.result.aborts += 1

    # ---- the day ----
    def run(self, every: int = 0, report: Optional[Callable] = None) -> DayResult:
        """Steps with arrivals, then the drain; then the leak checks. ``report(engine)`` is
        called every ``every`` steps."""
        w, result = self.w, self.result
        started = time.perf_counter()
        while self.step_index < w.steps or self.running or self.suspended or self.waiting:
            if self.step_index >= w.steps + w.max_drain_steps:
                raise DayDidNotDrain("the day did not drain")
            self.step()
            self.step_index += 1
            result.steps = self.step_index
            result.seconds = time.perf_counter() - started - self.check_seconds
            if every and report is not None and self.step_index % every == 0:
                report(self)
        for g in self.config.selection_groups:
            rate = self.batch.hit_rate(g.index)
            check(rate["invalid"] == 0, f"group {g.name}: {rate['invalid']} invalid selections")
            result.hit_rates[g.name] = rate["hit_rate"]
        result.gpu_history = self.manager.metrics()["gpu_history"]
        self.check_drained()
        self.manager.close()
        return result


def run_day(workload: Workload, delay_hook: Optional[Callable[[str], None]] = None,
            every: int = 0, report: Optional[Callable] = None) -> DayResult:
    """Run one engine day; a failing check or library error raises ``EngineDayFailed`` naming
    the seed, the step and every knob (rerunning with them reproduces it)."""
    engine = Engine(workload, delay_hook)
    try:
        return engine.run(every, report)
    except Exception as error:  # the day's one handler: it adds the reproduction and re-raises
        raise EngineDayFailed(
            f"engine day failed at step {engine.step_index} (seed {workload.seed}): "
            f"{type(error).__name__}: {error}\n  reproduce: run_day(Workload(**{asdict(workload)!r}))"
        ) from error
