"""Batch (BAT-1..4): membership, leases, published tables, per-step entry-point checks."""
import pytest
import torch

import torch_kvcm2 as kv
from torch_kvcm2 import BAD
from configs import dsa_config, import_history
from inspect_state import replayed_advance


@pytest.fixture
def manager():
    return kv.KVCacheManager(dsa_config())


def cache_with(manager, capacity, history=None):
    return import_history(manager.create_cache(), capacity if history is None else history, capacity)


def membership(batch):
    table = batch._table
    return ({r: c.request_id for r, c in batch.members().items()}, list(table.leases),
            sorted(table.free_leases), table.state.tolist(), table.unpublished)


def test_add_seats_at_the_lowest_free_row_and_holes_are_reused(manager):
    """BAT-2."""
    batch = kv.Batch(manager)
    a, b, c = (cache_with(manager, 4) for _ in range(3))
    assert [batch.add(a), batch.add(b), batch.add(c, row=3)] == [0, 1, 3]
    batch.remove(b)
    assert batch.row_of(b) is None
    assert batch.add(b) == 1
    assert batch.row_of(c) == 3
    d = cache_with(manager, 4)
    assert batch.add(d) == 2
    with pytest.raises(RuntimeError, match="occupied"):
        batch.add(cache_with(manager, 4))


def test_bad_membership_calls_raise_and_change_nothing(manager):
    """BAT-2: double add, foreign cache, closed cache, occupied row, move to an occupied row."""
    batch = kv.Batch(manager)
    a, b = cache_with(manager, 4), cache_with(manager, 4)
    batch.add(a)
    batch.add(b)
    batch.publish()
    foreign = kv.KVCacheManager(dsa_config()).create_cache()
    closed = cache_with(manager, 4)
    closed.close()
    stranger = cache_with(manager, 4)
    before = membership(batch)
    cases = [
        (ValueError, lambda: batch.add(a)),
        (ValueError, lambda: batch.add(foreign)),
        (RuntimeError, lambda: batch.add(closed)),
        (ValueError, lambda: batch.add(stranger, row=1)),
        (ValueError, lambda: batch.add(stranger, row=4)),
        (ValueError, lambda: batch.move(a, 1)),
        (ValueError, lambda: batch.move(stranger, 2)),
        (ValueError, lambda: batch.remove(stranger)),
    ]
    for exc, call in cases:
        with pytest.raises(exc):
            call()
        assert membership(batch) == before


def test_a_cache_can_be_seated_in_one_batch_only(manager):
    batch = kv.Batch(manager, max_rows=2)
    second = kv.Batch(manager, max_rows=2)
    cache = cache_with(manager, 4)
    batch.add(cache)
    with pytest.raises(ValueError, match="another batch"):
        second.add(cache)


def test_batches_draw_from_the_reserve_and_return_it_on_close(manager):
    batch = kv.Batch(manager, max_rows=3)
    with pytest.raises(RuntimeError, match="batch reserve"):
        kv.Batch(manager, max_rows=2)
    kv.Batch(manager, max_rows=1)
    batch.close()
    kv.Batch(manager, max_rows=3)
    with pytest.raises(ValueError):
        kv.Batch(manager, max_rows=5)


def test_a_closed_batch_is_freed_before_the_next_one_allocates(manager):
    """A batch and its parts refer to each other, so dropping a closed batch frees its tensors
    only when Python's cycle collector runs; the next Batch() collects first, so the two never
    hold their memory at once (with GPU history pages that is gigabytes). The collector is off
    here: only Batch() can free the first one."""
    import gc
    import weakref

    first = kv.Batch(manager)
    cells = weakref.ref(first.groups[0].resident)  # one of its device tensors
    first.close()
    del first
    enabled = gc.isenabled()
    gc.disable()
    try:
        assert cells() is not None  # still held by the cycle
        second = kv.Batch(manager)
        assert cells() is None, "the closed batch's tensors outlived the next Batch()"
        second.close()
    finally:
        if enabled:
            gc.enable()


def test_a_closed_batch_still_held_costs_one_collection_only(manager, monkeypatch):
    """A closed batch the caller keeps cannot be freed: the Batch() after its close collects
    once, the ones after that not again (a full collection costs milliseconds)."""
    import gc

    calls = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(1) or real(*a))
    held = kv.Batch(manager, max_rows=1)
    held.close()
    first = kv.Batch(manager, max_rows=1)
    assert len(calls) == 1
    second = kv.Batch(manager, max_rows=1)
    assert len(calls) == 1, "a held closed batch made every Batch() collect"
    first.close()
    second.close()
    kv.Batch(manager, max_rows=1).close()  # the two just closed: one collection
    assert len(calls) == 2 and held is not None


def test_a_batch_whose_construction_fails_gives_its_reserve_back(manager, monkeypatch):
    """A Batch() that raises part-way (e.g. out of memory for its tables) holds nothing of the
    batch reserve afterwards: the next Batch() of the same size still fits."""
    import torch_kvcm2.batch as batch_module

    def fail(*args, **kwargs):
        raise MemoryError("no memory for the host mirror")

    with monkeypatch.context() as patch:
        patch.setattr(batch_module, "TableMirror", fail)
        with pytest.raises(MemoryError):
            kv.Batch(manager)
    assert manager.stats()["gpu"]["batch_bytes_in_use"] == 0
    kv.Batch(manager).close()


def test_publish_uploads_rows_holes_publish_bad_and_addresses_are_fixed(manager):
    """BAT-1, BAT-3."""
    batch = kv.Batch(manager)
    pointers = [t.data_ptr() for t in (*batch.page_tables, batch.history, batch.capacity, batch.lease)]
    a, b = cache_with(manager, 9, 7), cache_with(manager, 5)
    batch.add(a)
    batch.add(b, row=2)
    assert not batch.published
    batch.publish()
    assert batch.published
    for g in range(3):
        table = batch.page_tables[g].tolist()
        assert table[0][:3] == a.pages(g) and table[0][3:] == [BAD] * 13
        assert table[2][:2] == b.pages(g)
        assert table[1] == [BAD] * 16 and table[3] == [BAD] * 16
    assert batch.history.tolist() == [7, 0, 5, 0]
    assert batch.capacity.tolist() == [9, 0, 5, 0]
    assert batch.lease.tolist() == [0, BAD, 1, BAD]
    b.suspend()  # suspended members publish BAD / 0
    batch.move(a, 3)
    batch.publish()
    assert batch.lease.tolist() == [BAD, BAD, BAD, 0]
    assert batch.history.tolist() == [0, 0, 0, 7]
    assert batch.page_tables[0][2].tolist() == [BAD] * 16
    assert batch.page_tables[0][3, :3].tolist() == a.pages(0)
    b.resume()
    batch.publish()
    assert batch.lease.tolist() == [BAD, BAD, 1, 0]
    assert pointers == [t.data_ptr() for t in (*batch.page_tables, batch.history, batch.capacity, batch.lease)]


def test_publish_uploads_only_the_rows_that_changed(manager):
    """BAT-3: an unchanged row is not rewritten."""
    batch = kv.Batch(manager)
    a, b = cache_with(manager, 4), cache_with(manager, 4)
    batch.add(a)
    batch.add(b)
    batch.publish()
    batch.history[0] = 99  # a marker only a re-upload of row 0 would erase
    assert b.resize(capacity=8)
    batch.publish()
    assert batch.history.tolist()[:2] == [99, 4]
    assert batch.capacity.tolist()[:2] == [4, 8]


def test_a_reused_lease_starts_empty(manager):
    """BAT-3: a lease that changed owner has its residency cleared in the same publish."""
    batch = kv.Batch(manager)
    a = cache_with(manager, 8)
    batch.add(a)
    batch.publish()
    group = batch.group("shared0")
    selected = torch.full((4, 4), -1, dtype=torch.int32)
    selected[0, :3] = torch.tensor([5, 1, 6])
    batch.resolve(0, selected)
    assert sorted(batch.inspect(0, 0)["resident"]) == [1, 5, 6]
    batch.remove(a)
    b = cache_with(manager, 8)
    assert batch.add(b) == 0
    batch.publish()
    assert batch.lease.tolist()[0] == 0
    assert batch.inspect(0, 0)["resident"] == []
    assert group.resident[0].tolist() == [BAD] * 12
    assert group.recency[0].tolist() == list(range(12))


def test_per_step_calls_need_a_published_batch(manager):
    """BAT-4."""
    batch = kv.Batch(manager)
    selected = torch.full((4, 4), -1, dtype=torch.int32)
    batch.resolve("shared0", selected)  # a fresh batch is published (empty)
    batch.add(cache_with(manager, 4))
    for call in (lambda: batch.resolve("shared0", selected), lambda: batch.fetch("shared1"),
                 lambda: batch.resolve("private", selected, fetch=True)):
        with pytest.raises(RuntimeError, match="unpublished"):
            call()
    batch.publish()
    batch.resolve("shared0", selected)


def test_per_step_calls_validate_their_arguments(manager):
    """SAFE-3: wrong dtype, shape, device, unknown layer or group raise before any work."""
    batch = kv.Batch(manager)
    good = torch.full((4, 4), -1, dtype=torch.int32)
    cases = [
        (TypeError, lambda: batch.resolve(0, good.long())),
        (ValueError, lambda: batch.resolve(0, good[:, :3].contiguous())),
        (ValueError, lambda: batch.resolve(0, good.t())),
        (ValueError, lambda: batch.resolve(0, good, out=torch.empty(3, 4, dtype=torch.int32))),
        (KeyError, lambda: batch.resolve(7, good)),
        (KeyError, lambda: batch.resolve("nope", good)),
        (KeyError, lambda: batch.resolve("swa", good)),
        (KeyError, lambda: batch.fetch("nope")),
        (KeyError, lambda: batch.fetch("swa")),
        (KeyError, lambda: batch.fetch("shared0", "nope")),
        (TypeError, lambda: batch.fetch()),
        (ValueError, lambda: batch.fetch("shared0", "private")),  # two selection groups
        (ValueError, lambda: batch.fetch("shared0", "shared1", "shared0")),
        (TypeError, lambda: batch.resolve(0, [[0]])),
    ]
    counters = batch.hit_miss(0).clone()
    for exc, call in cases:
        with pytest.raises(exc):
            call()
    assert torch.equal(batch.hit_miss(0), counters)


def fill_host_tokens(manager, cache, layer, value):
    """Every token t of ``cache``'s pages of ``layer``'s latent gets bytes value(t)."""
    host = manager.buffer_view(layer, "kv", device_side=False)
    info = manager.buffer(layer, "kv")
    P = manager.config.tokens_per_page
    for ordinal, slot in enumerate(cache.pages(info.pool_group)):
        for t in range(P):
            host[slot * info.scale + info.pos, 0, t] = value(ordinal * P + t)


def shared_layers_batch(layers):
    """A fresh batch seating one 12-token request whose host tokens t of ``layers[i]`` hold
    50*i + t, and a selection of units 9, 1, 4, 11 for its row."""
    mgr = kv.KVCacheManager(dsa_config())
    batch = kv.Batch(mgr)
    cache = cache_with(mgr, 12)
    batch.add(cache)
    batch.publish()
    for i, layer in enumerate(layers):
        fill_host_tokens(mgr, cache, layer, lambda t, i=i: 50 * i + t)
    selected = torch.full((4, 4), -1, dtype=torch.int32)
    selected[0] = torch.tensor([9, 1, 4, 11])
    return batch, selected


def test_fetch_of_several_layers_in_one_call_equals_fetch_per_layer(manager):
    """OP-FETCH: Batch.fetch(a, b, ...) of layers of one group fills each layer's cells exactly
    as one fetch per layer does (one launch serves several layers' buffers)."""
    layers = ["shared0", "shared1", "shared2"]
    batches = []
    for together in (False, True):
        batch, selected = shared_layers_batch(layers)
        batch.resolve("idx", selected)
        if together:
            batch.fetch(*layers)
        else:
            for layer in layers:
                batch.fetch(layer)
        batches.append(batch)
    for i, layer in enumerate(layers):
        per_layer, together = (b.cells(layer, "kv") for b in batches)
        assert torch.equal(per_layer, together), layer
        table = batches[1].group("idx").index_table
        for j, unit in enumerate((9, 1, 4, 11)):
            entry = int(table[0, j])
            assert bool((together[entry // 4, 0, entry % 4] == 50 * i + unit).all()), (layer, unit)


def test_resolve_with_fetch_equals_resolve_then_fetch(manager):
    """OP-STEP: resolve(group, selected, fetch=True) leaves the cells, index table, residency
    and write indices of resolve followed by fetch(*layers) of every layer of the group;
    anything but a bool (layer names included: a split fetch is ``fetch``) is refused before
    anything runs."""
    layers = ["shared0", "shared1", "shared2"]
    results = []
    for how in ("separate", True):
        batch, selected = shared_layers_batch(layers)
        if how == "separate":
            index = batch.resolve("idx", selected)
            batch.fetch(*layers)
        else:
            index = batch.resolve("idx", selected, fetch=how)
        state = batch.group("idx")
        results.append((index.clone(), state.resident.clone(), state.write_table.clone(),
                        state.inflight_start.clone(),
                        [batch.cells(layer, "kv").clone() for layer in layers]))
        if how is True:
            before = [t.clone() for t in (state.resident, state.recency, state.counters)]
            for bad in (tuple(layers), "shared1", ("private",), None, 1, (), "nosuchlayer"):
                with pytest.raises(TypeError, match="fetch must be True .* or False"):
                    batch.resolve("idx", selected, fetch=bad)
            after = (state.resident, state.recency, state.counters)
            assert all(torch.equal(a, b) for a, b in zip(before, after)), "a refused call ran"
    want, got = results
    assert all(torch.equal(a, b) for a, b in zip(got[:4], want[:4]))
    assert all(torch.equal(a, b) for a, b in zip(got[4], want[4]))


def test_write_indices_are_resolves_eager_and_compiled_and_refuse_when_stale(manager):
    """OP-WRITE: write_indices(group) returns the tables this step's resolve computed (no
    launch), eager as compiled; after a publish or advance with no resolve since, eagerly it
    refuses (naming resolve) rather than return stale tables, and write_indices(group, out)
    computes them now (after the next resolve, the same as resolve's)."""
    batch = kv.Batch(manager)
    cache = cache_with(manager, 12, history=11)
    batch.add(cache)
    batch.publish()
    none = torch.full((4, 4), -1, dtype=torch.int32)
    batch.resolve("idx", none)
    table, start = batch.write_indices("idx")
    assert int(start[0]) == 11 and int(table[0, 0]) >= 0  # token 11 is in flight
    assert batch.write_indices("idx")[0] is table  # the batch's own tensor: no launch
    other = cache_with(manager, 40, history=20)  # seated after the resolve
    batch.add(other)
    batch.publish()

    def fresh():
        out = torch.full_like(table, 7)
        got = batch.write_indices("idx", out)
        return out.clone(), got[1].clone()

    with pytest.raises(RuntimeError, match="resolve it first"):
        batch.write_indices("idx")
    assert int(fresh()[1][1]) >= 20  # the new row's in-flight start, not BAD
    batch.resolve("idx", none)  # admits the new row's in-flight units
    got_table, got_start = (t.clone() for t in batch.write_indices("idx"))
    want_table, want_start = fresh()
    assert int(got_table[1, 0]) >= 0
    assert torch.equal(got_start, want_start) and torch.equal(got_table, want_table)
    batch.poll()  # a read-back of lengths that did not move: resolve's tables stay current
    assert torch.equal(batch.write_indices("idx")[0], want_table)
    batch.advance(torch.zeros(4, dtype=torch.int32))  # accepted nothing: the same lengths
    with pytest.raises(RuntimeError, match="resolve it first"):
        batch.write_indices("idx")
    assert all(torch.equal(a, b) for a, b in zip(fresh(), (want_table, want_start)))
    batch.poll()
    batch.resolve("idx", none)
    batch.flush()
    replayed_advance(batch, torch.ones(4, dtype=torch.int32))  # not announced to the host
    batch.poll()  # its read-back moved the lengths: the tables are dated
    with pytest.raises(RuntimeError, match="resolve it first"):
        batch.write_indices("idx")


def test_fused_fetch_of_a_layer_alone_in_its_group(manager):
    """OP-FETCH-FUSED: resolve(layer's group, selected, fetch=True) for a layer alone in its
    selection group fills its cells with the selected units' host bytes and counts the misses."""
    batch = kv.Batch(manager)
    cache = cache_with(manager, 8)
    batch.add(cache)
    batch.publish()
    fill_host_tokens(manager, cache, "private", lambda t: 10 * (t // 4) + t % 4)
    selected = torch.full((4, 4), -1, dtype=torch.int32)
    selected[0, :2] = torch.tensor([6, 2])
    index = batch.resolve("private", selected, fetch=True)
    cells = batch.cells("private", "kv")
    for j, unit in enumerate((6, 2)):
        entry = int(index[0, j])
        assert entry >= 0
        token = cells[entry // 4, 0, entry % 4]
        assert bool((token == 10 * (unit // 4) + unit % 4).all())
    assert batch.hit_rate("private") == {"hits": 0, "misses": 2, "invalid": 0, "hit_rate": 0.0}
    assert torch.equal(batch.hit_miss("private"), torch.tensor([0, 2, 0]))
    with pytest.raises(KeyError):
        batch.cells("private", "scale")  # zero-size: no cells


def test_inspect_reports_recency_order_and_pinned_units(manager):
    """OP-INSPECT."""
    batch = kv.Batch(manager)
    cache = cache_with(manager, 10, 8)  # tokens 8, 9 in flight (I = 2, U = 1)
    batch.add(cache)
    batch.publish()
    selected = torch.full((4, 4), -1, dtype=torch.int32)
    selected[0, :2] = torch.tensor([3, 1])
    batch.resolve(0, selected)
    info = batch.inspect(0, 0)
    assert info["lease"] == 0
    assert info["resident"] == [3, 1, 8, 9]  # misses, then pinned
    assert info["pinned"] == [8, 9]
    assert batch.inspect(0, 1) == {"lease": None, "resident": [], "pinned": []}


@pytest.mark.cuda
def test_host_side_calls_refuse_to_run_during_stream_capture():
    """BAT-4, SAFE-3: publish, membership changes and resize raise while the stream captures."""
    manager = kv.KVCacheManager(dsa_config("cuda"))
    batch = kv.Batch(manager)
    cache = cache_with(manager, 8)
    stranger = cache_with(manager, 4)
    batch.add(cache)
    batch.publish()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    calls = [batch.publish, lambda: batch.add(stranger), lambda: batch.remove(cache),
             lambda: batch.move(cache, 2), lambda: cache.resize(capacity=9), cache.suspend,
             cache.close, lambda: kv.Batch(manager, max_rows=1)]
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            for call in calls:
                with pytest.raises(RuntimeError, match="during CUDA stream capture"):
                    call()
        finally:
            graph.capture_end()
    assert batch.row_of(cache) == 0 and cache.capacity == 8 and not cache.closed
    assert batch.published


def write_step(driver, resolve):
    """Publish, then per selection group ``resolve(spec, selected)`` and each layer's new tokens
    written into the cells at the group's write indices."""
    from stepping import write_tokens
    batch = driver.batch
    batch.publish()
    selected, tokens = driver.inputs()
    for spec, sel in zip(batch.config.selection_groups, selected):
        resolve(spec, sel)
        table, _ = batch.write_indices(spec.index)
        for layer in spec.layers:
            write_tokens(batch.cells(layer, "kv"), table[:, 0], tokens[layer])


def test_eager_calls_of_the_bound_shapes_equal_the_checked_calls(device):
    """OP-STEP: an eager call whose tensor has the bound shape (resolve's [max_rows, K]
    selection with fetch True or False, flush's int32[max_rows] targets) skips the batch's
    Python checks and passes the bound argument lists to the op; it leaves every state tensor
    that the checked call leaves (here: the group by name with a [max_rows, 1, K] selection,
    and targets as a sequence), over steps with misses and membership changes."""
    from stepping import ROWS, Driver, assert_same_state
    bound, checked = Driver(device, seed=3), Driver(device, seed=3)
    for number in range(12):
        for driver in (bound, checked):
            batch = driver.batch

            def resolve(spec, sel):
                fetch = spec.index % 2 == 0 or number % 3 == 0
                if driver is bound:
                    batch.resolve(spec.index, sel, fetch=fetch)
                else:
                    batch.resolve(spec.name, sel[:, None], fetch=fetch)
                if not fetch:
                    batch.fetch(*spec.layers)

            write_step(driver, resolve)
            targets = batch.capacity.clone()
            if number % 4 == 1:
                batch.flush()
            else:
                batch.flush(targets if driver is bound else targets.tolist())
            accepted = torch.zeros(ROWS, dtype=torch.int32, device=device)
            accepted[number % ROWS] = -1  # refused if seated: counted, lengths unchanged
            batch.advance(accepted)
        assert_same_state(bound.batch, checked.batch)
        assert torch.equal(bound.batch.advance_counters, checked.batch.advance_counters)
        for driver in (bound, checked):
            driver.advance()
            if number in (3, 8):
                driver.leave()
                driver.join()
    assert [c.history_length for c in bound.caches] == [c.history_length for c in checked.caches]
    assert [c.written for c in bound.caches] == [c.written for c in checked.caches]
    assert sum(int(s.counters[1]) for s in bound.batch.groups) > 0, "no step missed a unit"
    assert int(bound.batch.advance_counters[0]) > 0, "no advance refused a row"


def test_finish_step_is_flush_to_the_accepted_tokens_then_advance(device):
    """ENG-4: finish_step(accepted) leaves every state tensor, length and watermark that
    flush(history + accepted) followed by advance(accepted) leaves, with rows accepting 0 or 1
    tokens and one refused (-1), over steps with membership changes; a bad ``accepted`` is
    refused naming it, before anything runs."""
    from stepping import ROWS, Driver, assert_same_state
    one, split = Driver(device, seed=5), Driver(device, seed=5)
    for number in range(10):
        for driver in (one, split):
            batch = driver.batch
            write_step(driver, lambda spec, sel: batch.resolve(spec.index, sel, fetch=True))
            accepted = torch.tensor([(row + number) % 2 for row in range(ROWS)],
                                    dtype=torch.int32, device=device)
            accepted[number % ROWS] = -1
            if driver is one:
                batch.finish_step(accepted)
            else:
                batch.flush(batch.history + accepted)
                batch.advance(accepted)
        one.batch.poll()
        split.batch.poll()
        split.batch._step.step_targets.copy_(one.batch._step.step_targets)  # finish_step's own
        assert_same_state(one.batch, split.batch)
        assert [(c.history_length, c.capacity, c.written) for c in one.caches] == \
            [(c.history_length, c.capacity, c.written) for c in split.caches]
        for driver in (one, split):
            if number in (3, 7):
                driver.leave()
                driver.join()
    assert int(one.batch.advance_counters[0]) > 0, "no row was refused"
    assert sum(c.history_length for c in one.caches) > 0
    with pytest.raises(TypeError, match="accepted must be int32"):
        one.batch.finish_step(torch.zeros(ROWS, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=r"accepted must have shape \(4,\)"):
        one.batch.finish_step(torch.zeros(ROWS + 1, dtype=torch.int32, device=device))


def test_a_discarding_remove_takes_no_page_even_with_a_new_reserve(manager):
    """REQ-4 / the abort path: remove(discard=True) shrinks capacity back to history without
    allocating, so a reserve set since the last resize (which a resize would take) cannot make
    it fail when the pools are empty; nothing in flight is left behind."""
    from inspect_state import take_slots
    batch = kv.Batch(manager)
    cache = cache_with(manager, 6, history=4)
    batch.add(cache)
    batch.publish()
    cache.set_reserve(40)  # takes effect at the next resize
    for g in range(manager.pool_groups):
        take_slots(manager, g, manager.stats()["pool_groups"][g]["free_slots"])
    failed = manager.metrics()["allocations_failed"]
    batch.remove(cache, discard=True)
    assert (cache.history_length, cache.capacity) == (4, 4)
    assert manager.metrics()["aborts"] == 1 and manager.metrics()["allocations_failed"] == failed
