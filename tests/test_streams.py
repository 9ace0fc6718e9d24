"""Fetch overlapped with attention (``FetchStream``, REQUIREMENTS §8 ordering; docs/ENGINE.md).

The overlapped step of ``stepping.py``'s model resolves group g+1 and forks its fetch to the
side stream before group g's layers write and attend, waits per layer, and joins at the end. It
must give what the one-stream step gives, bit for bit, every step: on the CPU (where the fetch
runs inline), and on CUDA eagerly and inside one captured graph with a delay kernel
(``torch.cuda._sleep``) on each stream in turn -- before each fetch on the side stream (a
missing ``wait`` would let attention read cells before their fetch), before each resolve on the
current stream (a fork that did not wait would fetch from the previous miss list), and before
each attention on the current stream (the next step's fetch would overwrite cells attention
still reads). A run with ``wait`` switched off shows that the delays catch a missing wait.
"""
import pytest
import torch

import torch_kvcm2 as kv
from conftest import DEVICE_PARAMS
from stepping import Driver, assert_same_state, attend, mirror_inputs, step, write_tokens

SLEEP = 20_000_000  # cycles: ~10 ms, far longer than any op of the step
WHERE = ("side_before_fetch", "current_before_resolve", "current_before_attention")


def overlapped_step(batch, fetches, selected, new_tokens, delay=None):
    """``stepping.step`` with each group's fetch on the side stream: group g+1's resolve and
    fetch are issued before group g's layers write and attend. ``delay(where)`` puts a sleep
    on a stream at the named points."""
    mark = delay or (lambda where: None)
    groups = batch.config.selection_groups
    index = {}

    def resolve_and_fork(group):
        mark("current_before_resolve")
        index[group.index] = batch.resolve(group.index, selected[group.index])
        mark("side_before_fetch")
        fetches.fetch(*group.layers)

    resolve_and_fork(groups[0])
    outputs = []
    for i, group in enumerate(groups):
        if i + 1 < len(groups):
            resolve_and_fork(groups[i + 1])  # in flight while this group attends
        table, _ = batch.write_indices(group.index)
        for layer in group.layers:
            fetches.wait(layer)
            mark("current_before_attention")
            cells = batch.cells(layer, "kv")
            write_tokens(cells, table[:, 0], new_tokens[layer])
            outputs.append(attend(cells, index[group.index], group.sparse.tokens_per_unit))
    fetches.join()
    batch.flush()
    return outputs


def sleeper(fetches, where):
    """A delay hook that sleeps on the side stream or the current stream at ``where``."""
    def delay(point):
        if point != where:
            return
        if where == "side_before_fetch":
            # fork first, so that inside a capture the sleep is captured on the side stream too
            fetches.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(fetches.stream):
                torch.cuda._sleep(SLEEP)
        else:
            torch.cuda._sleep(SLEEP)
    return delay


def overlapped_by(where=None, skip_wait=False):
    """``run_twins``' overlapped step: each driver's step with its own ``FetchStream`` (kept in
    the returned function's ``fetches``), ``where``'s delay (none: None), and with ``wait``
    skipped when ``skip_wait``."""
    fetches = {}

    def overlapped(driver, selected, tokens):
        f = fetches.get(driver)
        if f is None:
            f = fetches[driver] = kv.FetchStream(driver.batch)
            if skip_wait:
                f.wait = lambda *layers: None
        delay = None if where is None else sleeper(f, where)
        return overlapped_step(driver.batch, f, selected, tokens, delay)
    overlapped.fetches = fetches
    return overlapped


def fill_history(driver, seed):
    """Random bytes on every page of every cache's sparse latents (the Driver's imported
    histories are zeros, which a stale read could not tell from a fetched one)."""
    gen = torch.Generator().manual_seed(seed)
    manager = driver.manager
    for cache in driver.caches:
        for layer in ("a0", "a1", "b0"):
            view = manager.buffer_view(layer, "kv")
            pages = torch.as_tensor(cache.host_pages(layer, "kv"))
            data = torch.randint(0, 256, (len(pages), *view.shape[1:]), generator=gen,
                                 dtype=torch.uint8)
            view[pages.to(view.device)] = data.to(view.device)


def run_twins(device, steps, overlapped, seed=3):
    """``steps`` steps of the one-stream step and of ``overlapped(driver, selected, tokens)`` on
    twin drivers; returns (expected, got) per step, on the device (no host wait between steps
    on the overlapped side, so a late stream is not hidden by a synchronisation)."""
    reference, twin = Driver(device, seed=seed), Driver(device, seed=seed)
    for driver in (reference, twin):
        fill_history(driver, seed)
        driver.batch.publish()
    expected, got = [], []
    for number in range(steps):
        selected, tokens = reference.inputs()
        expected.append(step(reference.batch, selected, tokens))
        reference.advance()
        selected, tokens = twin.inputs()
        got.append([o.clone() for o in overlapped(twin, selected, tokens)])
        twin.advance()
        if number == 2:  # a membership change between steps
            for driver in (reference, twin):
                driver.leave()
                driver.join()
                fill_history(driver, seed + number)
                driver.batch.publish()
    return reference, twin, expected, got


def mismatches(expected, got) -> int:
    return sum(not torch.equal(a, b) for e, g in zip(expected, got) for a, b in zip(e, g))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_overlapped_fetches_give_the_one_stream_results(device):
    overlapped = overlapped_by()
    reference, twin, expected, got = run_twins(device, 6, overlapped)
    assert mismatches(expected, got) == 0
    assert all(f.pending == [] for f in overlapped.fetches.values())
    assert_same_state(reference.batch, twin.batch)


def test_cpu_fetch_stream_runs_inline_and_checks_its_arguments():
    manager_driver = Driver("cpu", seed=1)
    fill_history(manager_driver, 1)
    batch = manager_driver.batch
    batch.publish()
    fetches = kv.FetchStream(batch)
    assert fetches.stream is None and fetches.pending == []
    selected, _ = manager_driver.inputs()
    batch.resolve(0, selected[0])
    misses = int(batch.groups[0].miss_count[0])
    assert misses > 0
    before = batch.cells("a0", "kv").clone()
    fetches.fetch("a0")  # inline: the cells change now
    assert not torch.equal(before, batch.cells("a0", "kv"))
    fetches.wait("a0", "a1")
    fetches.join()
    with pytest.raises(ValueError, match="different selection groups"):
        fetches.fetch("a1", "b0")
    with pytest.raises(ValueError, match="pass no stream"):
        kv.FetchStream(batch, stream=object())


@pytest.mark.cuda
@pytest.mark.parametrize("where", WHERE)
def test_eager_overlap_with_a_delay_on_each_stream_is_bit_exact(where):
    reference, twin, expected, got = run_twins("cuda", 5, overlapped_by(where))
    torch.cuda.synchronize()
    assert mismatches(expected, got) == 0
    assert_same_state(reference.batch, twin.batch)


def captured_run(where, steps=6, skip_wait=False):
    """The overlapped step captured once in a CUDA graph (with the delay inside the capture),
    replayed ``steps`` times against the eager one-stream twin; returns the mismatches."""
    warm = Driver("cuda", seed=1)  # first launches (kernel attributes) outside any capture
    warm.batch.publish()
    step(warm.batch, *warm.inputs())
    torch.cuda.synchronize()
    eager, captured = Driver("cuda", seed=5), Driver("cuda", seed=5)
    for driver in (eager, captured):
        fill_history(driver, 5)
        driver.batch.publish()
    fetches = kv.FetchStream(captured.batch)
    if skip_wait:
        fetches.wait = lambda *layers: None
    shapes_selected, shapes_tokens = warm.inputs()
    static_selected = [torch.zeros_like(t) for t in shapes_selected]
    static_tokens = {name: torch.zeros_like(t) for name, t in shapes_tokens.items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_outputs = overlapped_step(captured.batch, fetches, static_selected, static_tokens,
                                         sleeper(fetches, where))
    assert fetches.pending == []
    bad = 0
    for number in range(steps):
        selected, tokens = eager.inputs()
        expected = step(eager.batch, selected, tokens)
        mirror_inputs(captured, static_selected, static_tokens)  # same values as the twin's
        graph.replay()
        captured.batch.poll()
        bad += mismatches([expected], [static_outputs])
        eager.advance()
        captured.advance()
    if not bad:
        assert_same_state(eager.batch, captured.batch)
    return bad


@pytest.mark.cuda
@pytest.mark.parametrize("where", WHERE)
def test_captured_overlap_with_a_delay_on_each_stream_is_bit_exact(where):
    assert captured_run(where) == 0


@pytest.mark.cuda
def test_the_side_stream_delay_catches_a_missing_wait():
    """Without ``wait`` attention reads cells the delayed fetch has not filled yet: the delay
    makes the race certain, so the bit-exact tests above would see a missing wait."""
    _, _, expected, got = run_twins("cuda", 3, overlapped_by("side_before_fetch", skip_wait=True))
    torch.cuda.synchronize()
    assert mismatches(expected, got) > 0
    assert captured_run("side_before_fetch", steps=3, skip_wait=True) > 0
