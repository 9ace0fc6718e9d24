"""RSD-1, RSD-2 through the Batch API: a batch with GPU-resident history
(``CacheConfig.gpu_history_bytes``) reads and writes exactly what a batch that offloads every
row does, step after step, eager and compiled, while rows move onto GPU pages (their history
copied in once) and off them (pressure, departures), and the host pages end up equal."""
import random

import pytest
import torch

from conftest import DEVICE_PARAMS
from stepping import (ROWS, WORDS, Driver, attend, compiled_equals_eager, make_batch, run, step,
                      step_groups, write_tokens)

PAGE_BYTES = 3 * 4 * 16  # a page ordinal: 4 tokens x 16 bytes in each of the 3 sparse layers


class Twin(Driver):
    """A driver whose joining requests bring an imported history of their own bytes (random,
    from the driver's generator, so twins of one seed import the same), written to their host
    pages before they are seated: a request that takes a departed one's row must never read
    the departed one's bytes."""

    @classmethod
    def bare(cls, seed, gpu_history_bytes=0):
        """A twin with no request yet."""
        driver = cls.__new__(cls)
        driver.device, driver.caches = "cpu", []
        driver.manager, driver.batch = make_batch("cpu", gpu_history_bytes)
        driver.rng, driver.gen = random.Random(seed), torch.Generator().manual_seed(seed)
        return driver

    def join(self, length=None, reserve=0, row=None):
        cache = self.manager.create_cache()
        length = self.rng.randint(6, 20) if length is None else length
        assert cache.resize(capacity=length + 8)
        for layer in ("a0", "a1", "b0"):
            view = self.manager.buffer_view(layer, "kv", device_side=False)
            pages = torch.as_tensor(cache.host_pages(layer, "kv"))
            t = torch.arange(length)
            view[pages[t // 4], 0, t % 4] = torch.randint(0, 256, (length, 16),
                                                          generator=self.gen, dtype=torch.uint8)
        cache.record_host_write(length)
        assert cache.resize(history=length)
        cache.set_reserve(reserve)
        assert cache.resize(capacity=length + 1)
        self.batch.add(cache, row)
        self.caches.append(cache)


def history_bytes(driver):
    """Every member's history tokens, per layer, as its host pages hold them."""
    out = []
    for cache in driver.batch.members().values():
        for layer in ("a0", "a1", "b0"):
            view = driver.manager.buffer_view(layer, "kv", device_side=False)
            pages = torch.as_tensor(cache.host_pages(layer, "kv"))
            t = torch.arange(cache.history_length)
            out.append(view[pages[t // 4], 0, t % 4].clone())
    return out


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("fn", [step, step_groups], ids=["per_group", "all_groups"])
@pytest.mark.parametrize("slots", [ROWS * 16, 20, 8])
def test_gpu_history_reads_and_writes_what_offload_does(device, fn, slots):
    """Twins of one seed, one offloading every row and one with ``slots`` GPU history pages
    (room for every row, or pressure that demotes rows as they grow): every step's outputs
    (sums of the selected tokens read through the index table) are equal, and so is every
    history token on the host pages at the end."""
    offload = Twin(device, seed=5)
    gpu = Twin(device, seed=5, gpu_history_bytes=slots * PAGE_BYTES)
    assert gpu.manager.config.gpu_history_slots == gpu.batch.gpu_history_slots == slots
    for driver in (offload, gpu):
        driver.batch.publish()
    # 14 steps; after the second a request leaves and a new one takes its row (one publish)
    expected, got = run(offload, fn, 14), run(gpu, fn, 14)
    for number, (a, b) in enumerate(zip(expected, got)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), number
    for a, b in zip(history_bytes(offload), history_bytes(gpu)):
        assert torch.equal(a, b)
    metrics = gpu.manager.metrics()["gpu_history"]
    assert metrics["rows"] > 0 and metrics["promotions"] > 0 and metrics["promoted_bytes"] > 0
    if slots < ROWS * 16:
        assert metrics["demotions"] > 0  # pressure: rows left GPU pages as they grew
    counters = [gpu.batch.hit_rate(g) for g in range(2)]
    assert sum(c["misses"] for c in counters) < sum(
        offload.batch.hit_rate(g)["misses"] for g in range(2))


@pytest.mark.parametrize("fn", [step, step_groups], ids=["per_group", "all_groups"])
def test_compiled_step_with_gpu_history_equals_eager(fn):
    """INT-2 with GPU-resident history: the step under torch.compile(fullgraph=True) gives the
    eager step's outputs and state, bit for bit; a row's residency is data, not a graph branch."""
    torch._dynamo.reset()
    _, compiled = compiled_equals_eager(fn, 6, gpu_history_bytes=20 * PAGE_BYTES)
    assert compiled.manager.metrics()["gpu_history"]["promotions"] > 0


def test_one_open_batch_holds_the_gpu_history_pages():
    """The GPU history pages are set aside once in the batch reserve and held by one open batch
    at a time: a second batch built while the first is open has none (it offloads every row),
    a batch built after the holder closes has them again; the reserve the manager reports is
    what memory.batch_reserve_bytes computes."""
    import torch_kvcm2 as kv
    from torch_kvcm2.memory import batch_reserve_bytes

    manager, holder = make_batch("cpu", gpu_history_bytes=12 * PAGE_BYTES)
    stats = manager.stats()
    assert batch_reserve_bytes(manager.config) == {m: stats[m]["reserved_bytes"]
                                                   for m in ("gpu", "host")}
    assert holder.gpu_history_slots == 12
    holder.close()
    first = kv.Batch(manager, max_rows=2)
    second = kv.Batch(manager, max_rows=2)
    assert (first.gpu_history_slots, second.gpu_history_slots) == (12, 0)
    assert first.cells("a0", "kv").shape[0] == 2 * 12 // 4 + 12  # cells, then the GPU pages
    assert second.cells("a0", "kv").shape[0] == 2 * 12 // 4
    assert first.gpu_history_bytes() == 0 and first.row_counts()["gpu_history"] == 0
    first.close()
    third = kv.Batch(manager, max_rows=2)
    assert third.gpu_history_slots == 12
    second.close()
    third.close()
    manager.close()


@pytest.mark.parametrize("shape", [dict(U=1, P=4, I=2, S=8), dict(U=2, P=8, I=3, S=8),
                                   dict(U=4, P=8, I=6, S=6), dict(U=1, P=4, I=2, S=8,
                                                                  window=8, sinks=4)])
def test_seeds_of_a_demotion_are_the_reference_models(shape):
    """RSD-2: the units a demotion copies into the row's cleared lease and the recency it leaves
    (``gpu_history.seed_plan``) are the reference model's ``demote`` on a fresh lease, over
    random lengths: in-flight units first, then the newest live history units, at most S."""
    import random

    import reference as ref
    import reference_resident as rsd
    from torch_kvcm2.gpu_history import seed_plan

    U, P, I, S = shape["U"], shape["P"], shape["I"], shape["S"]
    window, sinks = shape.get("window", 0), shape.get("sinks", 0)
    rnd = random.Random(7)
    for _ in range(200):
        h = rnd.randrange(0, 60)
        c = h + rnd.randrange(0, I + 1)
        pages = -(-c // P) + rnd.randrange(0, 2)
        state = ref.ResidencyState.fresh(2, S)
        gpu_pages = [[], list(range(pages))]
        rsd.demote(state, [], gpu_pages, pages, 1, [0, h], [0, c], [0, 1], U, P, I, window,
                   sinks)
        units, recency = seed_plan(h, c, U, P, I, S, window, sinks, pages * (P // U))
        assert units.tolist() + [ref.BAD] * (S - len(units)) == state.resident[1], (h, c)
        assert recency.tolist() == state.recency[1], (h, c)


def twins(slots, seed, rows=(0, 1), length=12):
    """An offloading driver and one with ``slots`` GPU history pages, each with requests of
    ``length`` imported tokens of their own bytes (the same in both) seated at ``rows``, with a
    reserve that advance moves through."""
    out = []
    for gb in (0, slots * PAGE_BYTES):
        driver = Twin.bare(seed, gb)
        for row in rows:
            driver.join(length, reserve=16, row=row)
        driver.batch.publish()
        out.append(driver)
    return out


def unflushed_step(batch, gen):
    """A decode step that leaves its flush to the caller: per group resolve and fetch, the new
    token written through write_indices, an 'attention' over the selected tokens."""
    outputs = []
    for group in batch.config.selection_groups:
        sp = group.sparse
        selected = torch.full((ROWS, sp.width), -1, dtype=torch.int32)
        for row, cache in batch.members().items():
            units = cache.history_length // sp.tokens_per_unit
            selected[row] = torch.randint(0, units, (sp.width,), generator=gen).to(torch.int32)
        index = batch.resolve(group.index, selected, fetch=True)
        table, _ = batch.write_indices(group.index)
        for layer in group.layers:
            tokens = torch.randint(-2**31, 2**31 - 1, (ROWS, WORDS), generator=gen,
                                   dtype=torch.int32)
            cells = batch.cells(layer, "kv")
            write_tokens(cells, table[:, 0], tokens)
            outputs.append(attend(cells, index, sp.tokens_per_unit))
    return outputs


def same_steps(drivers, steps, end_step):
    """``steps`` steps of both drivers (``unflushed_step``, then ``end_step(driver)``): the
    outputs are equal, step by step."""
    for number in range(steps):
        outs = []
        for driver in drivers:
            outs.append(unflushed_step(driver.batch, driver.gen))
            end_step(driver)
        assert all(torch.equal(x, y) for x, y in zip(*outs)), number


def finish(driver):
    accepted = torch.tensor([1 if r in driver.batch.members() else 0 for r in range(ROWS)],
                            dtype=torch.int32)
    driver.batch.finish_step(accepted, host_writes=True)
    driver.batch.poll()
    driver.batch.publish()


def test_a_publish_of_declarations_between_writes_and_flush_moves_no_row():
    """finish_step(host_writes=True) publishes the step's declarations after its writes and
    before its flush: a row there must not move onto GPU pages (its new token is in its cells,
    and the GPU flush would overwrite the host page with the page's older bytes) or off them.
    Room for one row; the GPU row leaves at step 2, freeing the pages mid-run."""
    drivers = twins(slots=10, seed=3)
    same_steps(drivers, 2, finish)
    for driver in drivers:
        driver.caches.pop(0).close()
        driver.batch.publish()
    same_steps(drivers, 6, finish)
    for a, b in zip(history_bytes(drivers[0]), history_bytes(drivers[1])):
        assert torch.equal(a, b)


def test_a_row_moved_after_its_promotion_reads_its_own_bytes():
    """Batch.move keeps a row's lease: a row promoted onto GPU pages, then moved to a row
    whose publish leaves it on cells, must not read what its lease held before the promotion
    (the lease is cleared when a row moves onto GPU pages)."""
    drivers = []
    for gb in (0, 7 * PAGE_BYTES):
        driver = Twin.bare(11, gb)
        for row in (0, 2):
            driver.join(row=row)
        driver.batch.publish()
        drivers.append(driver)

    def steps(count):
        for number in range(count):
            outs = []
            for driver in drivers:
                outs.append([o.cpu() for o in step(driver.batch, *driver.inputs())])
                driver.batch.poll()
                driver.advance()
            assert all(torch.equal(x, y) for x, y in zip(*outs)), number

    steps(3)
    for driver in drivers:  # row 0 leaves: row 2 moves onto the pages it frees
        driver.caches.pop(0).close()
        driver.batch.publish()
    steps(3)
    for driver in drivers:  # row 2 -> row 0, where this publish leaves it on cells
        driver.batch.move(driver.caches[0], 0)
        driver.batch.publish()
    steps(8)


@pytest.mark.cuda
@pytest.mark.parametrize("fn", [step, step_groups], ids=["per_group", "all_groups"])
def test_one_captured_graph_serves_rows_moving_on_and_off_gpu_pages(fn):
    """INT-3 with GPU-resident history: the step captured once as a CUDA graph, replayed while
    rows move onto GPU pages and off them between replays (membership changes, pressure),
    gives the eager twin's outputs and state bit for bit: a row's residency is device data."""
    from stepping import CapturedTwins

    twins = CapturedTwins(seed=5, fn=fn, gpu_history_bytes=20 * PAGE_BYTES)
    twins.replay(12, churn=(2, 5, 8))
    assert twins.captured.manager.metrics()["gpu_history"]["promotions"] > 0
