"""INT-3: a full decode step captured in a CUDA graph replays correctly across steps with new
selections and a membership change; under mode="reduce-overhead" it records no cudagraph skip.
Both compare every output and every state tensor with an eager twin, bit for bit."""
import os
import subprocess
import sys

import pytest

from stepping import CapturedTwins

pytestmark = pytest.mark.cuda
HERE = os.path.dirname(os.path.abspath(__file__))


def test_captured_step_replays_bit_identical_to_eager_across_membership_changes():
    twins = CapturedTwins(seed=5)
    twins.replay(24, churn=(7, 15))
    assert ([c.history_length for c in twins.eager.caches]
            == [c.history_length for c in twins.captured.caches])


REDUCE_OVERHEAD = r"""
import sys
sys.path.insert(0, {here!r})
import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
inductor_config.triton.cudagraph_or_error = True
inductor_config.fx_graph_cache = False
from stepping import Driver, run, step

eager, compiled = Driver("cuda", seed=11), Driver("cuda", seed=11)
eager.batch.publish()
compiled.batch.publish()
expected = run(eager, step, 8)
got = run(compiled, torch.compile(step, mode="reduce-overhead", fullgraph=True), 8)
assert all(torch.equal(x, y) for a, b in zip(expected, got) for x, y in zip(a, b))
from stepping import assert_same_state
assert_same_state(eager.batch, compiled.batch)
skips = counters["inductor"]["cudagraph_skips"]
assert skips == 0, skips
print("reduce-overhead OK, cudagraph skips:", skips)
"""


def test_reduce_overhead_records_no_cudagraph_skip_and_equals_eager():
    """Own process: cudagraph decisions are cached per process."""
    result = subprocess.run([sys.executable, "-c", REDUCE_OVERHEAD.format(here=HERE)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "reduce-overhead OK, cudagraph skips: 0" in result.stdout
