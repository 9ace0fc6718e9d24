"""The README's code runs as written: its usage block prints what the README says it prints,
and every other ```python block runs to the end (each checks its own claims with asserts).

The usage block is the first ```python fence of the README's "## Usage" section; what it prints
is the next plain ``` fence after it. Every block runs in a subprocess (from an empty directory,
importing the same torch_kvcm2 as this test process); the usage block on CUDA when the extension
has CUDA kernels and a GPU is visible, else on the CPU, as the block itself decides. Plain ```
fences are commands, outputs and fragments, never run.
"""
import os
import re
import subprocess
import sys

import pytest

import torch_kvcm2

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(torch_kvcm2.__file__)))


def usage_section() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    match = re.search(r"^## Usage\n(.*?)(?=^## )", readme, re.S | re.M)
    assert match, "README.md has no '## Usage' section"
    return match.group(1)


def usage_block_and_output() -> tuple[str, str]:
    section = usage_section()
    code = re.search(r"^```python\n(.*?)^```\n", section, re.S | re.M)
    assert code, "the Usage section has no ```python block"
    printed = re.search(r"^```\n(.*?)^```\n", section[code.end():], re.S | re.M)
    assert printed, "the Usage section does not show what its block prints"
    return code.group(1), printed.group(1)


def python_blocks() -> dict:
    """Every ```python fence of the README, by the section (## or ###) it is in."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    blocks, section = {}, None
    for match in re.finditer(r"^(#{2,3} [^\n]*)$|^```python\n(.*?)^```\n", readme, re.S | re.M):
        if match.group(1):
            section = match.group(1).lstrip("# ")
        else:
            blocks[f"{section} ({len(blocks) + 1})"] = match.group(2)
    return blocks


def run_block(code, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


def test_readme_usage_block_runs_and_prints_what_the_readme_says(tmp_path):
    code, expected = usage_block_and_output()
    printed = run_block(code, tmp_path)
    assert printed == expected, (printed, expected)


OTHER_BLOCKS = {name: code for name, code in python_blocks().items()
                if code != usage_block_and_output()[0]}


def test_readme_has_runnable_blocks_beyond_usage():
    assert any(name.startswith("Prefix sharing") for name in OTHER_BLOCKS), OTHER_BLOCKS.keys()
    assert any(name.startswith("Host memory") for name in OTHER_BLOCKS), OTHER_BLOCKS.keys()


@pytest.mark.parametrize("code", OTHER_BLOCKS.values(), ids=OTHER_BLOCKS.keys())
def test_readme_python_block_runs(code, tmp_path):
    assert "assert " in code  # it checks what the README says about it
    run_block(code, tmp_path)
