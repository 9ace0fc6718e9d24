"""The README's examples run to completion and pass their own checks (each exits non-zero on a
failed check)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


@pytest.mark.parametrize("script, args, expect", [
    ("quickstart.py", [], "all history verified on host pages"),
    ("sparse_decode.py", ["--steps", "16"], "decode attention outputs match the dense reference"),
    ("sparse_decode.py", ["--steps", "4", "--compile"], "and eager;"),
])
def test_example_runs_and_its_checks_pass(script, args, expect):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args,
                             *(["--device", "cpu"] if script == "sparse_decode.py" else [])],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert expect in result.stdout
