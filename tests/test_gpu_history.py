"""RSD-1, RSD-2 through the Batch API: a batch with GPU-resident history
(``CacheConfig.gpu_history_bytes``) reads and writes exactly what a batch that offloads every
row does, step after step, eager and compiled, while rows move onto GPU pages (their history
copied in once) and off them (pressure, departures), and the host pages end up equal."""
import pytest
import torch

from conftest import DEVICE_PARAMS
from stepping import ROWS, Driver, make_batch, run, step, step_groups

PAGE_BYTES = 3 * 4 * 16  # a page ordinal: 4 tokens x 16 bytes in each of the 3 sparse layers


class Twin(Driver):
    """A driver whose joining requests bring an imported history of their own bytes (random,
    from the driver's generator, so twins of one seed import the same), written to their host
    pages before they are seated: a request that takes a departed one's row must never read
    the departed one's bytes."""

    def join(self):
        cache = self.manager.create_cache()
        length = self.rng.randint(6, 20)
        assert cache.resize(capacity=length + 8)
        for layer in ("a0", "a1", "b0"):
            view = self.manager.buffer_view(layer, "kv", device_side=False)
            pages = torch.as_tensor(cache.host_pages(layer, "kv"))
            t = torch.arange(length)
            view[pages[t // 4], 0, t % 4] = torch.randint(0, 256, (length, 16),
                                                          generator=self.gen, dtype=torch.uint8)
        cache.record_host_write(length)
        assert cache.resize(history=length)
        assert cache.resize(capacity=length + 1)
        self.batch.add(cache)
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
    eager = Driver("cpu", seed=3, gpu_history_bytes=20 * PAGE_BYTES)
    compiled = Driver("cpu", seed=3, gpu_history_bytes=20 * PAGE_BYTES)
    eager.batch.publish()
    compiled.batch.publish()
    expected = run(eager, fn, 6)
    got = run(compiled, torch.compile(fn, fullgraph=True), 6)
    for a, b in zip(expected, got):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    for x, y in zip(eager.batch.state_tensors(), compiled.batch.state_tensors()):
        assert torch.equal(x, y)
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
        ref.demote(state, [], gpu_pages, pages, 1, [0, h], [0, c], [0, 1], U, P, I, window,
                   sinks)
        units, recency = seed_plan(h, c, U, P, I, S, window, sinks, pages * (P // U))
        assert units.tolist() + [ref.BAD] * (S - len(units)) == state.resident[1], (h, c)
        assert recency.tolist() == state.recency[1], (h, c)
