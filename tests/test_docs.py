"""The docs' code runs as written: the guide's first loop prints what the guide says it prints,
every other ```python block of the README and of docs/ runs to the end (each checks its own
claims with asserts), and a block fenced ```python fragment (a part of a larger program) at
least compiles.

The first loop is the first ```python fence of docs/GUIDE.md's "## A first loop" section; what it
prints is the next plain ``` fence after it. Every block runs in a subprocess (from an empty
directory, importing the same torch_kvcm2 as this test process); the first loop on CUDA when the
extension has CUDA kernels and a GPU is visible, else on the CPU, as the block itself decides.
Plain ``` fences are commands, outputs and sketches, never run.
"""
import glob
import os
import re
import subprocess
import sys

import pytest

import torch_kvcm2

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(torch_kvcm2.__file__)))
DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
FENCE = re.compile(r"^(#{1,3} [^\n]*)$|^```python( fragment)?\n(.*?)^```\n", re.S | re.M)


def first_loop_and_output() -> tuple[str, str]:
    with open(os.path.join(ROOT, "docs", "GUIDE.md"), encoding="utf-8") as f:
        guide = f.read()
    match = re.search(r"^## A first loop\n(.*?)(?=^## )", guide, re.S | re.M)
    assert match, "docs/GUIDE.md has no '## A first loop' section"
    section = match.group(1)
    code = re.search(r"^```python\n(.*?)^```\n", section, re.S | re.M)
    assert code, "the first loop has no ```python block"
    printed = re.search(r"^```\n(.*?)^```\n", section[code.end():], re.S | re.M)
    assert printed, "the guide does not show what its first loop prints"
    return code.group(1), printed.group(1)


def blocks() -> tuple[dict, dict]:
    """Every ```python fence of the README and docs/, by file and the section it is in:
    (blocks to run, fragments to compile)."""
    runs, fragments = {}, {}
    for path in DOCS:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        section, name = None, os.path.relpath(path, ROOT)
        for match in FENCE.finditer(text):
            if match.group(1):
                section = match.group(1).lstrip("# ")
                continue
            target = fragments if match.group(2) else runs
            target[f"{name}: {section} ({len(runs) + len(fragments) + 1})"] = match.group(3)
    return runs, fragments


def run_block(code, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


def test_the_first_loop_runs_and_prints_what_the_guide_says(tmp_path):
    code, expected = first_loop_and_output()
    printed = run_block(code, tmp_path)
    assert printed == expected, (printed, expected)


RUNS, FRAGMENTS = blocks()
OTHER_BLOCKS = {name: code for name, code in RUNS.items() if code != first_loop_and_output()[0]}


def test_the_docs_have_runnable_blocks_beyond_the_first_loop():
    names = " ".join(OTHER_BLOCKS)
    assert "Prefix sharing" in names and "Host memory" in names, OTHER_BLOCKS.keys()


@pytest.mark.parametrize("code", OTHER_BLOCKS.values(), ids=OTHER_BLOCKS.keys())
def test_a_docs_python_block_runs(code, tmp_path):
    assert "assert " in code  # it checks what the docs say about it
    run_block(code, tmp_path)


@pytest.mark.parametrize("code", FRAGMENTS.values(), ids=FRAGMENTS.keys())
def test_a_docs_fragment_compiles(code):
    compile(code, "<fragment>", "exec")


def test_a_broken_block_is_caught(tmp_path):
    """The test of the test: a block whose claim is false fails, and so does a fragment that is
    not Python."""
    with pytest.raises(AssertionError):
        run_block("assert 1 + 1 == 3", tmp_path)
    with pytest.raises(SyntaxError):
        compile("fetches = kv.FetchStream(batch\n", "<fragment>", "exec")


def _masked(line: str) -> str:
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", line.strip())


def test_the_readme_quick_start_prints_the_line_it_shows(tmp_path):
    """The README's quick start shows generate.py --check's verdict line: the run prints a line
    of that form (its figures vary by machine and are masked), and exits 0."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", readme, re.S | re.M).group(1)
    assert "examples/generate.py --check" in section
    shown = [line for block in re.findall(r"^```\n(.*?)^```\n", section, re.S | re.M)
             for line in block.splitlines() if line.startswith("check passed")]
    assert len(shown) == 1, shown
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "generate.py"),
                             "--check", "--device", "cpu"], capture_output=True, text=True,
                            timeout=600, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    printed = [line for line in result.stdout.splitlines() if line.startswith("check passed")]
    assert [_masked(line) for line in printed] == [_masked(shown[0])], (printed, shown)
