"""The README's usage block runs as written and prints what the README says it prints.

The block is the first ```python fence of the README's "## Usage" section; what it prints is the
next plain ``` fence after it. It runs in a subprocess (from an empty directory, importing the
same torch_kvcm2 as this test process), on CUDA when the extension has CUDA kernels and a GPU
is visible, else on the CPU, as the block itself decides.
"""
import os
import re
import subprocess
import sys

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


def test_readme_usage_block_runs_and_prints_what_the_readme_says(tmp_path):
    code, expected = usage_block_and_output()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout == expected, (result.stdout, expected)
