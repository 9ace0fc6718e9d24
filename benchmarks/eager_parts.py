"""Where an eager decode step's host time goes, at P-STEP-WALL's shape (64 rows, 61 sparse layers
in 16 selection groups, K=2048, S=4096; a small shape on the CPU): the step's wall time over
several runs, the eager path with its launches recorded against the same bound arguments calling
the ops (StepPlan, docs/DESIGN.md), then the median host time of each call a step makes, the
Python of `Batch.resolve` and `Batch.flush` alone (their native calls replaced by no-ops), and
reference costs of that host (`x.add_(1)`, a bare launch through `torch.cuda._sleep`).
``--profile`` adds a torch.profiler table of 20 eager steps (CUPTI's overhead included).

    python benchmarks/eager_parts.py [cpu] [--profile]

Checks before it prints the parts: the selections resolve to valid entries and the recorded and
the op path give the same index table for a resident selection."""
import sys
import time

import torch

import run
import torch_kvcm2 as kv
from torch_kvcm2 import ops


def median_us(fn, sync) -> float:
    return run.median_call_us(fn, reps=400, warmup=30, sync=sync)


def main() -> None:
    device = "cpu" if "cpu" in sys.argv[1:] or not torch.cuda.is_available() else "cuda"
    sz = run.step_sizes(device == "cpu")
    R, K, S, H = sz["rows"], sz["K"], sz["S"], sz["history"]
    groups = sz["groups"]
    config = run.sparse_config(device, rows=R, width=K, slots=S, unit=1, page=run.PAGE,
                               bytes_per_token=run.MLA_ROW, layers=sum(groups), inflight=16,
                               tokens_per_row=H + 8 * run.PAGE, groups=groups)
    manager = kv.KVCacheManager(config)
    batch = kv.Batch(manager)
    caches = run.seat(manager, batch, R, H, capacity=H + 1)
    for cache in caches:
        cache.set_reserve(4 * run.PAGE)
        assert cache.resize()
    batch.publish()
    gen = torch.Generator(device=device).manual_seed(11)
    sel = [torch.rand((R, H), generator=gen, device=device).argsort(-1)[:, :K].to(torch.int32)
           .contiguous() for _ in groups]
    ones = torch.ones(R, dtype=torch.int32, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step():
        batch.publish()
        for g in range(len(groups)):
            batch.resolve(g, sel[g], fetch=True)
        batch.flush(batch.history + ones)
        batch.advance(ones)

    plans = {"recorded": batch._plan, "ops": batch._new_step_plan(record_launches=False)}
    for _ in range(10):
        step()
    for g in range(len(groups)):
        assert bool((batch.groups[g].index_table >= 0).all()), f"group {g}: an invalid entry"
    tables = {}
    for name, plan in plans.items():  # every unit of sel[0] is resident by now: the same entries
        batch._use_step_plan(plan)
        tables[name] = batch.resolve(0, sel[0], fetch=True).clone()
    assert torch.equal(tables["recorded"], tables["ops"]), "recorded and op paths differ"
    # the step's wall time, the two plans alternating (the host's speed drifts within a process)
    for rep in range(10):
        name = "recorded" if rep % 2 == 0 else "ops"
        batch._use_step_plan(plans[name])
        sync()
        start = time.perf_counter_ns()
        for _ in range(40):
            step()
        host = (time.perf_counter_ns() - start) / 40e3
        sync()
        wall = (time.perf_counter_ns() - start) / 40e3
        print(f"step [{name:8s}] host {host:6.0f} us, wall {wall:6.0f} us per step", flush=True)
    batch._use_step_plan(plans["recorded"])
    state, sp = batch.groups[0], batch.groups[0].spec.sparse
    layers = tuple(config.selection_groups[0].layers)
    _, cells, pools, positions, page_tables = batch._plan_of(layers)
    targets = batch.history.clone()
    zeros = torch.zeros(R, dtype=torch.int32, device=device)
    x = torch.zeros(R, dtype=torch.int32, device=device)
    rows = [("x.add_(1)", lambda: x.add_(1))]
    if device == "cuda":
        rows.append(("torch.cuda._sleep(0)", lambda: torch.cuda._sleep(0)))
    for name, plan in plans.items():
        rows += [(f"StepPlan [{name}] .resolve_bound(0, sel, True)",
                  lambda p=plan: p.resolve_bound(0, sel[0], True)),
                 (f"StepPlan [{name}] .resolve_bound(0, sel, False)",
                  lambda p=plan: p.resolve_bound(0, sel[0], False)),
                 (f"StepPlan [{name}] .flush_bound(targets)", lambda p=plan: p.flush_bound(targets)),
                 (f"StepPlan [{name}] .advance_bound(zeros)", lambda p=plan: p.advance_bound(zeros))]
    rows += [
        ("Batch.resolve(0, sel, fetch=True)", lambda: batch.resolve(0, sel[0], fetch=True)),
        ("ops.resolve (no write outputs)", lambda: ops.resolve(
            state.resident, state.recency, state.index_table, state.miss_list, state.miss_count,
            state.counters, state.inflight_slots, sel[0], batch.history, batch.capacity,
            batch.lease, sp.tokens_per_unit, config.tokens_per_page, sp.max_inflight_tokens,
            state.spec.window or 0, state.resolve_scratch)),
        (f"Batch.fetch({len(layers)} layers)", lambda: batch.fetch(*layers)),
        ("ops.fetch (1 layer)", lambda: ops.fetch(cells[:1], pools[:1], positions[:1],
                                                  page_tables[:1], state.miss_list,
                                                  state.miss_count, sp.slots,
                                                  sp.tokens_per_unit)),
        ("Batch.flush(targets)", lambda: batch.flush(targets)),
        ("Batch.advance(zeros)", lambda: batch.advance(zeros)),
        ("Batch.publish() (nothing changed)", batch.publish),
        ("history + ones", lambda: batch.history + ones)]
    for label, fn in rows:
        print(f"{label:60s} median {median_us(fn, sync):7.2f} us", flush=True)

    class NoOps:  # the Python around the native calls
        def resolve_bound(self, *args):
            return True

        def flush_bound(self, *args):
            return True

        def advance_bound(self, *args):
            return True

    batch._use_step_plan(NoOps())
    for label, fn in [("Batch.resolve Python only", lambda: batch.resolve(0, sel[0], fetch=True)),
                      ("Batch.flush Python only", lambda: batch.flush(targets)),
                      ("Batch.advance Python only (with the read-back call)",
                       lambda: batch.advance(zeros))]:
        print(f"{label:60s} median {median_us(fn, sync):7.2f} us", flush=True)
    batch._use_step_plan(plans["recorded"])
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
