"""INT-1, INT-2: every registered op passes opcheck; a decode step compiles with fullgraph=True
and equals eager, bit for bit."""
import pytest
import torch

from torch._dynamo.utils import counters

from torch_kvcm2 import ops
from conftest import DEVICE_PARAMS
from stepping import Driver, compiled_equals_eager, op_samples, step, step_groups


def registered_ops():
    return sorted(s.name.split("::")[1] for s in torch._C._jit_get_all_schemas()
                  if s.name.startswith("torch_kvcm2::"))


def test_state_tensors_never_alias():
    """What a compiled step mutates enters it as distinct, non-overlapping tensors: fetch and
    flush take each pool group's whole pool, never per-buffer views (which alias, so AOTAutograd
    would mutate them through a synthetic base and cudagraph trees would refuse the graph).
    The stepping batch has three layers' latents in one pool group."""
    batch = Driver("cpu", seed=3).batch
    assert len(batch._step.flush_args) == 1 and batch.manager.pool_groups == 2
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for t in batch.state_tensors() if t.numel())
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start
    assert len({id(t) for t in batch.state_tensors()}) == len(batch.state_tensors())


def test_every_registered_op_is_covered():
    """A new op cannot be missed: each is a per-step op with a sample below or a setup op."""
    samples = op_samples("cpu")
    assert set(registered_ops()) == set(samples) | ops.SETUP_OPS


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_every_per_step_op_passes_opcheck(device):
    """INT-1: all default opcheck utilities, on each per-step op."""
    for name, args in op_samples(device).items():
        torch.library.opcheck(getattr(torch.ops.torch_kvcm2, name).default, args)


@pytest.mark.parametrize("fn", [step, step_groups], ids=["per_group", "all_groups"])
def test_decode_step_compiles_fullgraph_and_equals_eager(fn):
    """INT-2: resolve, write_indices, fetch per layer, a KV write and a read of the cells, flush,
    under torch.compile(fullgraph=True) on CPU; outputs and every state tensor equal eager.
    ``step_groups``: every group resolved and fetched in one call (``resolve_groups``)."""
    torch._dynamo.reset()
    counters.clear()
    eager, compiled = compiled_equals_eager(fn, 4)
    assert counters["stats"]["unique_graphs"] == 1  # one graph across steps and membership changes
    assert [c.history_length for c in eager.caches] == [c.history_length for c in compiled.caches]


def test_a_compiled_step_returns_a_copy_of_the_index_table_made_with_arithmetic():
    """docs/DESIGN.md, known limits: inside one compiled function, ``t + 0`` of the index table
    resolve just wrote is a fresh tensor per call (``t.clone()`` there is miscompiled by torch
    2.13's inductor into the state tensor itself, the documented reason for this pattern)."""
    torch._dynamo.reset()
    driver = Driver("cpu", seed=5)
    batch = driver.batch
    batch.publish()
    table = batch.groups[0].index_table

    def resolved(selected):
        return batch.resolve(0, selected) + 0

    fn = torch.compile(resolved, fullgraph=True)
    outs, expected = [], []
    for _ in range(3):
        selected, _ = driver.inputs()
        outs.append(fn(selected[0]))
        expected.append(table.clone())  # eager copy of what the call wrote
    assert all(o.data_ptr() != table.data_ptr() for o in outs)
    assert all(torch.equal(o, e) for o, e in zip(outs, expected))
    assert len({tuple(o.flatten().tolist()) for o in outs}) > 1


def test_finish_step_compiles_fullgraph_and_equals_eager():
    """INT-2, ENG-4: a step ending in finish_step (flush to history + accepted, advance) under
    torch.compile(fullgraph=True) on CPU, with record_advance() after each compiled call, leaves
    every state tensor and length eager leaves, in one graph."""
    torch._dynamo.reset()
    counters.clear()

    def body(batch, selected, new_tokens, accepted):
        outputs = step(batch, selected, new_tokens)[:0]  # the step's writes; no flush needed
        batch.finish_step(accepted)
        return outputs

    eager, compiled = Driver("cpu", seed=4), Driver("cpu", seed=4)
    fn = {id(eager): body, id(compiled): torch.compile(body, fullgraph=True)}
    for number in range(4):
        for driver in (eager, compiled):
            driver.batch.publish()
            selected, new_tokens = driver.inputs()
            accepted = torch.ones(driver.batch.max_rows, dtype=torch.int32)
            fn[id(driver)](driver.batch, selected, new_tokens, accepted)
            if driver is compiled:
                driver.batch.record_advance()  # the compiled call queues no read-back
            driver.batch.poll()
    for x, y in zip(eager.batch.state_tensors(), compiled.batch.state_tensors()):
        assert torch.equal(x, y)
    assert [c.history_length for c in eager.caches] == [c.history_length for c in compiled.caches]
    assert all(c.history_length > 0 for c in eager.caches)
    assert counters["stats"]["unique_graphs"] == 1
