"""The examples run to completion and pass their own checks (each exits non-zero on a failed
check), and handle their flags as command-line tools should: a bad value is a usage error
(exit status 2) that names the flag, never a traceback; any prompt length >= 1 works; --help shows
the defaults; the progress bar never lands in a pipe or a file; a GPU-only mode on a machine
without a usable GPU fails in one line.

Each example runs in a subprocess that imports the same torch_kvcm2 as this test process.
"""
import os
import subprocess
import sys

import pytest

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
])
def test_example_runs_and_its_checks_pass(script, args, expect):
    result = run_example(script, *args,
                         *(["--device", "cpu"] if script == "sparse_decode.py" else []))
    assert result.returncode == 0, output(result)
    assert expect in result.stdout


@pytest.mark.parametrize("script, args, flag", [
    ("sparse_decode.py", ["--slots", "8"], "--slots"),  # below K + 1 + ceil(I/U) + 1 = 12
    ("sparse_decode.py", ["--slots", "33"], "--slots"),  # not a multiple of the units per page
    ("sparse_decode.py", ["-P", "7"], "--tokens-per-page"),  # U = 4 does not divide it
    ("sparse_decode.py", ["--rows", "0"], "--rows"),
    ("sparse_decode.py", ["--prompt-lengths", "abc"], "--prompt-lengths"),
    ("sparse_decode.py", ["--prompt-lengths", "10,0"], "--prompt-lengths"),
    ("sparse_decode.py", ["--latent", "3"], "--latent"),
    ("sparse_decode.py", ["--steps", "1", "--compile"], "--steps"),
    ("quickstart.py", ["--steps", "0"], "--steps"),
    ("quickstart.py", ["--prompt-lengths", "40,x"], "--prompt-lengths"),
])
def test_bad_flag_is_a_usage_error_naming_it(script, args, flag):
    result = run_example(script, *args)
    assert result.returncode == 2, output(result)
    assert "Traceback" not in result.stderr, output(result)
    error = [line for line in result.stderr.splitlines() if ": error: " in line]
    assert len(error) == 1 and flag in error[0], output(result)
    assert result.stdout == ""


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
GPU_ONLY = [(["--device", "cpu"] if HAS_CUDA else []) + ["--compile", "reduce-overhead"]]
if not HAS_CUDA:
    GPU_ONLY.append(["--device", "cuda"])


@pytest.mark.parametrize("args", GPU_ONLY)
def test_gpu_only_mode_says_needs_a_gpu_in_one_line(args):
    result = run_example("sparse_decode.py", *args, *SMALL)
    assert result.returncode == 2, output(result)
    assert result.stdout == "", output(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a GPU" in lines[0], output(result)
