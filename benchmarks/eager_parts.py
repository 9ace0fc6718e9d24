"""Where an eager decode step's time goes, at P-STEP-WALL's shape (64 rows, 61 sparse layers in 16
selection groups, K=2048, S=4096; a small shape on the CPU), through the public Batch API only.
The step is P-STEP-WALL's as a user writes it (``publish``; per group ``resolve(g, selected,
fetch=True)``; every group's ``write_indices``; ``flush(targets)``; ``advance(accepted)``) on a
selection that is resident after the first step (no fetch bytes: the host-bound extreme).

It prints the step's host and wall time per step over several runs, the GPU time of the same
step (captured as one CUDA graph and replayed with ``record_advance``, timed with CUDA events;
not on the CPU) against the eager wall time, then the median host time of each call a step
makes and reference costs of that host (``x.add_(1)``, a bare launch through
``torch.cuda._sleep``). ``--profile`` adds a torch.profiler table of 20 eager steps (CUPTI's
overhead included); ``--rows N`` runs N rows instead of P-STEP-WALL's 64 (its 1- and 8-row
steps are where the eager step is host-bound). The calls include ``resolve_groups``, every group
in one call, which P-STEP-1's eager step makes instead of the per-group resolves.

    python benchmarks/eager_parts.py [cpu] [--profile] [--rows N]

Checks: the first step misses every selected unit and fetches its host bytes, every later step
hits every one of them and misses none, the index and write tables hold valid entries (before
the parts are timed), and every step advanced every row by one token with no row refused (at
the end).
"""
import statistics
import sys
import time

import torch

from harness import (PAGE, Timer, check_selection, eager_step, fill_random, graph_step_gpu_us,
                     median_call_us, reserved_step_batch, step_sizes)

RUNS, STEPS = 10, 40  # wall-time runs and steps per run
GPU_STEPS = 24  # timed graph replays


def median_us(fn, sync) -> float:
    return median_call_us(fn, reps=400, warmup=30, sync=sync)


def counts(batch) -> list:
    """Every group's (hits, misses, invalid) so far."""
    return [st.counters.tolist() for st in batch.groups]


def main() -> None:
    device = "cpu" if "cpu" in sys.argv[1:] or not torch.cuda.is_available() else "cuda"
    sz = step_sizes(device == "cpu")
    if "--rows" in sys.argv[1:]:
        sz["rows"] = int(sys.argv[sys.argv.index("--rows") + 1])
    R, K, H = sz["rows"], sz["K"], sz["history"]
    G = len(sz["groups"])
    # every step advances every row by one token: the reserve's top-ups at the publishes keep
    # the rows within max_tokens_per_row for the <= 8 pages of steps made here
    manager, batch, caches = reserved_step_batch(device, sz, 4 * PAGE)
    fill_random(manager.pool(0), 11)
    gen = torch.Generator(device=device).manual_seed(11)
    sel = [torch.rand((R, H), generator=gen, device=device).argsort(-1)[:, :K].to(torch.int32)
           .contiguous() for _ in range(G)]
    ones = torch.ones(R, dtype=torch.int32, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    body = eager_step(batch, sel, ones)
    steps = [0]  # every step that advanced the rows

    def step():
        batch.publish()
        body()
        steps[0] += 1

    # checks: the cold step misses everything and fetches the host bytes; then all hits
    step()
    assert counts(batch) == [[0, R * K, 0]] * G, f"cold step: (hits, misses, invalid) {counts(batch)}"
    layer = batch.config.selection_groups[0].layers[0]
    check_selection(batch.cells(layer, "kv"), manager.slot_pages(layer, "kv"),
                    batch.page_tables[0], sel[0], batch.groups[0].index_table,
                    torch.ones((R, K), dtype=torch.bool, device=device))
    for _ in range(9):
        step()
    for g, (hits, misses, invalid) in enumerate(counts(batch)):
        assert (hits, misses, invalid) == (9 * R * K, R * K, 0), \
            f"group {g}: warm steps (hits, misses, invalid) {hits, misses, invalid}"
        assert bool((batch.groups[g].index_table >= 0).all()), f"group {g}: an invalid entry"

    before = counts(batch)
    walls = []
    for _ in range(RUNS):
        sync()
        start = time.perf_counter_ns()
        for _ in range(STEPS):
            step()
        host = (time.perf_counter_ns() - start) / STEPS / 1e3
        sync()
        wall = (time.perf_counter_ns() - start) / STEPS / 1e3
        walls.append(wall)
        print(f"step [eager] host {host:6.0f} us, wall {wall:6.0f} us per step", flush=True)
    wall = statistics.median(walls)
    if device == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        batch.publish()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            body()
        batch.record_advance()

        def replay():
            graph.replay()
            steps[0] += 1

        gpu = graph_step_gpu_us(batch, replay, GPU_STEPS)
        print(f"step GPU time (one graph replay + record_advance) {gpu:6.0f} us; eager wall "
              f"{wall:.0f} us = {wall / gpu:.2f}x", flush=True)
    else:
        ops_us = Timer(device, 1).graph(body, STEPS)  # the step without its publish
        steps[0] += STEPS
        print(f"step ops alone (no GPU: no GPU time) {ops_us:6.0f} us; eager wall {wall:.0f} us",
              flush=True)
    sync()
    got = [[now - then for now, then in zip(n, b)] for n, b in zip(counts(batch), before)]
    timed = steps[0] - 10
    assert got == [[timed * R * K, 0, 0]] * G, f"timed steps: (hits, misses, invalid) {got}"

    batch.publish()
    for g in range(G):  # the write tables a step's resolve leaves (an advance moves them on)
        batch.resolve(g, sel[g], fetch=True)
        table, _ = batch.write_indices(g)
        assert bool((table[:, 0] >= 0).all()), f"group {g}: no cell for the in-flight token"
    layers = tuple(batch.config.selection_groups[0].layers)
    targets = batch.history.clone()  # nothing to write: the call's host cost alone
    zeros = torch.zeros(R, dtype=torch.int32, device=device)  # no token accepted
    x = torch.zeros(R, dtype=torch.int32, device=device)
    rows = [("x.add_(1)", lambda: x.add_(1))]
    if device == "cuda":
        rows.append(("torch.cuda._sleep(0)", lambda: torch.cuda._sleep(0)))
    rows += [
        ("Batch.publish() (nothing changed)", batch.publish),
        ("Batch.resolve(0, sel, fetch=True)", lambda: batch.resolve(0, sel[0], fetch=True)),
        ("Batch.resolve(0, sel)", lambda: batch.resolve(0, sel[0])),
        (f"Batch.resolve_groups({G} groups, fetch=True)",
         lambda: batch.resolve_groups(sel, fetch=True)),
        (f"Batch.resolve_groups({G} groups)", lambda: batch.resolve_groups(sel, fetch=False)),
        (f"Batch.fetch({len(layers)} layers)", lambda: batch.fetch(*layers)),
        ("Batch.write_indices(0) (after resolve)", lambda: batch.write_indices(0)),
        ("Batch.flush(targets)", lambda: batch.flush(targets)),
        ("Batch.advance(zeros)", lambda: batch.advance(zeros)),
        ("history + ones", lambda: batch.history + ones)]
    for label, fn in rows:
        print(f"{label:60s} median {median_us(fn, sync):7.2f} us", flush=True)
    batch.publish()
    batch.poll()
    assert batch.advance_counters.tolist() == [0, 0], "a row was refused or ran out of pages"
    assert [c.history_length for c in caches] == [H + steps[0]] * R, "a step did not advance every row"
    if device == "cuda" and "--profile" in sys.argv[1:]:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                step()
            sync()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                        max_name_column_width=60))


if __name__ == "__main__":
    main()
