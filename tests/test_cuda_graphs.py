"""INT-3: a full decode step captured in a CUDA graph replays correctly across steps with new
selections and a membership change; under mode="reduce-overhead" it records no cudagraph skip.
Both compare every output and every state tensor with an eager twin, bit for bit."""
import os
import subprocess
import sys

import pytest
import torch

from stepping import Driver, assert_same_state, mirror_inputs, step

pytestmark = pytest.mark.cuda
HERE = os.path.dirname(os.path.abspath(__file__))


def test_captured_step_replays_bit_identical_to_eager_across_membership_changes():
    warm = Driver("cuda", seed=1)  # first launches (kernel attributes) outside any capture
    warm.batch.publish()
    step(warm.batch, *warm.inputs())
    torch.cuda.synchronize()

    eager, captured = Driver("cuda", seed=5), Driver("cuda", seed=5)
    eager.batch.publish()
    captured.batch.publish()
    shapes_selected, shapes_tokens = warm.inputs()  # same shapes; leaves the twins' generators
    static_selected = [torch.zeros_like(t) for t in shapes_selected]  # addresses the graph reads
    static_tokens = {name: torch.zeros_like(t) for name, t in shapes_tokens.items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_outputs = step(captured.batch, static_selected, static_tokens)
    for number in range(24):
        selected, tokens = eager.inputs()
        expected = step(eager.batch, selected, tokens)
        mirror_inputs(captured, static_selected, static_tokens)  # same values as the twin's
        graph.replay()
        captured.batch.record_flush()  # the host bookkeeping the replay cannot do
        for a, b in zip(expected, static_outputs):
            assert torch.equal(a, b), number
        eager.advance()
        captured.advance()
        if number in (7, 15):  # membership changes between replays, same tables
            for driver in (eager, captured):
                driver.leave()
                driver.join()
                driver.batch.publish()
    assert_same_state(eager.batch, captured.batch)
    assert [c.history_length for c in eager.caches] == [c.history_length for c in captured.caches]


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
