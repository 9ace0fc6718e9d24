"""The serving loop of an engine over torch_kvcm2, with a stand-in model: the integration guide.

``torch_kvcm2.engine`` is the loop (docs/ENGINE.md maps each of its events -- admit, prefill
chunk, decode, verify draft tokens, preempt, resume, abort, finish, share a prompt -- to the
library calls, in order): requests arrive, are admitted by ``can_fit``, prefill in chunks
(host-direct writes declared before the flush), decode with a DSA-like indexer (one resolve per
selection group with fetch, the new tokens written into cells, attention through the index
table, flush), some speculatively; they share system prompts and continue finished
conversations through the prefix cache, are preempted when pages run out (suspended with their
dense pages offloaded to the host tier, freeing their GPU slots) and resumed (the pages copied
back into free GPU slots before the row's next step), abort, and finish (history verified, pages
committed, cache closed). Every decode step checks what attention read; after the drain every
pool slot of both tiers, lease and batch byte is back.

Prints a one-line summary every ``--every`` steps (its cache figures -- hit rate, bytes fetched
and flushed, preemptions -- from ``manager.metrics()``, as an operator's dashboard reads them)
and a final check line; exits 1 when a check fails (the message names the seed, the step and
the knobs).

    python examples/serve.py [--steps N] [--seed S] [--arrival closed|open] [--help]
"""
from __future__ import annotations

import argparse
import sys

from torch_kvcm2.engine import DELAY_OPS, EngineDayFailed, Workload, run_day

from flags import add_device_flag, pick_device, positive_int, usage_error  # examples/flags.py

DEFAULTS = Workload()


def share(text: str) -> float:
    """argparse type: a probability in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 1]")
    return value


def length_range(text: str) -> tuple:
    """argparse type: LO,HI token lengths, 1 <= LO <= HI."""
    parts = text.split(",")
    try:
        lo, hi = (positive_int(p.strip()) for p in parts) if len(parts) == 2 else (0, 0)
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r} is not LO,HI with 1 <= LO <= HI")
    return lo, hi


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = DEFAULTS
    p.add_argument("--steps", type=positive_int, default=d.steps,
                   help="steps with arrivals (the engine then drains)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--every", type=positive_int, default=100, help="steps between summary lines")
    p.add_argument("--arrival", choices=("closed", "open"), default=d.arrival)
    p.add_argument("--concurrency", type=positive_int, default=d.concurrency,
                   help="closed loop: requests in the system")
    p.add_argument("--arrival-rate", type=share, default=d.arrival_rate,
                   help="open loop: mean arrivals per step")
    p.add_argument("--prompt-lengths", type=length_range, default=d.prompt_lengths,
                   help="LO,HI: log-uniform prompt lengths")
    p.add_argument("--output-lengths", type=length_range, default=d.output_lengths,
                   help="LO,HI: uniform output lengths")
    p.add_argument("--prefill-chunk", type=positive_int, default=d.prefill_chunk)
    p.add_argument("--locality", type=share, default=d.locality,
                   help="share of a row's top-K kept from step to step")
    p.add_argument("--speculative-share", type=share, default=d.speculative_share)
    p.add_argument("--draft-tokens", type=positive_int, default=d.draft_tokens)
    p.add_argument("--continuation-share", type=share, default=d.continuation_share)
    p.add_argument("--system-prompt-share", type=share, default=d.system_prompt_share)
    p.add_argument("--abort-rate", type=share, default=d.abort_rate)
    p.add_argument("--pool-pages", type=positive_int, default=d.pool_pages,
                   help="pages per pool group (fewer: more preemptions)")
    p.add_argument("--delays", action="store_true",
                   help=f"inject a delay before every op of {', '.join(DELAY_OPS)}")
    p.add_argument("--graph", action="store_true",
                   help="replay the device step as one CUDA graph (GPU only)")
    add_device_flag(p)
    args = p.parse_args(argv)
    if args.prompt_lengths[1] + args.output_lengths[1] + 64 > d.max_tokens_per_row:
        p.error(f"argument --prompt-lengths/--output-lengths: a request may reach "
                f"{args.prompt_lengths[1] + args.output_lengths[1]} tokens; the engine's rows "
                f"hold {d.max_tokens_per_row} (with room for system prompts, keep below "
                f"{d.max_tokens_per_row - 64})")
    return args


def report(engine) -> None:
    """The periodic summary line, its cache figures from ``manager.metrics()`` (no host
    synchronisation; device counters lag by at most a few steps, docs/METRICS.md)."""
    r, m = engine.result, engine.manager.metrics()
    groups = m["selection_groups"]
    rates = " ".join(f"{name}={g['hits'] / max(1, g['hits'] + g['misses']):.2f}"
                     for name, g in groups.items())
    fetched = sum(g["fetched_bytes"] for g in groups.values())
    print(f"step {r.steps}: {r.tokens_per_second:.0f} tokens/s, concurrency {r.concurrency:.2f}, "
          f"hit rate {rates}, fetched {fetched / 1e6:.1f} MB, flushed "
          f"{m['flushed_bytes'] / 1e6:.1f} MB, preemptions {m['preemptions']} ({m['offloads']} "
          f"offloaded), resumes {m['resumes']}, aborts {m['aborts']}, prefix hit tokens "
          f"{m['prefix']['hit_tokens']}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = pick_device(args.device)
    if args.graph and device.type != "cuda":
        usage_error("--graph (one CUDA graph per device step) needs a GPU")
    workload = Workload(
        seed=args.seed, steps=args.steps, arrival=args.arrival, concurrency=args.concurrency,
        arrival_rate=args.arrival_rate, prompt_lengths=args.prompt_lengths,
        output_lengths=args.output_lengths, prefill_chunk=args.prefill_chunk,
        locality=args.locality, speculative_share=args.speculative_share,
        draft_tokens=args.draft_tokens, continuation_share=args.continuation_share,
        system_prompt_share=args.system_prompt_share, abort_rate=args.abort_rate,
        pool_pages=args.pool_pages, delay_ops=DELAY_OPS if args.delays else (),
        device=device.type, graph=args.graph)
    try:
        result = run_day(workload, every=args.every, report=report)
    except EngineDayFailed as error:
        sys.stderr.write(f"CHECK FAILED: {error}\n")
        return 1
    print(result.summary())
    print(f"checks passed: {result.checked_tokens} tokens read through index tables, "
          f"{result.verified_history_tokens} history tokens verified bit-exact on "
          f"{result.finished} finished requests, nothing leaked "
          f"({result.cached_slots_at_end} cached prefix slots left)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
