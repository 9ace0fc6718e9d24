"""The examples run to completion and pass their own checks (each exits non-zero on a failed
check), and handle their flags as command-line tools should: a bad value is a usage error
(exit status 2) that names the flag, never a traceback; any prompt length >= 1 works; --help shows
the defaults; the progress bar never lands in a pipe or a file; a GPU-only mode on a machine
without a usable GPU fails in one line.

Each example runs in a subprocess that imports the same torch_kvcm2 as this test process. The
decode step of sparse_decode.py, which --graph captures as one CUDA graph, is also driven in
this process: traced whole with fullgraph=True it equals the eager step (nothing in it needs the
host); the host's page work keeps every row inside its reserve when the device's lengths never
come back in time; and the --graph loop, with a stand-in for the graph on the CPU, checks every
replay's outputs after the loop.
"""
import os
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

import torch_kvcm2
from conftest import HAS_CUDA

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# the directory holding the torch_kvcm2 under test, ahead of any other installed copy
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(torch_kvcm2.__file__)))
# small sizes, so a run takes a few seconds on two cores
SMALL = ["--rows", "2", "--prompt-lengths", "30,70", "--steps", "4"]


def run_example(script, *args, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def output(result):
    return f"rc {result.returncode}\nstdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-4000:]}"


@pytest.mark.parametrize("script, args, expect", [
    ("quickstart.py", [], "all history verified on host pages"),
    ("sparse_decode.py", ["--steps", "16"], "decode attention outputs match the dense reference"),
    ("sparse_decode.py", ["--steps", "4", "--compile"], "and eager;"),
    # speculative: 3 query tokens per row per step, every one checked (4 rows x 3 tokens x 4
    # layers x 8 steps), a random accepted prefix per row per step
    ("sparse_decode.py", ["--steps", "8", "--draft-tokens", "2"],
     "checks passed: 384 decode attention outputs match the dense reference"),
    ("sparse_decode.py", ["--steps", "4", "--draft-tokens", "1", "--compile"], "and eager;"),
    ("shared_prefix.py", [], "checks passed: "),
    ("shared_prefix.py", ["--host-budget", "64M", "--gpu-budget", "16M"], "checks passed: "),
])
def test_example_runs_and_its_checks_pass(script, args, expect):
    result = run_example(script, *args,
                         *(["--device", "cpu"] if script == "sparse_decode.py" else []))
    assert result.returncode == 0, output(result)
    assert expect in result.stdout
    # the first --compile step compiles for a while: it says so first, on stderr
    compiling = "compiling the decode step (first step, may take a minute)...\n"
    assert (compiling in result.stderr) == ("--compile" in args), output(result)
    if script == "sparse_decode.py":  # every mode prints its host time next to tokens/s
        assert "tokens/s, host time per step " in result.stdout, output(result)
        drafts = "--draft-tokens" in args
        assert ("tokens per row per step on average" in result.stdout) == drafts, output(result)


@pytest.mark.cuda
@pytest.mark.parametrize("flags, outputs", [([], 1024), (["--draft-tokens", "3"], 4096)])
def test_sparse_decode_graph_replays_the_whole_step_and_its_checks_pass(flags, outputs):
    result = run_example("sparse_decode.py", "--device", "cuda", "--graph", *flags)
    assert result.returncode == 0, output(result)
    assert f"checks passed: {outputs} decode attention outputs match the dense reference" \
        in result.stdout, output(result)
    assert "graph: the whole decode step captured once as one CUDA graph, replayed 63 times" \
        in result.stdout, output(result)
    assert "tokens/s, host time per step " in result.stdout, output(result)


@pytest.mark.parametrize("script, args, flag", [
    ("sparse_decode.py", ["--slots", "8"], "--slots"),  # below K + 1 + ceil(I/U) + 1 = 12
    ("sparse_decode.py", ["--slots", "33"], "--slots"),  # not a multiple of the units per page
    ("sparse_decode.py", ["-P", "7"], "--tokens-per-page"),  # U = 4 does not divide it
    ("sparse_decode.py", ["--rows", "0"], "--rows"),
    ("sparse_decode.py", ["--prompt-lengths", "abc"], "--prompt-lengths"),
    ("sparse_decode.py", ["--prompt-lengths", "10,0"], "--prompt-lengths"),
    ("sparse_decode.py", ["--latent", "3"], "--latent"),
    ("sparse_decode.py", ["--steps", "1", "--compile"], "--steps"),
    ("sparse_decode.py", ["--steps", "1", "--graph"], "--steps"),
    ("sparse_decode.py", ["--graph", "--compile"], "--graph"),
    ("sparse_decode.py", ["--reserve-pages", "0"], "--reserve-pages"),
    ("sparse_decode.py", ["--draft-tokens", "-1"], "--draft-tokens"),
    ("sparse_decode.py", ["--draft-tokens", "8"], "--draft-tokens"),  # 9 query tokens > --inflight
    ("sparse_decode.py", ["--draft-tokens", "3", "--slots", "32"], "--slots"),  # < 4 x 9 + 3
    # half of a 4-token reserve cannot hold the 4 tokens a step may accept
    ("sparse_decode.py", ["--draft-tokens", "3", "--reserve-pages", "1", "-P", "4"],
     "--reserve-pages"),
    ("quickstart.py", ["--steps", "0"], "--steps"),
    ("quickstart.py", ["--prompt-lengths", "40,x"], "--prompt-lengths"),
    ("shared_prefix.py", ["--requests", "0"], "--requests"),
    ("shared_prefix.py", ["--prefix", "-5"], "--prefix"),
    ("shared_prefix.py", ["--prefix", "3000000000"], "--prefix"),  # past int32 tokens per row
    ("shared_prefix.py", ["--gpu-budget", "1000"], "--gpu-budget"),  # below the batch reserve
    ("shared_prefix.py", ["--host-budget", "10K"], "--host-budget"),  # below the pages needed
    ("shared_prefix.py", ["--host-budget", "1x"], "--host-budget"),
] + [(script, args, args[0]) for script, args in [  # runs bigger than any machine
    ("sparse_decode.py", ["--rows", "100000"]),
    ("sparse_decode.py", ["--prompt-lengths", "100000000"]),
    ("sparse_decode.py", ["--d-model", "100000000"]),
    ("sparse_decode.py", ["--layers", "100000000"]),
    ("sparse_decode.py", ["--steps", "100000000"]),
    ("shared_prefix.py", ["--requests", "100000000"]),
    ("shared_prefix.py", ["--prefix", "1000000000"]),
    ("quickstart.py", ["--prompt-lengths", "1000000000"]),
]])
def test_bad_flag_is_a_usage_error_naming_it(script, args, flag):
    result = run_example(script, *args)
    assert result.returncode == 2, output(result)
    assert "Traceback" not in result.stderr, output(result)
    error = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert len(error) == 1 and flag in error[0], output(result)
    assert result.stdout == ""


@pytest.mark.parametrize("script, args", [
    ("sparse_decode.py", ["--rows", "100000"]),
    ("sparse_decode.py", ["--layers", "100000000"]),
    ("shared_prefix.py", ["--prefix", "1000000000"]),
])
def test_a_run_bigger_than_the_machine_is_refused_before_it_allocates(script, args):
    """The memory a run needs (the cache config's budgets and the script's own tensors) is
    estimated from the flags and compared with what the machine has now, before anything is
    allocated or built: the refusal names the flag, the need and what is available, at once
    (a run that began allocating terabytes would be killed, or take minutes)."""
    started = time.monotonic()
    result = run_example(script, *args, "--device", "cpu")  # all of it host memory, then
    assert result.returncode == 2, output(result)
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(f"{script}: error: argument {args[0]}: this run needs about "), error
    assert " of host memory, more than the " in error and " available (" in error, error
    assert error.endswith(f"Lower {args[0]}"), error
    assert time.monotonic() - started < 60, output(result)  # the interpreter's start, mostly


def test_progress_of_a_long_phase_is_a_line_every_few_seconds_without_a_terminal(capsys):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        from running import Progress
    finally:
        sys.path.pop(0)
    quick = Progress("prefill", 3, "layers")  # a phase shorter than its interval: silent
    for done in (1, 2, 3):
        quick.update(done)
    slow = Progress("prefill", 3, "layers", every=0.0)  # as if each layer took the interval
    for done in (1, 2, 3):
        slow.update(done)
    printed = capsys.readouterr()
    assert printed.out == ""
    assert printed.err == "prefill: 1/3 layers after 0 s\nprefill: 2/3 layers after 0 s\n"


def test_sparse_decode_works_for_short_prompts():
    # fewer history units than --topk: the indexer picks what there is and pads the rest
    result = run_example("sparse_decode.py", "--device", "cpu", "--rows", "3",
                         "--prompt-lengths", "5,1,2", "--steps", "4")
    assert result.returncode == 0, output(result)
    assert "checks passed: 48 decode attention outputs match the dense reference" in result.stdout


@pytest.mark.parametrize("script, defaults", [
    ("sparse_decode.py", ["--rows ROWS", "(default: 4)", "(default: 100,250,500,1000)",
                          "(default: auto)"]),
    ("quickstart.py", ["(default: 40,70)", "(default: 6)", "(default: auto)"]),
    ("shared_prefix.py", ["(default: 16)", "(default: 1024)", "(default: 64)", "(default: 4)",
                          "(default: auto)"]),
])
def test_help_shows_defaults(script, defaults):
    result = run_example(script, "--help")
    assert result.returncode == 0, output(result)
    help_text = " ".join(result.stdout.split())  # argparse wraps lines to the terminal width
    for default in defaults:
        assert default in help_text, help_text


def test_no_progress_bar_when_output_is_captured():
    result = run_example("sparse_decode.py", "--device", "cpu", *SMALL)
    assert result.returncode == 0, output(result)
    assert "decode [" not in result.stdout + result.stderr, output(result)
    assert "\r" not in result.stdout + result.stderr, output(result)


# A GPU-only mode where no GPU is usable: asking for CUDA graphs on the CPU (with a GPU present,
# by --device cpu), and --device cuda without one.
GPU_ONLY = [(["--device", "cpu"] if HAS_CUDA else []) + mode
            for mode in (["--compile", "reduce-overhead"], ["--graph"])]
if not HAS_CUDA:
    GPU_ONLY.append(["--device", "cuda"])


@pytest.mark.parametrize("args", GPU_ONLY)
def test_gpu_only_mode_says_needs_a_gpu_in_one_line(args):
    result = run_example("sparse_decode.py", *args, *SMALL)
    assert result.returncode == 2, output(result)
    assert result.stdout == "", output(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a GPU" in lines[0], output(result)


# ---- the decode step of sparse_decode.py, in this process ----

def decoder(*flags):
    """A prefilled SparseDecoder of sparse_decode.py on the CPU, at small sizes."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import sparse_decode
    finally:
        sys.path.pop(0)
    args = sparse_decode.parse_args(["--device", "cpu", *SMALL, *flags])
    run = sparse_decode.SparseDecoder(args, torch.device("cpu"))
    run.prefill()
    return run


def finish(run):
    """Every step's checks passed; the state decoding ends in."""
    assert run.verify() > 0  # no row refused or cut short; every history token on host pages
    return (run.tokens.tolist(), [c.history_length for c in run.caches],
            [c.capacity for c in run.caches], run.batch.advance_counters.tolist(), run.checked)


# the speculative mode: T = 3 query tokens per row per step, a random accepted prefix of 1..3
DRAFTS = [([], 1), (["--draft-tokens", "2"], 3)]


@pytest.mark.parametrize("flags, T", DRAFTS)
def test_decode_step_traces_whole_and_equals_eager(flags, T):
    """The step --graph captures needs nothing from the host: traced with fullgraph=True (a host
    read, a data-dependent shape or a host-side call would break the graph) it gives the eager
    step's tokens, lengths and checked outputs, with the host's part (record_advance after it)
    as a replay has it; with drafts too (the draft head, the accepted prefix and the next token
    at the last accepted query token are tensor work)."""
    torch._dynamo.reset()
    results = []
    for traced in (False, True):
        run = decoder(*flags)
        step = (torch.compile(run.decode_step, fullgraph=True, backend="aot_eager")
                if traced else None)
        for number in range(run.args.steps):
            run.check_step(run.host_part(number, step))
        results.append(finish(run))
    assert results[0] == results[1]
    assert results[0][4] == 2 * 4 * 4 * T  # rows x layers x steps x query tokens checked


@pytest.mark.parametrize("flags", [[], ["--draft-tokens", "1"]])
def test_decode_host_tops_up_pages_when_the_lengths_come_back_late(flags):
    """A device that is always behind the host (a publish never finds the length read-back of
    advance finished): the host waits for it only before steps where a row could run out of its
    reserve, and then publishes the row's next pages. Without that, rows run out (the control).
    With drafts a row advances by the 1..T tokens it accepts, which the host knows up front."""
    for tops_up in (True, False):
        run = decoder("--reserve-pages", "1", "--tokens-per-page", "4", "--steps", "12", *flags)
        sync = run.batch._readback  # the batch's read-back: its read-backs come late
        take = sync.catch_up
        sync.catch_up = lambda wait=True: take() if wait else None
        if not tops_up:
            run.make_room = lambda step: None
        for number in range(run.args.steps):
            probes = run.host_part(number)
            if tops_up:  # (a row cut short loses its next token: the control's checks fail)
                run.check_step(probes)
        if tops_up:
            assert finish(run)[3] == [0, 0]
            assert 0 < run.waits < run.args.steps
        else:
            run.batch.poll()
            assert run.batch.advance_counters.tolist()[1] > 0  # rows cut short at their reserve


@pytest.mark.parametrize("flags, T", DRAFTS)
def test_graph_loop_checks_every_replay_after_the_loop(flags, T):
    """The --graph loop on the CPU, with a stand-in for the CUDA graph: a "replay" runs the
    traced step and copies its outputs into the same tensors every time, as a replayed graph
    does. The loop copies each replay's outputs aside and checks them all after the loop: every
    step is checked, and the run ends as the eager one does."""
    torch._dynamo.reset()
    results = []
    for graph in (False, True):
        run = decoder("--steps", "6", *flags)
        if graph:
            traced = torch.compile(run.decode_step, fullgraph=True, backend="aot_eager")
            outputs = {}

            def capture():
                run.batch.publish()
                run.graph = "captured"

            def replay():
                for name, value in traced().items():
                    outputs.setdefault(name, torch.empty_like(value)).copy_(value)
                run.replays += 1
                return outputs

            run.args.graph, run.capture, run.replay = True, capture, replay
        run.decode(run.args.steps)
        assert len(run.host_s) == run.args.steps - graph  # the first step is timed apart
        results.append(finish(run))
    assert run.replays == run.args.steps - 1
    assert results[0] == results[1]
    assert results[0][4] == 2 * 4 * 6 * T  # every step's query tokens' outputs checked


def test_serve_runs_the_engine_and_its_checks_pass():
    result = run_example("serve.py", "--steps", "60", "--every", "20")
    assert result.returncode == 0, output(result)
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("step 20: ") and "tokens/s" in lines[0], output(result)
    # the periodic line's cache figures come from manager.metrics(): the final summary's
    # preemption count (the engine's own) is at least the last periodic line's
    periodic = [line for line in lines if line.startswith("step ")]
    assert all(" fetched " in line and " flushed " in line for line in periodic), output(result)
    last = int(periodic[-1].split("preemptions ")[1].split(" ")[0])
    final = int(lines[-2].split(" preempted")[0].rsplit(" ", 1)[1])
    assert last <= final, output(result)
    assert lines[-1].startswith("checks passed: ") and "nothing leaked" in lines[-1], output(result)


def test_serve_bad_flag_is_a_usage_error_naming_it():
    result = run_example("serve.py", "--locality", "1.5")
    assert result.returncode == 2 and "argument --locality" in result.stderr, output(result)


# ---- a newcomer's bad flags and long runs ----

@pytest.mark.parametrize("script, args, flag", [
    ("serve.py", ["--seed", "-1"], "--seed"),  # numpy refuses negative seeds
    ("sparse_decode.py", ["--seed", "-1"], "--seed"),
    ("sparse_decode.py", ["--seed", str(1 << 70)], "--seed"),  # past torch's 64 bits
    # T = 100001 query tokens a step: more than the engine's 8 in flight per row
    ("serve.py", ["--draft-tokens", "100000"], "--draft-tokens"),
    # one page cannot hold a request: nothing could ever finish
    ("serve.py", ["--pool-pages", "1"], "--pool-pages"),
    # 100000 requests cannot drain in the engine's 2000 drain steps with 8 rows
    ("serve.py", ["--concurrency", "100000"], "--concurrency"),
    # the slots follow from --topk (no --slots given): the error names --topk, not --slots
    ("sparse_decode.py", ["--topk", "100000"], "--topk"),
    # 1.6 M tokens per row of reserve: the memory error names --reserve-pages
    ("sparse_decode.py", ["--reserve-pages", "100000"], "--reserve-pages"),
])
def test_a_newcomers_bad_flag_is_a_usage_error_naming_the_flag_passed(script, args, flag):
    """Each of these gave a traceback, a check failure after thousands of steps, or an error
    naming another flag; now exit status 2, one error line naming the flag that was passed,
    at once, before anything runs."""
    started = time.monotonic()
    result = run_example(script, *args)
    assert result.returncode == 2, output(result)
    assert "Traceback" not in result.stderr, output(result)
    error = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert len(error) == 1, output(result)
    assert error[0].split(": error: ", 1)[1].startswith(f"argument {flag}"), output(result)
    assert result.stdout == "", output(result)
    assert time.monotonic() - started < 60, output(result)


GPU_FLAGS = [("sparse_decode.py", ["--graph", *SMALL]),
             ("sparse_decode.py", ["--compile", "reduce-overhead", *SMALL]),
             ("serve.py", ["--graph"])]


@pytest.mark.skipif(HAS_CUDA, reason="with a usable GPU these modes run (or say: drop --device cpu)")
@pytest.mark.parametrize("script, args", GPU_FLAGS)
def test_gpu_only_flag_says_what_is_missing_like_device_cuda(script, args):
    """--graph and --compile reduce-overhead without a usable GPU list what is missing, as
    --device cuda does (``torch_kvcm2.missing_for("cuda")``), in one line naming the flag."""
    result = run_example(script, *args)
    assert result.returncode == 2, output(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a GPU" in lines[0] and args[0] in lines[0], output(result)
    assert "; ".join(torch_kvcm2.missing_for("cuda")) in lines[0], output(result)


def test_quickstart_budgets_hold_the_batch_reserve():
    """The quickstart's host budget is the batch reserve (``memory.batch_reserve_bytes``: the
    pinned staging grows with the rows and their tokens) plus every page: 16 rows of 50,000
    tokens need a reserve of more than the 1 MiB of slack the budget once had for it, and
    the first resize found no pages (a bare AssertionError)."""
    result = run_example("quickstart.py", "--prompt-lengths", ",".join(["50000"] * 16),
                         "--steps", "1", "--device", "cpu")
    assert result.returncode == 0, output(result)
    assert "all history verified on host pages" in result.stdout, output(result)


def test_serve_stops_a_day_that_cannot_drain_and_says_so():
    """1,000 requests in a closed loop: accepted up front (the drain could be fast enough), but
    when arrivals stop the rate requests end at says the drain would take several times the
    engine's drain steps: the day stops there with one line saying so and which flags to
    change, instead of running 2,000 more steps into "CHECK FAILED: the day did not drain"."""
    result = run_example("serve.py", "--concurrency", "1000", "--every", "1000")
    assert result.returncode == 1, output(result)
    assert "Traceback" not in result.stderr and "CHECK FAILED" not in result.stderr, output(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("serve.py: the day cannot drain: at step 300"), \
        output(result)
    assert "--concurrency" in lines[0], output(result)


def warning_of_long_work(script, *args, deadline=240):
    """Start ``script`` and read its stderr until it warns that its work will take minutes
    (the warning comes from the rate of its first few seconds of work), then stop it. Returns
    the warning lines and whether the script was still working when the first came."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, "examples", script), *args],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env=env)
    killer = threading.Timer(deadline, process.kill)
    killer.start()
    warnings, working = [], False
    try:
        for line in process.stderr:
            if " will take about " in line:
                warnings.append(line.rstrip("\n"))
                working = process.poll() is None
                break
    finally:
        process.kill()
        killer.cancel()
        rest = process.stderr.read()
        process.wait()
    warnings += [line for line in rest.splitlines() if " will take about " in line]
    return warnings, working


@pytest.mark.parametrize("script, args, flag", [
    ("sparse_decode.py", ["--steps", "30000", "--device", "cpu"], "--steps"),
    ("shared_prefix.py", ["--requests", "100000"], "--requests"),
    ("serve.py", ["--steps", "100000", "--every", "100000"], "--steps"),
])
def test_a_run_of_hours_warns_with_an_estimate_before_the_work(script, args, flag):
    """Work that will take more than a few minutes says so first: one line on stderr with the
    estimate, measured on its first seconds, naming the flag to lower."""
    warnings, working = warning_of_long_work(script, *args)
    assert len(warnings) == 1 and working, warnings
    assert f"lower {flag}" in warnings[0], warnings
    estimate = warnings[0].split(" will take about ")[1].split(" more ")[0]
    assert estimate.endswith((" min", " h")), warnings


def test_an_estimate_is_one_line_once_and_only_for_work_of_minutes(monkeypatch, capsys):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import running
    finally:
        sys.path.pop(0)
    clock = [0.0]
    monkeypatch.setattr(running, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(running, "_announced", [])
    quick = running.Estimate("prefill", 100, "layers", flags=("--layers",))
    for done in range(1, 100):  # 10 s in all: silent
        clock[0] += 0.1
        quick.update(done)
    slow = running.Estimate("decode", 1000, flags=("--steps",))
    later = running.Estimate("verify", 1000, "layers")
    clock[0] += 60  # a first step that compiles: not the rate
    slow.update(1)
    for done in range(2, 10):  # then 1 s a step: 17 min for the rest
        clock[0] += 1
        slow.update(done)
        later.update(done - 1)  # as long, but one line per run
    assert capsys.readouterr().err == (
        "decode: 1,000 steps will take about 17 min more at the rate so far (1 s each; 3 done); "
        "lower --steps for a shorter run\n")
