"""Batched generation of a DSA model through torch_kvcm2 (MOD-5): ``Generator``.

Requests join when a row is free and their arrival step has come, prefill in chunks, decode
one token per step and leave when done, all in one batch whose sparse history lives in host
pages. One step, in order (docs/ENGINE.md):

1. host: admit, then give each running row its capacity for this step's tokens
   (``Batch.resize_rows``);
2. ``SparseMLACache.prepare_step`` (publish, the model's inputs), the model's forward (the
   cache work of every layer inside it), the last token's logits per row;
3. ``SparseMLACache.finish_step`` (declare host-direct tokens, flush, advance on the device);
4. sample, read the tokens back (the one wait of the step), ``Batch.poll()``;
5. host: record tokens, release finished requests.

A decode-only step can run compiled (``compile_decode``: ``torch.compile(fullgraph=True)``) or
replayed as one CUDA graph (``capture_decode``), with a fixed key length (``static_length``).
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

import torch_kvcm2 as kv

from .attention import install
from .dsa_cache import SparseMLACache
from .layout import cache_config

WAITING, RUNNING, SUSPENDED, FINISHED = "waiting", "running", "suspended", "finished"


class Request:
    """One request: its prompt, what it has generated, and where it stands.

    ``generated`` holds the sampled token ids; ``logits`` (when the generator records them)
    the float32 logits each was sampled from; ``prefilled`` the prompt tokens in the cache;
    ``cache`` its cache until it finishes (then closed: its pages go back to the pools)."""

    def __init__(self, request_id: int, prompt: Sequence[int], max_new_tokens: int,
                 arrival: int = 0, seed: int = 0):
        if not prompt:
            raise ValueError("Request: the prompt is empty")
        if max_new_tokens < 1:
            raise ValueError(f"Request: max_new_tokens must be >= 1, got {max_new_tokens}")
        self.request_id = request_id
        self.prompt = [int(t) for t in prompt]
        self.max_new_tokens, self.arrival = max_new_tokens, arrival
        self.generated: list = []
        self.logits: list = []
        self.prefilled = 0
        self.reused_tokens = 0  # prompt tokens shared from committed pages (share_prefixes)
        self.cache: Optional[kv.KVCache] = None  # while waiting, running or suspended
        self.state = WAITING
        self.joined_step: Optional[int] = None
        self.finished_step: Optional[int] = None
        self.sampler = torch.Generator().manual_seed(seed * 1_000_003 + request_id)

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new_tokens

    def next_tokens(self, chunk: int) -> list:
        """The tokens this request feeds next: a prefill chunk, or its last sampled token."""
        if self.prefilled < len(self.prompt):
            return self.prompt[self.prefilled:self.prefilled + chunk]
        return [self.generated[-1]]

    def __repr__(self):
        return (f"Request({self.request_id}, prompt {len(self.prompt)}, generated "
                f"{len(self.generated)}/{self.max_new_tokens}, {self.state})")


def last_logits(model, hidden: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """The logits of each row's last token of the step: ``lm_head`` over ``hidden[r,
    counts[r] - 1]`` (row 0's first position for a row without tokens). The stock reference
    takes its logits the same way, so both multiply the same shapes."""
    last = torch.as_tensor([max(n, 1) - 1 for n in counts], device=hidden.device)
    return model.lm_head(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])


class Generator:
    """Batched generation through torch_kvcm2.

    ``Generator(model, max_rows=4, max_tokens_per_row=1024, mode="scatter", prefill_chunk=64,
    hot_tokens=None, tokens_per_page=64, host_tier_bytes=0, gpu_history_tokens=0, sample=False,
    temperature=1.0, seed=0, record_logits=False, static_length=None, kernel=None,
    eos_token_id=None, share_prefixes=False)``
    builds the manager (``layout.cache_config``), a ``Batch`` of ``max_rows`` rows and the
    ``SparseMLACache`` (DeepSeek-V4: a ``StreamSet``, ``StreamBatch`` and ``V4Cache``). With
    ``share_prefixes`` a request shares the longest prefix of its prompt that an earlier request
    committed (whole pages, never its last token; PFX-2) and prefills only the rest, and commits
    its prompt's pages once prefilled. ``submit`` queues requests; ``step`` runs one batched
    step; ``run`` steps until every request has finished. ``suspend``/``resume`` preempt a
    request (its dense pages to the host tier when ``host_tier_bytes`` > 0), ``export``/``adopt``
    move one to another generator's manager. Call these between steps.
    """

    def __init__(self, model, *, max_rows: int = 4, max_tokens_per_row: int = 1024,
                 mode: str = "scatter", prefill_chunk: int = 64, hot_tokens: Optional[int] = None,
                 tokens_per_page: int = 64, host_tier_bytes: int = 0,
                 gpu_history_tokens: int = 0, sample: bool = False,
                 temperature: float = 1.0, seed: int = 0, record_logits: bool = False,
                 static_length: Optional[int] = None, kernel: Optional[str] = None,
                 eos_token_id: Optional[int] = None, share_prefixes: bool = False,
                 allow_untested: bool = False):
        if prefill_chunk < 1:
            raise ValueError(f"Generator: prefill_chunk must be >= 1, got {prefill_chunk}")
        if temperature <= 0:
            raise ValueError(f"Generator: temperature must be > 0, got {temperature}")
        self.model = model
        self.prefill_chunk, self.sample, self.temperature = prefill_chunk, sample, temperature
        device = next(model.parameters()).device
        if type(model).__name__ == "DeepseekV4ForCausalLM":
            self._build_v4(model, max_rows, max_tokens_per_row, mode, hot_tokens, tokens_per_page,
                           host_tier_bytes, gpu_history_tokens, static_length, kernel, device,
                           allow_untested)
        else:
            self.spec = install(model, allow_untested)
            self.config = cache_config(self.spec, max_rows=max_rows,
                                       max_tokens_per_row=max_tokens_per_row,
                                       tokens_per_page=tokens_per_page, hot_tokens=hot_tokens,
                                       device=device, host_tier_bytes=host_tier_bytes,
                                       gpu_history_tokens=gpu_history_tokens)
            self.manager = kv.KVCacheManager(self.config, host_tier_bytes=host_tier_bytes)
            self.batch = kv.Batch(self.manager)
            self.cache = SparseMLACache(model, self.batch, mode=mode, kernel=kernel,
                                        static_length=static_length,
                                        allow_untested=allow_untested)
        self._tier = host_tier_bytes > 0
        self.device = device
        self.seed, self.record_logits, self.eos_token_id = seed, record_logits, eos_token_id
        self.share_prefixes = share_prefixes
        self.requests: list = []
        self.running: dict = {}  # row -> Request
        self.steps = 0
        self.decode_steps = self.decode_tokens = 0
        self.decode_seconds = self.setup_seconds = 0.0
        self._decode = None  # a compiled or captured decode step
        self._decode_kind = "eager"
        self._setup_steps = 0  # decode steps that compile or capture: timed apart

    def _build_v4(self, model, max_rows, max_tokens_per_row, mode, hot_tokens, tokens_per_page,
                  host_tier_bytes, gpu_history_tokens, static_length, kernel, device,
                  allow_untested) -> None:
        """DeepSeek-V4: a manager per stream rate (``torch_kvcm2.stream_set``) and ``V4Cache``;
        ``hot_tokens`` are cell slots in entries. Its attention runs eagerly, scatter-back."""
        from torch_kvcm2.stream_set import StreamBatch, StreamSet

        from .v4 import V4Cache, describe_v4, stream_configs

        unsupported = [name for name, off in (("mode", mode == "scatter"),
                                              ("kernel", kernel is None),
                                              ("static_length", static_length is None),
                                              ("gpu_history_tokens", not gpu_history_tokens))
                       if not off]
        if unsupported:
            raise ValueError(f"Generator: {', '.join(unsupported)} not supported for "
                             f"DeepSeek-V4 (eager scatter-back attention over its streams)")
        self.spec = describe_v4(model, allow_untested)
        configs = stream_configs(self.spec, max_rows=max_rows,
                                 max_tokens_per_row=max_tokens_per_row, hot_entries=hot_tokens,
                                 tokens_per_page=tokens_per_page,
                                 prefill_chunk=self.prefill_chunk, device=device)
        self.manager = StreamSet(configs, host_tier_bytes=host_tier_bytes)
        self.config = self.manager.config
        self.batch = StreamBatch(self.manager)
        self.cache = V4Cache(model, self.batch, allow_untested)

    # ---- requests ----
    def submit(self, prompt: Sequence[int], max_new_tokens: int, arrival: int = 0) -> Request:
        """Queue a request that joins at step ``arrival`` or later (when a row is free)."""
        request = Request(len(self.requests), prompt, max_new_tokens, arrival, self.seed)
        total = len(request.prompt) + max_new_tokens
        if total > self.config.max_tokens_per_row:
            raise ValueError(f"Generator.submit: prompt + max_new_tokens = {total} tokens, past "
                             f"max_tokens_per_row {self.config.max_tokens_per_row}")
        self.requests.append(request)
        return request

    @property
    def pending(self) -> bool:
        return any(r.state in (WAITING, RUNNING) for r in self.requests)

    def run(self, max_steps: int = 100_000) -> list:
        """Step until no request waits or runs (suspended ones stay suspended); returns the
        requests."""
        for _ in range(max_steps):
            if not self.pending:
                break
            self.step()
        return self.requests

    # ---- one step ----
    def step(self) -> None:
        """One batched step (module docstring)."""
        self._admit()
        plan = {row: req.next_tokens(self.prefill_chunk) for row, req in self.running.items()}
        if not plan:
            self.steps += 1
            return
        self._fit(plan)
        decode_only = all(len(t) == 1 for t in plan.values())
        started = time.perf_counter()
        with torch.no_grad():
            if decode_only and self._decode is not None:
                logits = self._decode(plan)
            else:
                logits = self._eager(plan)
            tokens = self._pick(logits, plan)
        picked = tokens.tolist()  # the step's one wait for the device
        self.batch.poll()
        if decode_only and self._decode is not None and self._setup_steps:
            self._setup_steps -= 1
            self.setup_seconds += time.perf_counter() - started
        elif decode_only:
            self.decode_seconds += time.perf_counter() - started
            self.decode_steps += 1
            self.decode_tokens += len(plan)
        self._record(plan, picked, logits)
        self.steps += 1

    def _eager(self, plan: dict) -> torch.Tensor:
        inputs = self.cache.prepare_step(plan)
        hidden = self.model.model(**inputs, past_key_values=self.cache,
                                  use_cache=True).last_hidden_state
        counts = [len(plan.get(row, ())) for row in range(self.batch.max_rows)]
        logits = last_logits(self.model, hidden, counts)
        self.cache.finish_step()
        return logits

    def _admit(self) -> None:
        for req in self.requests:
            if len(self.running) >= self.batch.max_rows:
                return
            if req.state != WAITING or req.arrival > self.steps:
                continue
            if not self.manager.can_fit(len(req.prompt) + req.max_new_tokens,
                                        prefill_chunk=self.prefill_chunk):
                return  # in arrival order: wait until finished requests free pages
            # a shared prefix leaves the prompt's last token to compute (its logits sample)
            req.cache = self.manager.create_cache(req.prompt[:-1] if self.share_prefixes
                                                  else None)
            req.prefilled = req.reused_tokens = req.cache.history_length
            row = self.batch.add(req.cache)
            self.running[row] = req
            req.state, req.joined_step = RUNNING, self.steps

    def _fit(self, plan: dict) -> None:
        rows, targets = [], []
        for row, ids in plan.items():
            cache = self.running[row].cache
            target = cache.history_length + len(ids)
            if cache.capacity != target:
                rows.append(row)
                targets.append(target)
        if rows:
            failed = self.batch.resize_rows(rows, capacity=targets)
            if failed:
                raise RuntimeError(f"Generator: no pages for rows {failed} (the pools are full; "
                                   f"suspend a request or build with a larger "
                                   f"max_tokens_per_row)")

    def _pick(self, logits: torch.Tensor, plan: dict) -> torch.Tensor:
        if not self.sample:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1).cpu()
        picked = torch.zeros(logits.shape[0], dtype=torch.long)
        for row in plan:
            picked[row] = torch.multinomial(probs[row], 1,
                                            generator=self.running[row].sampler)[0]
        return picked

    def _record(self, plan: dict, picked: list, logits: torch.Tensor) -> None:
        for row, ids in plan.items():
            req = self.running[row]
            if req.prefilled < len(req.prompt):
                req.prefilled += len(ids)
                if req.prefilled < len(req.prompt):
                    continue  # a prefill chunk before the prompt's last: nothing to sample
                if self.share_prefixes:  # the prompt's whole pages, for requests after it
                    req.cache.commit(req.prompt)
            req.generated.append(picked[row])
            if self.record_logits:
                req.logits.append(logits[row].float().cpu())
            if req.done or picked[row] == self.eos_token_id:
                req.max_new_tokens = len(req.generated)
                self._release(row).close()  # its pages free (committed ones stay cached)
                req.cache = None
                req.state, req.finished_step = FINISHED, self.steps

    def _release(self, row: int) -> kv.KVCache:
        req = self.running.pop(row)
        cache = req.cache
        cache.resize(capacity=cache.history_length)  # nothing in flight: remove needs no discard
        self.batch.remove(cache)
        return cache

    # ---- preemption and migration ----
    def suspend(self, request: Request) -> None:
        """Preempt a running request between steps: its cache gives up its row and cells and,
        with a host tier, its dense pages (``KVCache.suspend(offload=True)``)."""
        row = self._row_of(request)
        cache = self._release(row)
        if not cache.suspend(offload=self._tier):
            raise RuntimeError("Generator.suspend: the host tier cannot take the request's pages")
        request.state = SUSPENDED

    def resume(self, request: Request) -> None:
        """Seat a suspended request again (a fresh, empty lease; its pages back from the tier)."""
        if request.state != SUSPENDED:
            raise RuntimeError(f"Generator.resume: {request} is not suspended")
        if len(self.running) >= self.batch.max_rows:
            raise RuntimeError("Generator.resume: no free row")
        row = self.batch.add(request.cache)
        if not request.cache.resume():
            self.batch.remove(request.cache)
            raise RuntimeError("Generator.resume: no GPU pages for the request's dense pages")
        self.running[row] = request
        request.state = RUNNING

    def export(self, request: Request) -> kv.CacheRecord:
        """Take a running request out of this generator (between steps): its final tokens as a
        ``CacheRecord`` (``KVCache.export``); the cache is closed here. Hand the record and the
        request to another generator's ``adopt``."""
        row = self._row_of(request)
        cache = self._release(row)
        record = cache.export()
        cache.close()
        self.requests.remove(request)
        request.cache, request.state = None, WAITING
        return record

    def adopt(self, request: Request, record: kv.CacheRecord) -> None:
        """Continue a request ``export`` took out of another generator: import its record
        into this manager (``KVCacheManager.import_cache``) and seat it."""
        if len(self.running) >= self.batch.max_rows:
            raise RuntimeError("Generator.adopt: no free row")
        cache = self.manager.import_cache(record)
        if cache is None:
            raise RuntimeError("Generator.adopt: no room in this manager's pools")
        request.cache, request.state = cache, RUNNING
        row = self.batch.add(cache)
        self.running[row] = request
        self.requests.append(request)

    def _row_of(self, request: Request) -> int:
        for row, req in self.running.items():
            if req is request:
                return row
        raise RuntimeError(f"{request} is not running here")

    # ---- compiled and captured decode steps ----
    def compile_decode(self, **options) -> None:
        """Run decode-only steps through ``torch.compile(fullgraph=True)`` of the model's forward
        with the cache work and the step's end (``finish_step``); needs ``static_length``."""
        self._check_fixed_shapes("compile_decode")
        if self.cache.static_length is None:
            raise ValueError("Generator.compile_decode: build the generator with static_length "
                             "(one key length for every decode step)")
        compiled = torch.compile(self._decode_body, fullgraph=True, **options)

        def decode(plan):
            inputs = self.cache.prepare_step(plan)
            logits = compiled(inputs["input_ids"], inputs["position_ids"],
                              inputs["attention_mask"])
            self.batch.record_advance()
            return logits

        self._decode, self._decode_kind, self._setup_steps = decode, "compiled", 1

    def capture_decode(self) -> None:
        """Replay decode-only steps as one CUDA graph (model forward, cache work, flush and
        advance), captured at the first decode step after this call; needs ``static_length``,
        a CUDA device and a MoE computation without host reads (a model built with
        ``experts_implementation="batched_mm"``: transformers' "grouped_mm" reads its expert
        offsets on the host in fp32, which a capture refuses)."""
        self._check_fixed_shapes("capture_decode")
        if self.device.type != "cuda":
            raise RuntimeError("Generator.capture_decode: CUDA graphs need a CUDA device")
        if self.cache.static_length is None:
            raise ValueError("Generator.capture_decode: build the generator with static_length")
        graph, state = None, {}

        def decode(plan):
            nonlocal graph
            inputs = self.cache.prepare_step(plan)  # fills the step's fixed tensors in place
            if graph is None:
                if "warm" not in state:  # the first decode step runs eagerly
                    state["warm"] = True
                    return self._decode_body(inputs["input_ids"], inputs["position_ids"],
                                             inputs["attention_mask"])
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph):
                        state["logits"] = self._decode_body(
                            inputs["input_ids"], inputs["position_ids"],
                            inputs["attention_mask"])
                except RuntimeError as error:
                    experts = getattr(self.model.config, "_experts_implementation", None)
                    if "during CUDA graph capture" in str(error) and experts != "batched_mm":
                        raise RuntimeError(
                            f"Generator.capture_decode: the model's forward copies between "
                            f"host and device during the capture (its MoE computation is "
                            f"{experts!r}); build the model with "
                            f"experts_implementation='batched_mm'") from error
                    raise
            graph.replay()
            self.batch.record_advance()
            return state["logits"]

        self._decode, self._decode_kind, self._setup_steps = decode, "graph", 2

    def _check_fixed_shapes(self, what: str) -> None:
        if self.spec.arch == "v4":
            raise ValueError(f"Generator.{what}: DeepSeek-V4 runs eagerly (transformers declares "
                             f"no fullgraph compile for it, and its steps change shape as "
                             f"windows close)")

    def _decode_body(self, input_ids, position_ids, attention_mask):
        hidden = self.model.model(input_ids=input_ids, position_ids=position_ids,
                                  attention_mask=attention_mask, past_key_values=self.cache,
                                  use_cache=True).last_hidden_state
        logits = self.model.lm_head(hidden[:, 0])
        self.cache.finish_step()
        return logits

    # ---- reporting ----
    def metrics(self) -> dict:
        """``manager.metrics()`` plus the generator's own counts: steps; decode steps, tokens
        and seconds (without the steps that compiled or captured the decode step, whose time
        is ``setup_seconds``)."""
        m = self.manager.metrics()
        m["generator"] = {"steps": self.steps, "decode_steps": self.decode_steps,
                          "decode_tokens": self.decode_tokens,
                          "decode_seconds": self.decode_seconds,
                          "setup_seconds": self.setup_seconds, "decode": self._decode_kind}
        return m

    def close(self) -> None:
        for row in list(self.running):
            self._release(row).close()
        self.batch.close(discard=True)
        self.manager.close()
