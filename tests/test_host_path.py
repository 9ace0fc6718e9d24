"""The host path (HOST-1..4): the delta publish against a full restage, the batched resize, and
the device-side length advance against the eager host path.
"""
import random

import numpy as np
import pytest
import torch

import torch_kvcm2 as kv
from torch_kvcm2 import BAD
from torch_kvcm2.memory import ALLOCATED, LENGTH_ROWS
from configs import dsa_config


def full_restage(batch) -> tuple:
    """What the device tables must hold, built from scratch from the members (BAT-3)."""
    R, P = batch.max_rows, batch.config.max_pages_per_row
    G = len(batch.page_tables)
    pages = np.full((G, R, P), BAD, dtype=np.int32)
    lengths = np.zeros((3, R), dtype=np.int32)
    lengths[2] = BAD
    for row, cache in batch.members().items():
        lease = batch.lease_of(row)
        if lease is None:
            continue
        for g in range(G):
            row_pages = cache.pages(g)
            pages[g, row, :len(row_pages)] = row_pages
        lengths[:, row] = (cache.history_length, cache.capacity, lease)
    return pages, lengths


def assert_tables_match(batch):
    pages, lengths = full_restage(batch)
    device_pages = np.stack([t.cpu().numpy() for t in batch.page_tables])
    assert np.array_equal(device_pages, pages)
    device_lengths = np.stack([t.cpu().numpy() for t in (batch.history, batch.capacity, batch.lease)])
    assert np.array_equal(device_lengths, lengths)
    mirror = batch.host_tables()
    assert np.array_equal(mirror["page_tables"], pages)
    assert np.array_equal(mirror["lengths"][:3], lengths)
    store = np.concatenate([t.cpu().numpy().ravel() for t in batch.page_tables] +
                           [batch.history.cpu().numpy(), batch.capacity.cpu().numpy(),
                            batch.lease.cpu().numpy(), batch.written.cpu().numpy()])
    host = np.concatenate([mirror["page_tables"].ravel(), mirror["lengths"][:4].ravel()])
    assert np.array_equal(store, host)  # the host mirror is what the device holds


def lengths_snapshot(cache):
    groups = cache.manager.pool_groups
    return (cache.capacity, cache.history_length, cache.written, [cache.pages(g) for g in range(groups)])


@pytest.mark.parametrize("seed", range(4))
def test_delta_publish_equals_a_full_restage(device, seed):
    """HOST-1: random membership, resize (growth, shrink, windows), suspend and resume; after
    every publish the device tables are bit-identical to a full restage, and a refused resize
    changes nothing."""
    rng = random.Random(seed)
    manager = kv.KVCacheManager(dsa_config(device, max_rows=4, max_tokens_per_row=96,
                                           host_budget_bytes=4 << 20, gpu_budget_bytes=4 << 20))
    batch = kv.Batch(manager)
    caches = []
    for step in range(300):
        roll = rng.random()
        members = batch.members()
        if roll < 0.15 and len(members) < 4:
            cache = manager.create_cache()
            caches.append(cache)
            free = [r for r in range(4) if r not in members]
            batch.add(cache, row=rng.choice(free))
        elif roll < 0.22 and members:
            cache = rng.choice(list(members.values()))
            cache.close()
            caches.remove(cache)
        elif roll < 0.30 and members and len(members) < 4:
            cache = rng.choice(list(members.values()))
            batch.move(cache, rng.choice([r for r in range(4) if r not in members]))
        elif roll < 0.36 and members:
            cache = rng.choice(list(members.values()))
            if cache.suspended:
                cache.resume()
            elif cache.history_length == cache.capacity:
                cache.suspend()
        for cache in list(batch.members().values()):
            if cache.suspended or rng.random() < 0.3:
                continue
            h, c = cache.history_length, cache.capacity
            capacity = max(0, min(96, c + rng.randint(-6, 12)))
            before = lengths_snapshot(cache)
            try:
                if not cache.resize(capacity=capacity):
                    assert lengths_snapshot(cache) == before
                    continue
            except ValueError:
                assert lengths_snapshot(cache) == before
                continue
            cache.record_host_write(min(cache.written + rng.randint(0, 8),
                                        _host_direct_end(cache)))
            history = min(cache.capacity, max(cache.history_length, cache.written))
            assert cache.resize(history=history)
        if rng.random() < 0.8:
            batch.publish()
            assert_tables_match(batch)


def _host_direct_end(cache):
    groups = cache.manager.config.selection_groups
    return max(g.sparse.inflight_start(cache.history_length, cache.capacity) for g in groups)


def test_a_decode_step_publishes_only_what_changed():
    """HOST-1: one token per row per step: the delta is the rows' lengths, plus one page entry
    per pool group when a row crosses a page."""
    manager = kv.KVCacheManager(dsa_config(window_layer=False))
    batch = kv.Batch(manager)
    caches = [manager.create_cache() for _ in range(4)]
    for cache in caches:
        batch.add(cache)
        assert cache.resize(capacity=1)
    batch.publish()
    sizes = []
    original = batch._table.mirror._upload
    batch._table.mirror._upload = lambda index, value, leases, clear: (
        sizes.append(len(index)), original(index, value, leases, clear))[1]
    for step in range(8):
        batch.flush()
        for cache in caches:
            assert cache.resize(history=cache.capacity, capacity=cache.capacity + 1)
        batch.publish()
        assert_tables_match(batch)
    groups = manager.pool_groups
    crossing = [4 * groups if (step + 2) % 4 == 1 else 0 for step in range(8)]  # P = 4
    assert sizes == [4 * LENGTH_ROWS + extra for extra in crossing]


def test_a_publish_whose_upload_fails_is_redone_whole_by_the_next():
    """BAT-3: an upload that raises (a CUDA error, say) leaves nothing marked as published: the
    next publish sends the whole delta again and the tables match a full restage."""
    manager = kv.KVCacheManager(dsa_config())
    batch = kv.Batch(manager)
    caches = [manager.create_cache() for _ in range(3)]
    for cache in caches:
        batch.add(cache)
        assert cache.resize(capacity=9)
    original = batch._table.mirror._upload

    def failing(*args):
        raise RuntimeError("injected: upload failed")

    batch._table.mirror._upload = failing
    with pytest.raises(RuntimeError, match="injected"):
        batch.publish()
    batch._table.mirror._upload = original
    batch.publish()
    assert_tables_match(batch)


def test_publish_does_not_wait_on_busy_staging():
    """HOST-2: a staging buffer still in use is never waited for; another one is taken."""
    manager = kv.KVCacheManager(dsa_config())
    batch = kv.Batch(manager)
    cache = manager.create_cache()
    batch.add(cache)

    class Busy:
        def query(self):
            return False

        def record(self):
            pass

    for staging in batch._table.mirror.ring:
        staging.event = Busy()
    for capacity in (1, 2, 1):
        assert cache.resize(capacity=capacity)
        batch.publish()
        assert_tables_match(batch)
    assert batch._table.mirror.extra_staging == 1  # one new buffer, reused (CPU copies finish at once)


def test_resize_rows_is_resize_per_row_all_or_nothing():
    """HOST-4: the batched call applies resize's rules per row and returns the rows refused."""
    manager = kv.KVCacheManager(dsa_config())
    batch = kv.Batch(manager)
    caches = [manager.create_cache() for _ in range(4)]
    for cache in caches:
        batch.add(cache)
    assert batch.resize_rows([0, 1, 2, 3], capacity=[4, 8, 12, 70]) == [3]  # 70 > max 64
    assert [c.capacity for c in caches] == [4, 8, 12, 0]
    for cache in caches[:3]:
        cache.record_host_write(cache.capacity - 2)
    assert batch.resize_rows([0, 1, 2], history=np.array([2, 7, 10])) == [1]  # 7 > written 6
    assert [c.history_length for c in caches] == [2, 0, 10, 0]
    assert batch.resize_rows([2], capacity=torch.tensor([12]), history=[10]) == []
    with pytest.raises(ValueError, match="not a seated row"):
        batch.resize_rows([5], capacity=[1])
    with pytest.raises(ValueError, match="capacity must have 2 values"):
        batch.resize_rows([0, 1], capacity=[1])
    with pytest.raises(ValueError, match="named twice"):
        batch.resize_rows([0, 0], capacity=[1, 1])
    batch.publish()
    assert_tables_match(batch)


@pytest.mark.parametrize("seed", range(3))
def test_resize_rows_equals_resize_per_row(seed):
    """HOST-4: random lengths (many breaking a rule) through resize_rows on one batch and
    through per-row resize on a twin: the same rows refused, the same lengths, pages and
    published tables, step after step (flushes and declarations in between)."""
    rng = random.Random(seed)
    twins = []
    for _ in range(2):
        manager = kv.KVCacheManager(dsa_config(window_layer=False, max_tokens_per_row=96,
                                               host_budget_bytes=4 << 20))
        batch = kv.Batch(manager)
        caches = [manager.create_cache() for _ in range(4)]
        for cache in caches:
            batch.add(cache)
        twins.append((batch, caches))
    for step in range(120):
        rows = rng.sample(range(4), rng.randint(1, 4))
        h0 = [twins[0][1][r].history_length for r in rows]
        c0 = [twins[0][1][r].capacity for r in rows]
        caps = [max(0, c + rng.randint(-3, 6)) for c in c0]
        hists = [max(0, min(96, h + rng.randint(-1, 4))) for h in h0]
        use_h = rng.random() < 0.5
        (a, a_caches), (b, b_caches) = twins
        failed_a = a.resize_rows(rows, capacity=caps, history=hists if use_h else None)
        failed_b = []
        for i, r in enumerate(rows):
            try:
                ok = b_caches[r].resize(caps[i], hists[i] if use_h else None)
            except ValueError:
                ok = False
            if not ok:
                failed_b.append(r)
        assert sorted(failed_a) == sorted(failed_b)
        for x, y in zip(a_caches, b_caches):
            assert lengths_snapshot(x) == lengths_snapshot(y)
        flush = rng.random() < 0.5
        for batch, caches in twins:
            batch.publish()
            if flush:
                batch.record_host_writes()
                batch.flush()
        assert_tables_match(a)
        assert [t.tolist() for t in a.page_tables] == [t.tolist() for t in b.page_tables]
        assert a.host_tables()["lengths"].tolist() == b.host_tables()["lengths"].tolist()


# ---- the device-side advance (HOST-3) ----
T = 3  # tokens proposed per row per step (speculative decoding)


def advance_setup(device, reserve_tokens):
    config = dsa_config(device, window_layer=False, max_inflight_tokens=T, slots=16,
                        max_tokens_per_row=256, host_budget_bytes=8 << 20)
    manager = kv.KVCacheManager(config)
    batch = kv.Batch(manager)
    caches = []
    for i in range(4):
        cache = manager.create_cache()
        if reserve_tokens:
            cache.set_reserve(reserve_tokens)
        batch.add(cache)
        assert cache.resize(capacity=T)
        caches.append(cache)
    batch.publish()
    return manager, batch, caches


def test_advance_equals_the_host_rule(device):
    """HOST-3: many steps of speculative decoding (0..T of the proposed tokens accepted, page
    crossings every few steps) advanced on the device equal the host rule's lengths; a row whose
    reserve runs out stops there (counted) until the host, which runs only every few steps,
    tops it up; SAFE-2 holds throughout."""
    rng = random.Random(7)
    _, batch, caches = advance_setup(device, 1)  # keep pages for one token beyond capacity
    model = [[0, T, 0] for c in caches]  # history, capacity, allocated tokens
    shorts = 0
    for step in range(60):
        batch.publish()  # re-takes the reserve of rows the device advanced, when it knows them
        for m, allocated in zip(model, batch.host_tables()["lengths"][ALLOCATED]):
            m[2] = int(allocated)
        width = (batch.capacity - batch.history).tolist()
        accepted = [min(rng.randint(0, T), w) for w in width]
        for m, a in zip(model, accepted):
            wanted = m[0] + a + (m[1] - m[0])
            m[0], m[1] = m[0] + a, min(wanted, m[2])
            shorts += m[1] < wanted
        accepted_t = torch.tensor(accepted, dtype=torch.int32, device=device)
        batch.flush(batch.history + accepted_t)
        batch.advance(accepted_t)
        if step % 4 == 3:  # the host: catch up (the step's poll), top up rows that ran short
            batch.poll()
            assert batch.advance_counters.tolist() == [0, shorts]
            assert [c.history_length for c in caches] == [m[0] for m in model]
            assert [c.capacity for c in caches] == [m[1] for m in model]
            for cache, m in zip(caches, model):
                assert cache.history_length <= cache.written  # SAFE-2
                if cache.capacity < cache.history_length + T:
                    assert cache.resize(capacity=cache.history_length + T)
                    m[1] = cache.capacity
    assert shorts > 0 and min(m[0] for m in model) > 30


def staggered_rows(device, reserve_pages, window_layer=False):
    """8 rows decoding one token per step at staggered lengths (row r starts r tokens in), each
    keeping a reserve of ``reserve_pages`` pages of 4 tokens (``window_layer``: with a windowed
    dense layer, whose pages behind the window are released as rows advance)."""
    P = 4
    config = dsa_config(device, window_layer=window_layer, max_rows=8, tokens_per_page=P,
                        max_inflight_tokens=2, slots=16, max_tokens_per_row=512,
                        host_budget_bytes=8 << 20)
    manager = kv.KVCacheManager(config)
    batch = kv.Batch(manager)
    caches = []
    for row in range(8):
        cache = manager.create_cache()
        cache.set_reserve(reserve_pages * P)
        batch.add(cache)
        assert cache.resize(capacity=row + 2)  # the last max_inflight_tokens (2) are in flight
        if row:
            cache.record_host_write(row)  # a prefill wrote its first tokens to host pages
            assert cache.resize(history=row, capacity=row + 1)
        caches.append(cache)
    batch.publish()
    return manager, batch, caches


def test_reserve_top_ups_come_in_batches_and_never_starve_a_row(device):
    """HOST-3: rows decoding one token per step at staggered lengths, each keeping a reserve of
    two pages, are topped up in batches (once a row has used half its reserve, every row that
    used any of it), so publishes with page work are rare; no row ever runs short and the
    tables match a full restage at every step."""
    P = 4
    _, batch, caches = staggered_rows(device, 2)
    ones = torch.ones(8, dtype=torch.int32, device=device)
    page_work, steps = 0, 96
    for _ in range(steps):
        before = batch.host_tables()["lengths"][ALLOCATED].copy()
        batch.publish()
        after = batch.host_tables()["lengths"][ALLOCATED]
        page_work += bool((after != before).any())
        remaining = after - batch.host_tables()["lengths"][1]
        assert (remaining >= P).all()  # at least half the reserve is left after each publish
        assert_tables_match(batch)
        batch.flush(batch.history + ones)
        batch.advance(ones)
        batch.poll()  # the step's read-back: the next publish plans pages from these lengths
    assert batch.advance_counters.tolist() == [0, 0]  # nothing refused, no row ran short
    assert [c.history_length for c in caches] == [row + steps for row in range(8)]
    # one top-up per row every P steps would be a publish with page work at nearly every step
    assert page_work <= steps // P + 2


def test_advance_refuses_bad_rows_and_never_passes_the_flush(device):
    """HOST-3 bad inputs: a negative or oversize count, or one past what was flushed, refuses
    the row (counted, unchanged); other rows advance. Wrong dtype, device or shape raises before
    anything changes."""
    _, batch, caches = advance_setup(device, 8)
    batch.flush([2, 3, 3, 1])
    before = (batch.history.clone(), batch.capacity.clone())
    bad = [torch.zeros(4, dtype=torch.int64, device=device),
           torch.zeros(5, dtype=torch.int32, device=device),
           torch.zeros((4, 1), dtype=torch.int32, device=device),
           torch.zeros(4, dtype=torch.int32, device="meta"), [1, 1, 1, 1]]
    for accepted in bad:
        with pytest.raises((TypeError, ValueError), match="accepted"):
            batch.advance(accepted)
    assert torch.equal(batch.history, before[0]) and torch.equal(batch.capacity, before[1])
    batch.advance(torch.tensor([2, -1, 4, 2], dtype=torch.int32, device=device))
    batch.poll()
    # row 0: ok; row 1: negative; row 2: oversize (width 3); row 3: past the flush (1)
    assert [c.history_length for c in caches] == [2, 0, 0, 0]
    assert [c.capacity for c in caches] == [5, 3, 3, 3]
    assert batch.advance_counters.tolist() == [3, 0]
    holes = kv.Batch(kv.KVCacheManager(dsa_config(device)))
    holes.advance(torch.full((4,), 5, dtype=torch.int32, device=device))  # no seated rows
    assert holes.history.tolist() == [0] * 4 and holes.advance_counters.tolist() == [0, 0]


def test_advance_without_sparse_layers_is_bounded_by_pages_only(device):
    """A config of dense layers only has nothing to flush (history may pass capacity's tokens at
    once, written_prefix): the device's advance moves history without any flush, through the
    row's reserve, and stops short at its pages."""
    layers = [kv.LayerSpec("d0", [kv.BufferSpec("k", 8), kv.BufferSpec("v", 8)])]
    config = kv.CacheConfig(tokens_per_page=4, layers=layers, max_rows=2, max_tokens_per_row=64,
                            gpu_budget_bytes=1 << 20, host_budget_bytes=1 << 20, device=device)
    manager = kv.KVCacheManager(config)
    batch = kv.Batch(manager)
    cache = manager.create_cache()
    cache.set_reserve(4)
    assert cache.resize(capacity=3)
    batch.add(cache)
    batch.publish()
    ones = torch.ones(2, dtype=torch.int32, device=device)
    for _ in range(5):
        batch.advance(ones)
    batch.poll()
    assert (cache.history_length, cache.capacity) == (5, 8)  # 3 + a reserve of 4: 2 pages
    assert batch.advance_counters.tolist() == [0, 0]
    batch.advance(ones)  # capacity would be 9: cut at the pages, the row counted short
    batch.poll()
    assert (cache.history_length, cache.capacity) == (6, 8)
    assert batch.advance_counters.tolist() == [0, 1]


def test_advance_compiles_fullgraph():
    """HOST-3: flush + advance trace with fullgraph=True; record_advance afterwards queues the
    read-back and poll() brings the host up to date, equal to eager."""
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        _, batch, caches = advance_setup("cpu", 8)

        def step(accepted):
            batch.flush(batch.history + accepted)
            batch.advance(accepted)

        run = torch.compile(step, fullgraph=True) if compiled else step
        for a in ([1, 2, 3, 1], [3, 3, 1, 2], [2, 1, 1, 3]):
            run(torch.tensor(a, dtype=torch.int32))
            if compiled:
                batch.record_advance()
        batch.poll()
        results.append(([c.history_length for c in caches], [c.capacity for c in caches],
                        [c.written for c in caches], batch.advance_counters.tolist()))
    assert results[0] == results[1]
    assert results[0][0] == [6, 6, 5, 6]


def capture(step):
    """``step`` captured once as a CUDA graph, on a side stream (capture does not run it)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    return graph


@pytest.mark.cuda
def test_advance_replays_in_a_cuda_graph():
    """HOST-3 on CUDA: flush + advance captured once and replayed many times (record_advance
    after each replay) equal the eager calls."""
    results = []
    for captured in (False, True):
        _, batch, caches = advance_setup("cuda", 2 * 4)
        accepted = torch.tensor([1, 2, 3, 1], dtype=torch.int32, device="cuda")

        def step():
            batch.flush(batch.history + accepted)
            batch.advance(accepted)

        if captured:
            saved = (batch.history.clone(), batch.capacity.clone(), batch.written.clone())
            graph = capture(step)
            # capture does not run the ops: the lengths are as before
            assert torch.equal(batch.history, saved[0]) and torch.equal(batch.written, saved[2])
        for _ in range(12):
            batch.poll()  # wait for the read-back, so both runs re-take reserves alike
            batch.publish()
            if captured:
                graph.replay()
                batch.record_advance()
            else:
                step()
        torch.cuda.synchronize()
        batch.poll()
        results.append(([c.history_length for c in caches], [c.capacity for c in caches],
                        [c.written for c in caches], batch.advance_counters.tolist()))
    assert results[0] == results[1]
    assert results[0][3][0] == 0


@pytest.mark.parametrize("window_layer", [False, True])
def test_a_host_ahead_of_the_gpu_catches_up_and_tops_up_without_waiting(window_layer):
    """HOST-2/HOST-3 with the host running steps ahead of the GPU (the read-back of a step
    arrives two steps later, as in an engine that schedules the next step while the GPU runs
    this one): each publish applies the newest read-back that has arrived, never waits for one
    in flight, and tops up reserves from those lengths (page entries and allocated tokens only),
    so no row runs short over many times its reserve; at the end the tables match a restage.
    With a windowed layer, its pages behind each row's window are released along the way."""
    manager, batch, caches = staggered_rows("cpu", 2, window_layer)
    ones = torch.ones(8, dtype=torch.int32)
    lag, steps, late = 2, 120, []
    for step in range(steps):
        batch.publish()
        batch.flush(batch.history + ones)
        batch.advance(ones)  # eager: queues its read-back
        late.append(_LateEvent())
        batch._readback.events[batch._readback.queue[-1]] = late[-1]  # not arrived yet
        if step >= lag:
            late[step - lag].done = True  # the GPU finished the step `lag` steps ago
        assert all(e.waited == 0 for e in late)  # no publish waited for the GPU
        applied = batch.host_tables()["lengths"][0]  # the host's history of each row
        if step > lag:
            assert (applied == np.arange(8) + step - lag).all()
    assert batch.advance_counters.tolist() == [0, 0]  # no row ran short: top-ups kept up
    assert (batch.history.numpy() == np.arange(8) + steps).all()
    for event in late:
        event.done = True
    batch.poll()
    assert [c.history_length for c in caches] == [row + steps for row in range(8)]
    assert_tables_match(batch)
    if window_layer:  # pages behind each row's window were released along the way
        windowed = [g for g in manager.stats()["pool_groups"] if g["window"] is not None]
        pages_of_history = 8 * (steps // 4)
        assert all(0 < g["used_slots"] < pages_of_history // 4 for g in windowed), windowed


def run_ahead(batch, steps, lag=2):
    """``steps`` decode steps (publish, flush, advance by one token) whose read-backs arrive
    ``lag`` steps late, as on a GPU the host runs ahead of; returns the late events."""
    ones = torch.ones(batch.max_rows, dtype=torch.int32)
    late = []
    for step in range(steps):
        capacity = batch.capacity.clone()
        batch.publish()
        # a publish never leaves the device's capacity beyond its allocated pages
        assert bool((batch.capacity <= batch._step.allocated).all()) and torch.equal(batch.capacity,
                                                                                  capacity)
        batch.flush(batch.history + ones)
        batch.advance(ones)
        late.append(_LateEvent())
        batch._readback.events[batch._readback.queue[-1]] = late[-1]
        if step >= lag:
            late[step - lag].done = True
    return late


@pytest.mark.parametrize("change", ["smaller reserve, then a declaration",
                                    "larger reserve, no resize"])
def test_a_new_reserve_while_the_host_is_ahead_never_frees_pages_in_use(change):
    """HOST-3: a reserve changed while read-backs are in flight never lets a top-up planned from
    lagging lengths free pages the device's capacity has reached (``run_ahead`` checks every
    publish): made smaller (none at all) and the row then published by a declaration, which
    applies no reserve, the row stops at its pages, counted as short, never corrupted; made
    larger without the resize that would apply it, every row keeps advancing. The tables match
    a restage at the end."""
    manager, batch, caches = staggered_rows("cpu", 2, window_layer=True)
    row0 = caches[0]
    smaller = change.startswith("smaller")
    if smaller:
        row0.set_reserve(0)
        row0.record_host_write(row0.history_length)
        batch.publish()
    else:
        row0.set_reserve(16)
    late = run_ahead(batch, 40)
    for event in late:
        event.done = True
    batch.poll()
    histories = [c.history_length for c in caches]
    assert histories[1:] == [row + 40 for row in range(1, 8)]
    if smaller:  # row 0 ran out of its pages: refused from then on, its lengths intact
        refused, short = batch.advance_counters.tolist()
        assert 0 < histories[0] < 40 and short >= 1 and refused == 40 - histories[0]
        assert row0.capacity == histories[0] and row0.history_length <= row0.written
    else:
        assert histories[0] == 40 and batch.advance_counters.tolist() == [0, 0]
    assert_tables_match(batch)


@pytest.mark.cuda
def test_graph_replays_ahead_of_the_gpu_never_run_short():
    """HOST-2/HOST-3 on CUDA: a loop of replays (flush + advance in one graph, then
    record_advance and publish) whose GPU work is slowed down so that the host runs ahead
    (without bound, but for the read-back ring: a publish with every read-back in flight waits
    for the oldest): reserves are topped up from the read-backs that have arrived and no row
    runs short over many times its reserve; the lengths equal the eager loop's."""
    results = []
    for captured in (False, True):
        _, batch, caches = staggered_rows("cuda", 4)  # 16 tokens: the view lags up to 4 steps
        ones = torch.ones(8, dtype=torch.int32, device="cuda")

        def step():
            batch.flush(batch.history + ones)
            batch.advance(ones)

        if captured:
            graph = capture(step)
        for _ in range(120):
            batch.publish()
            torch.cuda._sleep(200_000)  # the GPU lags: the host queues steps ahead of it
            if captured:
                graph.replay()
                batch.record_advance()
            else:
                step()
        torch.cuda.synchronize()
        batch.poll()
        results.append(([c.history_length for c in caches], batch.advance_counters.tolist()))
        assert_tables_match(batch)
    assert results[0] == results[1]
    assert results[0] == ([row + 120 for row in range(8)], [0, 0])


@pytest.mark.parametrize("mode", ["tensor", "tensor+record_advance", "list"])
def test_flush_to_a_tensor_records_exactly_what_it_wrote(device, mode):
    """SAFE-2: a flush to a tensor of targets (values the host does not read) takes the
    device's own watermark through the read-back -- exactly what the flush wrote, never the
    published capacity -- so an eager flush + advance equals the replayed step (flush +
    advance, then ``record_advance``) and the host rule applied to a sequence of targets, in
    written, history and capacity, step after step (each read after the step's poll); after
    such a flush resize(history=...) refuses, naming Batch.poll, until the read-back is polled,
    and may then go exactly as far as the flush wrote."""
    rng = random.Random(3)
    _, batch, caches = advance_setup(device, 2 * 4)
    model = [[0, T, 0] for _ in caches]  # history, capacity, written
    for step in range(24):
        batch.publish()
        width = [m[1] - m[0] for m in model]
        accepted = [rng.randint(0, w) for w in width]  # often fewer than the width
        targets = [m[0] + a for m, a in zip(model, accepted)]
        accepted_t = torch.tensor(accepted, dtype=torch.int32, device=device)
        if mode == "list":
            batch.flush(targets)
        else:
            batch.flush(batch.history + accepted_t)
        batch.advance(accepted_t)
        if mode == "tensor+record_advance":
            batch.record_advance()
        batch.poll()  # the step's read-back
        for m, t in zip(model, targets):
            m[2] = max(m[2], min(t, m[1]))  # the flush writes up to its target, not capacity
            m[1], m[0] = t + (m[1] - m[0]), t
        assert [c.written for c in caches] == [m[2] for m in model]
        assert [c.history_length for c in caches] == [m[0] for m in model]
        assert [c.capacity for c in caches] == [m[1] for m in model]
    assert batch.advance_counters.tolist() == [0, 0]
    # a flush alone (no advance): history may follow exactly as far as the targets
    batch.publish()
    short = [max(c.history_length, c.capacity - 1) for c in caches]
    if mode == "list":
        batch.flush(short)
    else:
        batch.flush(torch.tensor(short, dtype=torch.int32, device=device))
        # the host learns what a flush to a tensor wrote only from the read-back: no host call
        # changes a row from its lengths before the poll
        with pytest.raises(RuntimeError, match=r"Batch\.poll\(\)"):
            caches[0].resize(history=short[0])
        assert [c.written for c in caches] == [m[2] for m in model]  # the poll's, unchanged
        batch.poll()
    for cache, t in zip(caches, short):
        if t < cache.capacity:
            with pytest.raises(ValueError, match="SAFE-2"):
                cache.resize(history=t + 1)
        assert cache.resize(history=t)
        assert cache.written == t
    batch.publish()
    assert_tables_match(batch)


def test_batch_memory_is_what_the_batch_allocates():
    """STO-4: the reserve's sizing and the batch's tensors come from one table of specs; the
    bytes a batch holds (tables, residency, outputs, cells, staging, read-back) are its sum."""
    from torch_kvcm2.memory import batch_memory_bytes
    manager = kv.KVCacheManager(dsa_config())
    batch = kv.Batch(manager, max_rows=3)
    pools = {manager.pool(g).untyped_storage().data_ptr() for g in range(manager.pool_groups)}
    tensors = batch.state_tensors() + [batch._table.mirror.delta, batch._readback.snapshot,
                                       batch._readback.counter_snapshot, batch._readback.counter_stage]
    tensors += [staging.tensor for staging in batch._table.mirror.ring]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if t.untyped_storage().data_ptr() not in pools}
    expected = batch_memory_bytes(manager.config, manager.pool_groups, 3)
    assert sum(storages.values()) == expected["gpu"] + expected["host"]
    assert manager.stats()["gpu"]["batch_bytes_in_use"] == expected["gpu"]


class _LateEvent:
    """A read-back event the GPU has not finished: query() is False until synchronize()."""

    def __init__(self):
        self.done, self.waited = False, 0

    def query(self):
        return self.done

    def synchronize(self):
        self.done, self.waited = True, self.waited + 1


def test_a_late_read_back_is_not_waited_for_and_a_publish_of_changes_needs_the_poll():
    """HOST-2/HOST-3: with advance's read-back still in flight, a publish with nothing to upload
    neither waits nor does page work; a publish of a membership change refuses, naming
    Batch.poll, changing nothing and waiting for nothing (the mirror must never take older
    lengths after a newer delta); after the poll (which waits for the read-back) it publishes
    and the tables equal a restage."""
    manager, batch, caches = advance_setup("cpu", 4)
    batch.remove(caches.pop(), discard=True)  # row 3 is free
    batch.publish()
    accepted = torch.tensor([1, 2, 3, 0], dtype=torch.int32)
    batch.flush(batch.history + accepted)
    batch.advance(accepted)
    late = _LateEvent()
    batch._readback.events[batch._readback.queue[-1]] = late  # as on CUDA before the copy has run
    batch.publish()
    assert late.waited == 0 and batch.pending_readback
    assert batch.add(manager.create_cache()) == 3  # membership: not a length read
    with pytest.raises(RuntimeError, match=r"Batch\.publish: .*call Batch\.poll\(\) first"):
        batch.publish()
    assert late.waited == 0 and batch.pending_readback
    assert [c.history_length for c in caches] == [0, 0, 0]  # as of the last poll
    batch.poll()
    assert late.waited == 1 and not batch.pending_readback
    batch.publish()
    assert [c.history_length for c in caches] == [1, 2, 3]
    assert_tables_match(batch)
