"""Shared test fixtures: the devices every op test runs on.

``DEVICES`` is ["cpu"] plus "cuda" when this build registered CUDA kernels and a GPU is visible.
Tests parametrised with ``devices`` get the CUDA case marked ``cuda`` (select them with
``pytest -m cuda``); tests that need CUDA outright use the ``cuda`` marker and are skipped here
when it is absent. The run ends with one line counting the skipped tests by reason.
"""
from __future__ import annotations

import collections
import os
import sys

import pytest
import torch

import torch_kvcm2

sys.path.insert(0, os.path.dirname(__file__))  # so tests can `import reference`
# and the fake serving engine of the examples (examples/engine.py): `import engine`
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))


def cuda_available() -> bool:
    return torch_kvcm2.has_cuda_kernels() and torch.cuda.is_available()


HAS_CUDA = cuda_available()
NEEDS_CUDA = "needs a CUDA GPU and the extension's CUDA kernels"

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])

#: parametrize values: ``@pytest.mark.parametrize("device", DEVICE_PARAMS)``
DEVICE_PARAMS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not HAS_CUDA, reason=NEEDS_CUDA),
    ]),
]


@pytest.fixture(params=DEVICE_PARAMS)
def device(request) -> str:
    """Every device the ops run on: "cpu", and "cuda" (skipped without CUDA kernels/GPU)."""
    return request.param


@pytest.fixture
def devices() -> list:
    """The list of usable devices, "cpu" first."""
    return list(DEVICES)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason=NEEDS_CUDA)
    for item in items:
        if item.get_closest_marker("cuda") is not None and not HAS_CUDA:
            item.add_marker(skip)


def skip_reason(report) -> str:
    """The reason a skipped test's report gives (pytest stores (path, line, "Skipped: why"))."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter):
    """One line: how many tests were skipped and why, grouped by reason, most common first."""
    skipped = terminalreporter.stats.get("skipped", [])
    if skipped:
        reasons = collections.Counter(skip_reason(report) for report in skipped)
        terminalreporter.write_line(f"{len(skipped)} skipped: " + "; ".join(
            f"{reason} ({count})" for reason, count in reasons.most_common()))
