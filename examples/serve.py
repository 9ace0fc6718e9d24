"""The serving loop of an engine over torch_kvcm2, with a stand-in model: the integration guide.

``examples/engine.py`` is the loop (docs/ENGINE.md maps each of its events -- admit, prefill
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
the knobs). Flags the engine cannot serve are refused up front (exit status 2, naming the flag);
a day that turns out unable to drain stops as soon as that is clear and says which flags to
change (exit status 1); a day that will run for minutes says how long, once, on stderr.

    python examples/serve.py [--steps N] [--seed S] [--arrival closed|open] [--help]
"""
from __future__ import annotations

import argparse
import sys

from engine import (DELAY_OPS, DayDidNotDrain, EngineDayFailed, Workload,  # examples/engine.py
                    run_day)

from flags import add_device_flag, needs_gpu, pick_device, positive_int, seed  # examples/flags.py
from running import Estimate  # examples/running.py

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
    p.add_argument("--seed", type=seed, default=d.seed)
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
    check_engine_flags(p, args)
    return args


def query_tokens(args) -> int:
    """T: the query tokens of a speculative request's step (1 when no request is speculative)."""
    return args.draft_tokens + 1 if args.speculative_share > 0 else 1


def check_engine_flags(p: argparse.ArgumentParser, args) -> None:
    """What the engine's fixed geometry (``Workload``'s rows, pages, in-flight tokens and drain
    steps) cannot serve, refused before the day starts: drafts past the tokens a row may have in
    flight, a pool that cannot hold the longest request alone (it could never finish), and a
    closed loop holding more requests than the drain can finish."""
    d, T = DEFAULTS, query_tokens(args)
    if T > d.max_inflight_tokens:
        p.error(f"argument --draft-tokens: {args.draft_tokens} drafts make {T} query tokens per "
                f"speculative step, more than the {d.max_inflight_tokens} tokens a row of the "
                f"engine's cache may have in flight (every query token of a step is in flight): "
                f"at most {d.max_inflight_tokens - 1} (or --speculative-share 0)")
    # the longest request: a shared system prompt, the longest prompt (the engine clamps it to
    # its rows), the longest output and a step's query tokens in flight
    system = d.system_prompt_length if args.system_prompt_share > 0 and d.system_prompts else 0
    P = d.tokens_per_page
    longest = min(system + args.prompt_lengths[1] + args.output_lengths[1],
                  d.max_tokens_per_row - P - T) + T
    pages = -(-longest // P)
    if args.pool_pages < pages:
        p.error(f"argument --pool-pages: {args.pool_pages} page(s) of {P} tokens per pool group "
                f"cannot hold the longest request alone ({system} tokens of system prompt + "
                f"{args.prompt_lengths[1]} of prompt (--prompt-lengths) + "
                f"{args.output_lengths[1]} of output (--output-lengths) + {T} query token(s) "
                f"of a step, up to {longest} tokens), which could then never finish: at least "
                f"{pages}")
    # a closed loop holds --concurrency requests when arrivals stop; the drain seats max_rows of
    # them at a time, each for at least one prefill step and its shortest output at T a step
    fewest = 1 + -(-args.output_lengths[0] // T)
    drain = -(-args.concurrency // d.max_rows) * fewest
    if args.arrival == "closed" and drain > d.max_drain_steps:
        most = d.max_drain_steps // fewest * d.max_rows
        p.error(f"argument --concurrency: {args.concurrency} requests in the system when "
                f"arrivals stop cannot drain in the engine's {d.max_drain_steps} drain steps: "
                f"it seats {d.max_rows} at a time and a request takes at least {fewest} steps "
                f"(a prefill step, then {args.output_lengths[0]} output tokens at up to {T} a "
                f"step), so the drain takes at least {drain} steps: at most {most}")


class Undrainable(Exception):
    """The day cannot drain within the engine's drain steps (``watch``)."""


SERVE_LESS = ("Serve less: lower --concurrency (closed loop) or --arrival-rate (open loop), or "
              "give the requests more room (raise --pool-pages) or shorter lengths "
              "(--prompt-lengths, --output-lengths)")


def watch(args, workload: Workload):
    """The day's per-step hook (``run_day``'s report, every step): the summary line every
    ``--every`` steps; a line on stderr if the steps with arrivals will take minutes; and, once
    arrivals have stopped, the outlook of the drain: the requests left at the rate requests have
    ended (finished or aborted) so far. When they cannot end within the drain steps left, even
    at half again that rate, or none has ended after twice the longest request's steps, the day
    stops with ``Undrainable`` saying so, instead of running out its drain steps first."""
    w = workload
    estimate = Estimate("the day", w.steps, "steps with arrivals", flags=("--steps",))
    system = w.system_prompt_length if w.system_prompt_share > 0 else 0
    longest = -(-(system + w.prompt_lengths[1]) // w.prefill_chunk) + w.output_lengths[1]
    grace = max(200, 2 * longest)  # steps before "nothing has ended" means anything

    def hook(engine) -> None:
        step = engine.step_index
        if step % args.every == 0:
            report(engine)
        estimate.update(min(step, w.steps))
        if step < w.steps:
            return
        left = len(engine.waiting) + len(engine.running) + len(engine.suspended)
        ended = engine.result.finished + engine.result.aborts
        steps_left = w.steps + w.max_drain_steps - step
        if not left or (not ended and step < grace):
            return
        if ended and left * step / ended <= 1.5 * steps_left:
            return
        rate = f"{ended / step:.2f} a step" if ended else "none yet"
        raise Undrainable(
            f"the day cannot drain: at step {step}, arrivals stopped at {w.steps}, "
            f"{len(engine.waiting)} requests wait, {len(engine.running)} run and "
            f"{len(engine.suspended)} are suspended; requests have ended (finished or aborted) at "
            f"{rate}, and the engine drains for at most {w.max_drain_steps} steps. {SERVE_LESS}")

    return hook


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
        needs_gpu("--graph (one CUDA graph per device step)")
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
        result = run_day(workload, every=1, report=watch(args, workload))
    except EngineDayFailed as error:
        if isinstance(error.__cause__, Undrainable):  # the flags, not a failed check
            sys.stderr.write(f"serve.py: {error.__cause__}\n")
        elif isinstance(error.__cause__, DayDidNotDrain):  # the outlook was close: ran out
            sys.stderr.write(f"serve.py: the day did not drain: requests were still in the system "
                             f"{workload.max_drain_steps} steps after arrivals stopped at step "
                             f"{workload.steps}. {SERVE_LESS}\n")
        else:
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
