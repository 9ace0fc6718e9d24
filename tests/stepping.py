"""A small decode step over the whole Batch API, shared by the compile and CUDA-graph tests.

Two selection groups ("g0": layers a0, a1 with 1-token units; "g1": layer b0 with 2-token
units), a sparse latent buffer of 16 bytes per token viewed as 4 int32 words. The step runs the
documented order: resolve, write_indices, per layer fetch, write the new token into the cells,
an integer "attention" that reads every selected unit's tokens from the cells; then flush
(``step_groups``: the same with every group resolved and fetched in one call). All
of it is tensor code with fixed shapes, so it can be traced with fullgraph=True and captured.
``run`` drives it over steps with a membership change; ``CapturedTwins`` replays it captured
in a CUDA graph against an eager twin; ``assert_same_state`` compares two batches' state tensors
(eager and compiled or captured twins); ``op_samples`` gives one realistic argument set per
per-step op.
"""
import random

import torch

import torch_kvcm2 as kv

P, ROWS, WORDS = 4, 4, 4  # tokens per page, rows, int32 words per token


def make_batch(device, gpu_history_bytes=0):
    g0 = kv.SparseSpec(tokens_per_unit=1, width=4, slots=12, max_inflight_tokens=2, selection_id="g0")
    g1 = kv.SparseSpec(tokens_per_unit=2, width=3, slots=8, max_inflight_tokens=2, selection_id="g1")
    latent = kv.BufferSpec("kv", 4 * WORDS, sparse=True)
    layers = [kv.LayerSpec("a0", [latent], sparse=g0), kv.LayerSpec("a1", [latent], sparse=g0),
              kv.LayerSpec("b0", [latent, kv.BufferSpec("k", 8)], sparse=g1)]
    config = kv.CacheConfig(tokens_per_page=P, layers=layers, max_rows=ROWS, max_tokens_per_row=64,
                            gpu_budget_bytes=1 << 20, host_budget_bytes=1 << 20, device=device,
                            gpu_history_bytes=gpu_history_bytes)
    manager = kv.KVCacheManager(config)
    return manager, kv.Batch(manager)


def write_tokens(cells: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` int32[R, WORDS] to cell token indices ``index`` int32[R], skipping BAD,
    with no data-dependent shapes: an exact int32 add of (new - old) at every valid index and of
    0 at BAD ones (routed to token 0), so duplicates of token 0 change nothing."""
    tokens = cells.view(-1, P, WORDS * 4).view(torch.int32).view(-1, WORDS)
    valid = index >= 0
    safe = torch.where(valid, index, torch.zeros_like(index)).long()
    delta = torch.where(valid[:, None], values - tokens[safe], torch.zeros_like(values))
    tokens.index_put_((safe,), delta, accumulate=True)


def attend(cells: torch.Tensor, index: torch.Tensor, U: int) -> torch.Tensor:
    """Sum of every word of every token of every selected unit, per row (int64[R])."""
    tokens = cells.view(-1, P, WORDS * 4).view(torch.int32).view(-1, WORDS)
    valid = index >= 0
    entry = torch.where(valid, index, torch.zeros_like(index)).long()
    total = torch.zeros(index.shape[0], dtype=torch.int64, device=index.device)
    for j in range(U):
        words = tokens[entry * U + j].long().sum(-1)
        total = total + torch.where(valid, words, torch.zeros_like(words)).sum(-1)
    return total


def step_groups(batch, selected, new_tokens):
    """``step`` with every group resolved and fetched in one call (``Batch.resolve_groups``):
    the same outputs and state, bit for bit."""
    outputs = []
    indices = batch.resolve_groups(selected, fetch=True)
    for group in batch.config.selection_groups:
        table, _ = batch.write_indices(group.index)
        for layer in group.layers:
            cells = batch.cells(layer, "kv")
            write_tokens(cells, table[:, 0], new_tokens[layer])
            outputs.append(attend(cells, indices[group.index], group.sparse.tokens_per_unit))
    batch.flush()
    return outputs


def step(batch, selected, new_tokens):
    """One decode step. ``selected``: per group int32[ROWS, K]; ``new_tokens``: per layer
    int32[ROWS, WORDS], the KV of each row's one new token. Returns per-layer outputs."""
    outputs = []
    for group in batch.config.selection_groups:
        index = batch.resolve(group.index, selected[group.index])
        table, _ = batch.write_indices(group.index)
        for layer in group.layers:
            batch.fetch(layer)
            cells = batch.cells(layer, "kv")
            write_tokens(cells, table[:, 0], new_tokens[layer])
            outputs.append(attend(cells, index, group.sparse.tokens_per_unit))
    batch.flush()
    return outputs


class Driver:
    """Host side of a decode loop: membership, lengths and inputs from a seeded generator, so
    two drivers with one seed feed two batches identically."""

    def __init__(self, device, seed, gpu_history_bytes=0):
        self.device = device
        self.manager, self.batch = make_batch(device, gpu_history_bytes)
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.caches = []
        for _ in range(3):
            self.join()

    def join(self):
        cache = self.manager.create_cache()
        length = self.rng.randint(6, 20)  # imported history (DESIGN.md), one new token
        assert cache.resize(capacity=length + 8)
        cache.record_host_write(length)
        assert cache.resize(history=length)
        assert cache.resize(capacity=length + 1)
        self.batch.add(cache)
        self.caches.append(cache)

    def leave(self):
        cache = self.caches.pop(self.rng.randrange(len(self.caches)))
        cache.close()

    def inputs(self):
        selected = []
        for group in self.batch.config.selection_groups:
            sp = group.sparse
            sel = torch.full((ROWS, sp.width), -1, dtype=torch.int32)
            for row, cache in self.batch.members().items():
                units = cache.history_length // sp.tokens_per_unit
                picks = torch.randint(0, units, (sp.width,), generator=self.gen)
                sel[row] = picks.to(torch.int32)
            selected.append(sel.to(self.device))
        new_tokens = {layer.name: torch.randint(-2**31, 2**31 - 1, (ROWS, WORDS), generator=self.gen,
                                                dtype=torch.int32).to(self.device)
                      for layer in self.batch.config.layers}
        return selected, new_tokens

    def advance(self):
        """After a step: the host reads the device's lengths back (the step's poll), history
        takes the new token, capacity makes room for the next."""
        self.batch.poll()
        for cache in self.caches:
            assert cache.resize(history=cache.capacity)
            assert cache.resize(capacity=cache.capacity + 1)
        self.batch.publish()


def run(driver, fn, steps):
    """``steps`` steps of ``fn(batch, selected, new_tokens)`` (``step``, compiled or not) on
    ``driver``, with the host bookkeeping a compiled flush skips and a membership change after
    step 1; returns each step's outputs, copied to the CPU."""
    outputs = []
    for number in range(steps):
        selected, new_tokens = driver.inputs()
        outputs.append([o.cpu() for o in fn(driver.batch, selected, new_tokens)])
        driver.batch.poll()  # a compiled flush leaves its watermark on the device
        driver.advance()
        if number == 1:  # a membership change between steps
            driver.leave()
            driver.join()
            driver.batch.publish()
    return outputs


def compiled_equals_eager(fn, steps, **options):
    """Two CPU drivers of ``Driver(..., seed=3, **options)``: ``steps`` steps of ``fn`` eagerly
    on one and under ``torch.compile(fullgraph=True)`` on the other; every output and every
    state tensor equal, bit for bit (CPU kernels: even the miss list's order is
    deterministic). Returns (eager, compiled)."""
    eager, compiled = Driver("cpu", seed=3, **options), Driver("cpu", seed=3, **options)
    eager.batch.publish()
    compiled.batch.publish()
    expected = run(eager, fn, steps)
    got = run(compiled, torch.compile(fn, fullgraph=True), steps)
    for a, b in zip(expected, got):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    for x, y in zip(eager.batch.state_tensors(), compiled.batch.state_tensors()):
        assert torch.equal(x, y)
    return eager, compiled


def mirror_inputs(driver, static_selected, static_tokens):
    """The driver's next inputs copied into a captured step's static input tensors (a twin
    driver of the same seed draws the same values)."""
    selected, tokens = driver.inputs()
    for dst, src in zip(static_selected, selected):
        dst.copy_(src)
    for name, src in tokens.items():
        static_tokens[name].copy_(src)


class CapturedTwins:
    """INT-3's twins: ``fn`` (``step`` or ``step_groups``) of one driver's batch captured once
    as a CUDA graph on static inputs, against an eager twin driver of the same seed running
    ``eager_fn``. A warm-up driver makes the first launches (kernel attributes) outside any
    capture."""

    def __init__(self, seed, fn=step, eager_fn=step, gpu_history_bytes=0):
        warm = Driver("cuda", seed=1, gpu_history_bytes=gpu_history_bytes)
        warm.batch.publish()
        fn(warm.batch, *warm.inputs())
        torch.cuda.synchronize()
        self.eager = Driver("cuda", seed=seed, gpu_history_bytes=gpu_history_bytes)
        self.captured = Driver("cuda", seed=seed, gpu_history_bytes=gpu_history_bytes)
        self.eager_fn = eager_fn
        self.eager.batch.publish()
        self.captured.batch.publish()
        shapes_selected, shapes_tokens = warm.inputs()  # the shapes; the twins' generators untouched
        self.selected = [torch.zeros_like(t) for t in shapes_selected]  # addresses the graph reads
        self.tokens = {name: torch.zeros_like(t) for name, t in shapes_tokens.items()}
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fn(self.captured.batch, self.selected, self.tokens)

    def replay(self, steps, churn):
        """``steps`` steps: the eager twin's step, then the graph replayed on the same inputs,
        outputs equal bit for bit; membership changes on both after the steps in ``churn``;
        finally every state tensor equal."""
        eager, captured = self.eager, self.captured
        for number in range(steps):
            selected, tokens = eager.inputs()
            expected = self.eager_fn(eager.batch, selected, tokens)
            mirror_inputs(captured, self.selected, self.tokens)  # same values as the twin's
            self.graph.replay()
            captured.batch.poll()  # what the replay's flush moved on the device
            for a, b in zip(expected, self.outputs):
                assert torch.equal(a, b), number
            eager.advance()
            captured.advance()
            if number in churn:  # membership changes between replays, same tables
                for driver in (eager, captured):
                    driver.leave()
                    driver.join()
                    driver.batch.publish()
        assert_same_state(eager.batch, captured.batch)


def assert_same_state(a, b):
    """Every state tensor equal, except that a miss list is compared as a set of entries: its
    order follows the CTAs' atomics on CUDA (INT-4), and a host pool only over its committed
    slots (the rest of its reservation is no memory yet: STO-6)."""
    pools = {a.manager.pool(g).data_ptr(): (a.manager.pool(g), b.manager.pool(g))
             for g in range(a.manager.pool_groups)}  # the committed slots of each pool group
    for x, y in zip(a.state_tensors(), b.state_tensors()):
        if any(x is s.miss_list for s in a.groups):
            continue
        if x.data_ptr() in pools and x.shape[1:] == pools[x.data_ptr()][0].shape[1:]:
            g, h = pools[x.data_ptr()]
            assert len(g) == len(h)
            x, y = x[:len(g)], y[:len(h)]
        assert torch.equal(x, y)
    for s, t in zip(a.groups, b.groups):
        n = int(s.miss_count[0])
        assert n == int(t.miss_count[0])
        assert sorted(s.miss_list[:n].tolist()) == sorted(t.miss_list[:n].tolist())


def op_samples(device):
    """One realistic argument set per per-step op, taken from a live batch mid-step."""
    driver = Driver(device, seed=7)
    batch, groups = driver.batch, driver.batch.config.selection_groups
    batch.publish()
    selected, _ = driver.inputs()
    batch.resolve(0, selected[0])
    state, sp = batch.groups[0], groups[0].sparse
    fetch_args = batch._step.fetch_args["a0"]  # cells, host pools, positions, page tables
    (flush_pool, flush_positions, flush_cells, flush_res, flush_slots, flush_table), \
        (_, _, _, params) = batch._step.flush_args[0]
    positions = torch.arange(8, dtype=torch.int32, device=device).repeat(4, 1)
    return {
        "convert_page_indices": (torch.empty(4, 16, dtype=torch.int32, device=device),
                                 batch.page_tables[0], batch.capacity, 2, 1, 1, 1),
        "convert_token_indices": (torch.empty_like(positions), positions, batch.page_tables[0],
                                  batch.capacity, 2, 1, 4),
        "resolve": (state.resident, state.recency, state.index_table, state.miss_list,
                    state.miss_count, state.counters, state.inflight_slots, selected[0],
                    batch.history, batch.capacity, batch.lease, sp.tokens_per_unit, 4,
                    sp.max_inflight_tokens, 0, None, None, None, 0),  # ..., window, scratch,
        # write_table, write_start, sinks
        "fetch": (*fetch_args, state.miss_list, state.miss_count, sp.slots, sp.tokens_per_unit),
        "resolve_step": (state.resident, state.recency, state.index_table, state.miss_list,
                         state.miss_count, state.counters, state.inflight_slots,
                         state.write_table, state.inflight_start, fetch_args[0], selected[0],
                         batch.history, batch.capacity, batch.lease, *fetch_args[1:],
                         sp.tokens_per_unit, 4, sp.max_inflight_tokens, 0, None, 0),
        "resolve_groups": (*batch._step.groups_args[True][0], selected,
                           *batch._step.groups_args[True][1]),
        # rows 1 and 2 on GPU pages (ids 0..31 over 16 page ordinals), after the cells
        "resolve_gpu_history": (state.index_table, state.write_table, state.inflight_start,
                                state.counters, selected[0],
                                torch.tensor([0, 1, 1, 0], dtype=torch.int32, device=device),
                                torch.arange(4 * 16, dtype=torch.int32, device=device)
                                .view(4, 16) % 32, batch.history, batch.capacity, batch.lease,
                                state.resident.numel(), 32, sp.tokens_per_unit, 4,
                                sp.max_inflight_tokens, 0, 0),
        "locate_inflight": (state.inflight_slots, state.resident, batch.history, batch.capacity,
                            batch.lease, sp.tokens_per_unit, sp.max_inflight_tokens),
        "write_indices": (state.write_table, state.inflight_start, state.resident,
                          state.inflight_slots, batch.history, batch.capacity, batch.lease,
                          sp.tokens_per_unit, sp.max_inflight_tokens),
        "flush": (flush_pool, flush_positions, flush_cells, flush_res, flush_slots, flush_table,
                  batch.capacity, batch.history, batch.capacity, batch.lease, params),
        # the cells alone as the index spaces (no GPU page: cell_pages is every page)
        "flush_gpu_history": (flush_pool, flush_positions, flush_cells,
                              torch.tensor([0, 1, 1, 0], dtype=torch.int32, device=device),
                              torch.arange(4 * 16, dtype=torch.int32, device=device)
                              .view(4, 16) % 32, flush_table, batch.capacity, batch.history,
                              batch.capacity, batch.lease,
                              [x for cell, (_, U, I) in zip(flush_cells, zip(*[iter(params)] * 3))
                               for x in (cell.shape[0], U, I)]),
        "flush_watermark": (batch.written, batch._step.declared, batch.capacity, batch.history,
                            batch.capacity, batch.lease, batch._step.shape_pairs),
        "advance": (batch._table.mirror.lengths, batch.advance_counters,
                    torch.arange(batch.max_rows, dtype=torch.int32, device=device) % 3 - 1),
        "clear_leases": ([s.resident for s in batch.groups], [s.recency for s in batch.groups],
                         torch.tensor([1, 0], dtype=torch.int64, device=device)),
        "rank_signal": (torch.zeros(512, dtype=torch.int64, device=device),
                        torch.zeros(1, dtype=torch.int64, device=device), [flush_pool], 0, 1),
        "rank_wait": (torch.zeros(512, dtype=torch.int64, device=device), [flush_pool],
                      torch.zeros(1, dtype=torch.int64, device=device), 0, 1, 1000),
    }
