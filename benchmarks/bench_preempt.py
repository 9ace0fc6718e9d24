"""Preemption benchmark P-PREEMPT (TIER-1): ``suspend(offload=True)`` + ``resume()`` of one
request of ``victim`` tokens in a 61-layer DSA-like model (656-B sparse latent + 132-B dense
indexer key per token per layer: at 32K tokens 258 MB of dense pages) while the other rows
decode.

Three rows:

* each direction alone (nothing else queued): the copy to host (suspend) and back (resume),
  from an event on the current stream just before the call to an event recorded on the copy
  stream after it (what the caller waits for), as GB/s against the copy-engine D2H / H2D
  ceilings of the same run (target >= 80%);
* the other rows' decode step (per selection group ``resolve(fetch=True)``: 2% new units per
  row per group each step, so the step's fetches cross PCIe next to the copies) timed with
  CUDA events, every step, while the copies run (the request is suspended and detached at one
  step and resumed detached some steps later, the engine's overlap pattern) against the same
  steps without the preemption (target <= 1.1x), plus the host waits counted in the preemption's
  calls (``synchronize`` of a stream, an event or the device, and torch's sync-debug warnings;
  target 0). The note also gives the copies' rates during the decode and the first step of a
  row resumed and seated at once (it waits for the whole copy back).

The copy back goes in pieces (``resume_piece_bytes``, 8 MiB: about a step's share of the
host-to-device link next to the fetches), the first at ``resume`` and one per ``publish``;
every step publishes first, as an engine's does, and the window of steps with the preemption
runs until the last piece (``steps // 2`` steps after the suspend, then the pieces). The copy
back "alone" is the resume of a seated row and its publish, which issues the rest at once.

Checks: every step's hits and misses; the request's dense bytes bit-exact after the resume;
its GPU bytes 0 while suspended (``stats()``). On the CPU (``--quick``) the same runs at tiny
shapes with wall-clock times and synchronous copies (no claims).
"""
from __future__ import annotations

import contextlib
import statistics
import time
import warnings

import torch

import torch_kvcm2 as kv
from harness import MLA_ROW, PAGE, Result, fill_random
from torch_kvcm2.memory import batch_memory_bytes, pool_group_count

INDEXER_KEY = 132  # bytes per token of DSA's dense indexer key


def preempt_sizes(quick: bool) -> dict:
    if quick:
        return {"rows": 4, "K": 64, "S": 128, "history": 256, "victim": 1024, "groups": [2, 1],
                "steps": 6, "reps": 2, "piece": 16 * 3 * 64 * 132 // 4}  # 4 pieces
    # history: K kept units plus 2% new ones per step, never selected before (no wrap-around)
    return {"rows": 64, "K": 2048, "S": 4096, "history": 5120, "victim": 32768,
            "groups": [4] * 15 + [1], "steps": 20, "reps": 5, "piece": 8 << 20}


def dsa_layers(sz: dict) -> list:
    """The layers of ``sz["groups"]`` (selection groups of that many layers; one layer: no
    shared indexer), each a sparse latent and a dense indexer key, K = ``sz["K"]`` and S =
    ``sz["S"]`` per group, 16 tokens in flight."""
    specs = []
    for gi, size in enumerate(sz["groups"]):
        sparse = kv.SparseSpec(1, sz["K"], sz["S"], 16, selection_id=f"g{gi}" if size > 1 else None)
        for _ in range(size):
            specs.append(kv.LayerSpec(f"l{len(specs)}", [kv.BufferSpec("kv", MLA_ROW, sparse=True),
                                                         kv.BufferSpec("indexer_k", INDEXER_KEY)],
                                      sparse=sparse))
    return specs


def preempt_config(device, sz: dict) -> tuple:
    """(config, host_tier_bytes): the layers of ``sz["groups"]``, each with a sparse latent and
    a dense indexer key; pools for every row's pages and the victim's, a host tier for the
    victim's dense pages."""
    specs = dsa_layers(sz)
    layers, R = len(specs), sz["rows"]

    def make(gpu, host):
        return kv.CacheConfig(tokens_per_page=PAGE, layers=specs, max_rows=R,
                              max_tokens_per_row=sz["victim"] + 2 * PAGE, gpu_budget_bytes=gpu,
                              host_budget_bytes=host, device=device)

    probe = make(0, 0)
    reserve = batch_memory_bytes(probe, pool_group_count(probe), 1)
    # every request's pages, and one more each for the slack of ``imported``
    pages = (R - 1) * (-(-sz["history"] // PAGE) + 1) + -(-sz["victim"] // PAGE) + 1
    tier = (-(-sz["victim"] // PAGE) + 2) * layers * PAGE * INDEXER_KEY
    config = make(R * reserve["gpu"] + pages * layers * PAGE * INDEXER_KEY + (64 << 20),
                  R * reserve["host"] + pages * layers * PAGE * MLA_ROW + tier + (16 << 20))
    return config, tier


def imported(manager, tokens: int):
    """A detached cache with ``tokens`` tokens of history (declared written to host pages)."""
    cache = manager.create_cache()
    assert cache.resize(capacity=tokens + 32)
    cache.record_host_write(tokens)
    assert cache.resize(history=tokens)
    assert cache.resize(capacity=tokens)
    return cache


@contextlib.contextmanager
def count_host_waits(device: str, counter: list):
    """Count host waits on the GPU inside the block: calls of ``synchronize`` on the device, a
    stream or an event, and torch's sync-debug warnings (``.item()``, blocking copies)."""
    if device != "cuda":
        yield
        return
    patched = [(torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"),
               (torch.cuda.Event, "synchronize")]
    saved = [getattr(owner, name) for owner, name in patched]

    def counting(fn):
        def wrapper(*args, **kwargs):
            counter[0] += 1
            return fn(*args, **kwargs)
        return wrapper

    for (owner, name), fn in zip(patched, saved):
        setattr(owner, name, counting(fn))
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        counter[0] += sum("synchroniz" in str(w.message) for w in caught)
    finally:
        torch.cuda.set_sync_debug_mode(mode)
        for (owner, name), fn in zip(patched, saved):
            setattr(owner, name, fn)


class Clock:
    """Per-step times: CUDA events on the current stream (CUDA) or wall clock (CPU)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.marks = []

    def mark(self, stream=None):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    @staticmethod
    def us(start, end) -> float:
        if isinstance(start, float):
            return (end - start) * 1e6
        end.synchronize()
        return start.elapsed_time(end) * 1e3


def bench_preempt(device, quick, ceil) -> list:
    sz = preempt_sizes(quick)
    R, K, H, V, steps = sz["rows"], sz["K"], sz["history"], sz["victim"], sz["steps"]
    config, tier_bytes = preempt_config(device, sz)
    manager = kv.KVCacheManager(config, host_tier_bytes=tier_bytes, resume_piece_bytes=sz["piece"])
    batch = kv.Batch(manager)
    others = [imported(manager, H) for _ in range(R - 1)]
    for cache in others:
        batch.add(cache)
    victim = imported(manager, V)
    victim_row = batch.add(victim)
    batch.publish()
    dense = manager.buffer("l0", "indexer_k").pool_group  # the one dense pool group
    pool = manager.pool(dense)  # its committed slots (read anew below: on the CPU they grow)
    slot_bytes = pool.shape[1] * pool.shape[2]
    fill_random(pool, 7)  # the indexer keys: never time zeros
    tier = manager.tier
    moved_pages = -(-V // PAGE)
    nbytes = moved_pages * slot_bytes
    layer_count = sum(sz["groups"])

    def victim_keys():
        keys = manager.pool(dense)
        slots = torch.tensor(victim.pages(dense), dtype=torch.long, device=keys.device)
        return keys[slots].clone()

    expected = victim_keys()

    # the steps with the preemption: the suspend, steps // 2 steps later the resume, then one
    # step per piece of the copy back after the first (issued at the resume), and one more
    pieces = -(-moved_pages // max(1, sz["piece"] // slot_bytes))  # whole slots a piece
    during_steps = steps // 2 + pieces + 1
    # the other rows' selections: per step 2% of K new units per row and group, the rest kept
    groups = config.selection_groups
    G, new = len(groups), max(1, K // 50)
    total = 4 + steps + during_steps + 1
    span = K + total * new
    assert span <= H, f"history {H} too short for {total} steps of {new} new units"
    gen = torch.Generator(device=device).manual_seed(11)
    order = torch.rand((G, R, H), generator=gen, device=device).argsort(-1)[..., :span]
    order[:, victim_row] = -1  # the victim selects nothing: its row only sits there

    def selection(i):
        keep = order[..., :K - new]
        fresh = order[..., K - new + i * new:][..., :new]
        return [torch.cat([keep[g], fresh[g]], dim=-1).to(torch.int32).contiguous() for g in range(G)]

    selections = [selection(i) for i in range(total)]
    clock = Clock(device)

    def step(i):
        for g in range(G):
            batch.resolve(g, selections[i][g], fetch=True)

    def misses():
        return sum(batch.hit_rate(g)["misses"] for g in range(G))

    for i in range(4):  # the steady state: the kept units resident
        step(i)
    if device == "cuda":
        torch.cuda.synchronize()

    # 1. each direction alone
    down, up = [], []
    for _ in range(sz["reps"]):
        start = clock.mark()
        assert victim.suspend(offload=True) and victim.offloaded
        down.append(Clock.us(start, clock.mark(tier.stream if clock.cuda else None)))
        assert manager.stats()["gpu"]["used_bytes"] == \
            sum(len(c.pages(dense)) for c in others) * slot_bytes, "suspended: GPU bytes held"
        start = clock.mark()
        assert victim.resume()
        batch.publish()  # its row: the rest of the copy back at once
        up.append(Clock.us(start, clock.mark(tier.stream if clock.cuda else None)))

    # 2. the other rows' steps without, then with the preemption (detached suspend + resume)
    def timed(first: int, n: int, at=None) -> list:
        times = []
        for i in range(first, first + n):
            if at is not None:
                at(i)
            with count_host_waits(device, waits):
                batch.publish()  # an engine's step starts so; the next piece of a copy back
            if "up" in copy_marks and "up_end" not in copy_marks and not victim.returning_bytes:
                copy_marks["up_end"] = clock.mark(tier.stream if clock.cuda else None)
            start = clock.mark()
            step(i)
            times.append((start, clock.mark()))
        return [Clock.us(a, b) for a, b in times]

    waits = [0]
    copy_marks = {}
    misses_before = misses()
    base = timed(4, steps)

    def preempt(i):
        if i == 4 + steps:
            with count_host_waits(device, waits):
                copy_marks["down"] = clock.mark()
                assert victim.suspend(offload=True)
                copy_marks["down_end"] = clock.mark(tier.stream if clock.cuda else None)
                batch.remove(victim)
                batch.publish()
        if i == 4 + steps + steps // 2:
            with count_host_waits(device, waits):
                copy_marks["up"] = clock.mark()
                assert victim.resume()  # detached: the copy back overlaps the next steps

    during = timed(4 + steps, during_steps, at=preempt)
    assert victim.returning_bytes == 0 and "up_end" in copy_marks, "the copy back did not end"
    assert misses() - misses_before == (steps + during_steps) * (R - 1) * new * G, \
        "a step missed other units"
    with count_host_waits(device, waits):
        row = batch.add(victim, row=victim_row)
        batch.publish()  # its copy is done by now: the wait is skipped
    assert row == victim_row
    assert torch.equal(victim_keys(), expected), "the resumed request's dense bytes differ"

    # the first step of a request resumed and seated at once waits for its whole copy back
    assert victim.suspend(offload=True)
    if device == "cuda":
        torch.cuda.synchronize()
    assert victim.resume()
    batch.publish()
    seated_at_once = timed(4 + steps + during_steps, 1)[0]
    assert torch.equal(victim_keys(), expected), "the resumed request's dense bytes differ"

    d2h_us, h2d_us = statistics.median(down), statistics.median(up)
    base_us, during_us = statistics.median(base), statistics.median(during)
    ratio = max(during) / base_us
    # where the slowest step fell (steps after the suspend; the resume is at steps // 2), and
    # how far the slowest step without the preemption is from its own median (the jitter alone)
    slowest = max(range(len(during)), key=during.__getitem__)
    base_jitter = max(base) / base_us
    down_under = Clock.us(copy_marks["down"], copy_marks["down_end"])
    up_under = Clock.us(copy_marks["up"], copy_marks["up_end"])
    shape = f"{layer_count}L {V // 1024}K tokens {nbytes / 1e6:.0f} MB"
    extra = {"rows": R, "layers": layer_count, "victim_tokens": V, "bytes": nbytes,
             "d2h_us": down, "h2d_us": up, "d2h_during_us": down_under, "h2d_during_us": up_under,
             "step_base_us": base, "step_during_us": during, "step_ratio_max": ratio,
             "host_waits": waits[0], "first_step_seated_at_once_us": seated_at_once,
             "piece_bytes": sz["piece"], "pieces": pieces, "slowest_step_after_suspend": slowest,
             "step_base_ratio_max": base_jitter}
    note = (f"{R - 1} rows decode ({G} groups, {new} new units per row and group per step): step "
            f"{base_us:.0f} us median without, {during_us:.0f} us median / {max(during):.0f} us max "
            f"with the copies ({ratio:.2f}x); during the decode the copy to host took "
            f"{down_under:.0f} us ({nbytes / down_under / 1e3:.1f} GB/s), back in {pieces} pieces of "
            f"{sz['piece'] / 1e6:.2f} MB (one per step) {up_under:.0f} us; host waits {waits[0]}; "
            f"a row resumed and seated at once: its first step {seated_at_once:.0f} us (waits for the copy back)")
    cuda = device == "cuda"
    results = [
        Result("P-PREEMPT", f"suspend D2H {shape}", d2h_us, nbytes, "CE D2H",
               ceil["d2h"], target=">= 80% CE", extra={**extra, "note": note}),
        Result("P-PREEMPT", f"resume H2D {shape}", h2d_us, nbytes, "CE H2D", ceil["h2d"],
               target=">= 80% CE", extra={"note": f"median of {len(up)} resumes alone"}),
        Result("P-PREEMPT", f"{R - 1} rows' step during the copies", max(during),
               target="<= 1.1x step, 0 waits",
               passed=(ratio <= 1.1 and waits[0] == 0) if cuda else None,
               extra={"note": f"max step during / median step without: {ratio:.2f}x (the slowest "
                              f"at step {slowest} after the suspend, the resume at step "
                              f"{steps // 2}; "
                              f"without the preemption max / median {base_jitter:.2f}x); "
                              f"host waits {waits[0]}"}),
    ]
    for cache in others + [victim]:
        cache.close()
    batch.close()
    manager.close()
    return results
