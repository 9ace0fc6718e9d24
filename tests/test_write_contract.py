"""The write contract's edges (SAFE-1, SAFE-2, REQ-4; docs/HOST_PATH.md): each sequence that
would lose or leak KV raises a clear error before any change, and the documented way round keeps
every byte; plus the errors of bad host-side input.
"""
import numpy as np
import pytest
import torch

import torch_kvcm2 as kv
from torch_kvcm2 import BAD

P, B = 4, 8  # tokens per page, bytes per token


def make(device, max_rows=2):
    sparse = kv.SparseSpec(tokens_per_unit=1, width=4, slots=12, max_inflight_tokens=2)
    layer = kv.LayerSpec("x", [kv.BufferSpec("kv", B, sparse=True)], sparse=sparse)
    config = kv.CacheConfig(tokens_per_page=P, layers=[layer], max_rows=max_rows,
                            max_tokens_per_row=64, gpu_budget_bytes=1 << 20,
                            host_budget_bytes=1 << 20, device=device)
    manager = kv.KVCacheManager(config)
    return manager, kv.Batch(manager)


def token_bytes(request: int, positions) -> torch.Tensor:
    t = torch.as_tensor(positions, dtype=torch.long)[:, None]
    return ((t * 37 + request * 101 + torch.arange(B) * 3) % 251).to(torch.uint8)


def start_step(batch):
    """publish, resolve (nothing selected) and fetch: the in-flight units are seated."""
    batch.publish()
    batch.resolve(0, torch.full((batch.max_rows, 4), -1, dtype=torch.int32,
                                device=batch.config.device))
    batch.fetch("x")


def write_tokens(manager, batch, cache, positions):
    """Write tokens at ``positions`` of ``cache`` where the contract says: below the in-flight
    start straight to host pages (host_token_indices), from it on into cells (write_indices)."""
    dev = batch.config.device
    row = batch.row_of(cache)
    K = batch.group(0).index_table.shape[1]  # an all-padding selection seats the in-flight tail
    batch.resolve(0, torch.full((batch.max_rows, K), -1, dtype=torch.int32, device=dev), fetch=True)
    table, start = batch.write_indices(0)
    s0 = int(start[row])
    host = [t for t in positions if t < s0]
    cells = [t for t in positions if t >= s0]
    if host:
        pos = torch.full((batch.max_rows, len(host)), -1, dtype=torch.int32)
        pos[row] = torch.tensor(host, dtype=torch.int32)
        index = batch.host_token_indices("x", "kv", pos.to(dev))[row].cpu().long()
        assert bool((index >= 0).all())
        view = manager.buffer_view("x", "kv")
        view[(index // P).to(dev), 0, (index % P).to(dev)] = token_bytes(cache.request_id, host).to(dev)
    if cells:
        index = table[row].cpu()[torch.tensor(cells) - s0].long()
        assert bool((index >= 0).all())
        view = batch.cells("x", "kv")
        view[(index // P).to(dev), 0, (index % P).to(dev)] = token_bytes(cache.request_id, cells).to(dev)


def prefill(manager, batch, cache, n):
    """One step that writes tokens 0..n-1 by the contract, declares, flushes and makes them
    history."""
    assert cache.resize(capacity=n)
    start_step(batch)
    write_tokens(manager, batch, cache, range(n))
    batch.record_host_writes()
    batch.flush()
    assert cache.resize(history=n)


def settle(manager):
    """The host waits for the device: a flush's writes to host pages (and a fetch's reads of
    them) are complete before the host reads (or writes) those pages itself."""
    if manager.config.device.type == "cuda":
        torch.cuda.synchronize()


def host_tokens(manager, cache, positions) -> torch.Tensor:
    """The bytes of tokens at ``positions`` on ``cache``'s host pages (through the public API),
    once the device's work so far is done."""
    settle(manager)
    pages = cache.host_pages("x", "kv")
    view = manager.buffer_view("x", "kv", device_side=False)
    t = torch.as_tensor(positions, dtype=torch.long)
    return view[torch.as_tensor(pages)[t // P], 0, t % P]


def state(cache):
    return (cache.capacity, cache.history_length, cache.written, cache.pages(0))


def test_growth_past_unflushed_in_flight_tokens_is_refused(device):
    """Issue sequence 1: tokens 0, 1 written into cells, not flushed; growing capacity to 6 would
    make them host-direct (the in-flight start moves to 4) and the next resolve would drop them."""
    manager, batch = make(device)
    cache = manager.create_cache()
    batch.add(cache)
    assert cache.resize(capacity=2)
    start_step(batch)
    write_tokens(manager, batch, cache, [0, 1])
    before = state(cache)
    with pytest.raises(ValueError, match=r"SAFE-1: capacity 6 moves the in-flight start .* past "
                                         r"tokens \[0, 2\), which are in cells and not flushed"):
        cache.resize(capacity=6)
    assert state(cache) == before and batch.published
    batch.flush()  # the documented way: flush first, then grow
    assert cache.resize(capacity=6)
    start_step(batch)
    write_tokens(manager, batch, cache, [2, 3, 4, 5])
    batch.record_host_writes()
    batch.flush()
    assert cache.resize(history=6)
    assert torch.equal(host_tokens(manager, cache, range(6)), token_bytes(cache.request_id, range(6)))


def test_host_written_tokens_cannot_return_to_the_in_flight_range(device):
    """Issue sequence 2: tokens 0..7 written to host pages, 8, 9 into cells; after flush to 4 and
    history 4, capacity 7 would bring the host-written 5, 6 into the in-flight range, whose cells
    do not hold them (and the next flush would copy the stale cells over the host copy)."""
    manager, batch = make(device)
    cache = manager.create_cache()
    batch.add(cache)
    assert cache.resize(capacity=10)
    start_step(batch)
    write_tokens(manager, batch, cache, range(10))
    batch.record_host_writes()
    batch.flush([4, 0])
    assert cache.resize(history=4)
    before = state(cache)
    with pytest.raises(ValueError, match=r"SAFE-1: lengths \(history 4, capacity 7\) bring tokens "
                                         r"\[5, 7\), already on host pages, back into the in-flight"):
        cache.resize(capacity=7)
    assert state(cache) == before
    assert cache.resize(history=8)  # the way round: history over the host-written tokens
    batch.publish()
    batch.flush()
    assert cache.resize(history=10)
    assert torch.equal(host_tokens(manager, cache, range(10)), token_bytes(cache.request_id, range(10)))


def test_remove_refuses_in_flight_tokens_unless_discarded(device):
    """Issue sequence 3: remove() with tokens in flight would hand their cells to the next
    member; it raises, and discard=True (the abort path) drops them (capacity back to history)."""
    manager, batch = make(device)
    cache = manager.create_cache()
    batch.add(cache)
    assert cache.resize(capacity=3)
    start_step(batch)
    write_tokens(manager, batch, cache, [0, 1, 2])
    batch.record_host_writes()
    batch.flush([2, 0])
    assert cache.resize(history=2)  # token 2 still in flight
    batch.publish()
    with pytest.raises(RuntimeError, match=r"tokens are in flight \(history 2 < capacity 3\)"):
        batch.remove(cache)
    assert batch.row_of(cache) == 0 and cache.capacity == 3
    with pytest.raises(RuntimeError, match="tokens in flight"):
        batch.close()
    batch.remove(cache, discard=True)
    assert batch.row_of(cache) is None and (cache.capacity, cache.history_length) == (2, 2)
    other = manager.create_cache()
    batch.add(other)
    assert batch.add(cache) == 1
    assert cache.resize(capacity=3)  # token 2 is new again: written, flushed, read back
    start_step(batch)
    write_tokens(manager, batch, cache, [2])
    batch.flush()
    assert cache.resize(history=3)
    assert torch.equal(host_tokens(manager, cache, range(3)), token_bytes(cache.request_id, range(3)))
    assert cache.resize(capacity=4)
    batch.publish()
    cache.close()  # the abort path: discards token 3
    assert batch.row_of(other) == 0 and cache.closed


def test_history_over_recycled_pages_needs_a_declaration(device):
    """Issue sequence 4: a closed request's pages are recycled; a fresh cache may not make them
    history before it declares them written, so it can never read another request's KV."""
    manager, batch = make(device)
    first = manager.create_cache()
    batch.add(first)
    prefill(manager, batch, first, 12)
    pages = first.pages(0)
    first.close()
    fresh = manager.create_cache()
    with pytest.raises(ValueError, match=r"SAFE-2: history \(10\) cannot pass .* \(0\)"):
        fresh.resize(capacity=12, history=10)
    assert state(fresh) == (0, 0, 0, [])
    assert fresh.resize(capacity=12) and fresh.pages(0) == pages  # the same slots, recycled
    with pytest.raises(ValueError, match="SAFE-2"):
        fresh.resize(history=10)
    # a prefill that writes the pages through the public API, then declares them
    settle(manager)  # the recycled pages: no kernel of the previous owner still reads them
    view = manager.buffer_view("x", "kv", device_side=False)
    index = torch.as_tensor(fresh.host_pages("x", "kv"))
    t = torch.arange(10)
    view[index[t // P], 0, t % P] = token_bytes(fresh.request_id, t)
    fresh.record_host_write(10)
    assert fresh.resize(history=10)
    assert torch.equal(host_tokens(manager, fresh, range(10)), token_bytes(fresh.request_id, range(10)))


def test_declarations_are_checked(device):
    manager, batch = make(device)
    cache = manager.create_cache()
    assert cache.resize(capacity=10)  # in-flight start 8
    with pytest.raises(ValueError, match=r"end \(9\) is past the host-direct range, which ends at 8"):
        cache.record_host_write(9)
    with pytest.raises(TypeError):
        cache.record_host_write(2.0)
    assert cache.written == 0
    cache.record_host_write(8)
    assert cache.written == 8 and cache.host_direct_end == 8
    other = manager.create_cache()
    assert other.resize(capacity=6)  # host-direct range ends at 4
    batch.add(cache)
    batch.add(other)
    batch.publish()
    with pytest.raises(ValueError, match=r"row 1's end \(5\) is past its host-direct range"):
        batch.record_host_writes([3, 5])
    assert (cache.written, other.written) == (8, 0)  # nothing declared
    batch.record_host_writes()
    assert other.written == 4


def test_host_pages_of_a_suspended_request_are_reachable(device):
    manager, batch = make(device)
    cache = manager.create_cache()
    batch.add(cache)
    prefill(manager, batch, cache, 6)
    batch.publish()
    cache.suspend()
    batch.publish()
    assert batch.page_tables[0][0].tolist() == [BAD] * 16
    pages = cache.host_pages("x", "kv")
    assert pages.dtype == np.int64 and len(pages) == 2
    assert torch.equal(host_tokens(manager, cache, range(6)), token_bytes(cache.request_id, range(6)))


def test_clear_errors_for_bad_host_side_input(device):
    manager, batch = make(device)
    cache = manager.create_cache()
    batch.add(cache)
    assert cache.resize(capacity=2)
    batch.publish()
    with pytest.raises(KeyError, match="unknown selection group or layer 'nope'"):
        batch.resolve("nope", torch.full((2, 4), -1, dtype=torch.int32, device=device))
    with pytest.raises(KeyError, match="unknown selection group or layer 3"):
        batch.hit_miss(3)
    with pytest.raises(TypeError, match=r"new_history must be None \(every in-flight token\), a "
                                        r"sequence of 2 ints"):
        batch.flush(5)
    with pytest.raises(ValueError, match=r"new_history values must be in \[0, 2\*\*31 - 1\], got 2147483648"):
        batch.flush([2 ** 31, 0])
    with pytest.raises(ValueError, match="new_history must have 2 values"):
        batch.flush([1])
    with pytest.raises(ValueError, match="new_history is on the meta device"):
        batch.flush(torch.zeros(2, dtype=torch.int32, device="meta"))
    with pytest.raises(TypeError, match="new_history must be int32"):
        batch.flush(torch.zeros(2, dtype=torch.int64))
    assert cache.written == 0  # nothing was flushed


@pytest.mark.parametrize("device", ["cpu"])
def test_growing_past_imported_history_is_not_refused_as_lost_cell_tokens(device):
    """SAFE-1's "lost" rule protects the tokens the cells may hold: the published in-flight range
    (its start computed from the published lengths), cut at the lowest capacity since. DESIGN's
    importing-history recipe (capacity 35, tokens [0, 32) written to host pages and declared,
    history 32, capacity 32) then grows to 33: tokens [30, 32) are history on host pages, never
    in the published in-flight range [33, 35), and the growth is accepted; the bytes hold."""
    manager, batch = make(device)
    cache = manager.create_cache()
    batch.add(cache)
    assert cache.resize(capacity=35)
    batch.publish()  # the cells may hold the in-flight range [33, 35) of (0, 35)
    write_tokens(manager, batch, cache, range(32))  # [0, 32) is host-direct: below s0 = 33
    cache.record_host_write(32)
    assert cache.resize(history=32)
    assert cache.resize(capacity=32)
    assert cache.resize(capacity=33)  # refused as "SAFE-1 ... tokens [30, 32)" before the fix
    assert (cache.history_length, cache.capacity, cache.written) == (32, 33, 32)
    view = manager.buffer_view("x", "kv")
    index = torch.as_tensor(cache.host_pages("x", "kv"))
    for t in range(32):
        got = view[int(index[t // P]), 0, t % P]
        assert torch.equal(got.cpu(), token_bytes(cache.request_id, [t])[0])


@pytest.mark.parametrize("device", ["cpu"])
def test_finish_step_with_host_writes_ends_a_prefill_chunk(device):
    """ENG-4: after a prefill chunk wrote [0, s0) straight to host pages and [s0, c) into cells,
    finish_step(accepted, host_writes=True) declares the host-direct part, publishes it,
    flushes the accepted in-flight tokens and advances history over the whole chunk, so every
    byte of [0, c) is on host pages; a row that accepts nothing keeps its lengths."""
    manager, batch = make(device)
    cache, idle = manager.create_cache(), manager.create_cache()
    batch.add(cache)
    batch.add(idle)
    assert cache.resize(capacity=10)  # s0 = 8: [0, 8) host-direct, [8, 10) in flight
    assert idle.resize(capacity=1)
    start_step(batch)
    write_tokens(manager, batch, cache, range(10))
    accepted = torch.tensor([10, 0], dtype=torch.int32, device=device)
    batch.finish_step(accepted, host_writes=True)
    batch.poll()  # the step's read-back
    assert (cache.history_length, cache.written) == (10, 10)
    assert cache.capacity == 12  # history + width 10, cut at its pages (3 pages of 4)
    assert (idle.history_length, idle.capacity) == (0, 1)
    assert batch.advance_counters.tolist() == [0, 1]  # the cut row is counted as short
    view = manager.buffer_view("x", "kv")
    index = torch.as_tensor(cache.host_pages("x", "kv"))
    for t in range(10):
        assert torch.equal(view[int(index[t // P]), 0, t % P].cpu(),
                           token_bytes(cache.request_id, [t])[0])
