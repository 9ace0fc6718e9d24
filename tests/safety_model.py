"""The data-safety model: a serving engine's use of the whole Batch API, checking every byte it can
see. ``Model`` writes deterministic bytes per (layer, buffer, token) (``token_bytes``), runs the
documented step order with random prefill, decode, speculative rejection, suspend, resume, join,
leave and move, compares resolve with ``reference`` and checks RES-1/RES-2. Shared by
test_data_safety, test_mtp and test_prefix.
"""
import random

import pytest
import torch

import reference
import torch_kvcm2 as kv

P = 4
MAX_ROWS = 4


def make_config(device, max_total_input_tokens=None, wide=False):
    # group "a": two layers, 2-token units, mixed chunking; group of layer "b": 1-token units (of
    # 4 KiB when wide: page-sized pieces, 16-byte vectors on CUDA, from pinned host memory)
    a = kv.SparseSpec(tokens_per_unit=2, width=4, slots=8, max_inflight_tokens=3, selection_id="a")
    b = kv.SparseSpec(tokens_per_unit=1, width=3, slots=8, max_inflight_tokens=2)
    layers = [
        kv.LayerSpec("a0", [kv.BufferSpec("kv", 6, sparse=True, chunks=2), kv.BufferSpec("idx", 4)],
                     sparse=a),
        kv.LayerSpec("a1", [kv.BufferSpec("kv", 6, sparse=True, chunks=2),
                            kv.BufferSpec("rope", 4, sparse=True),
                            kv.BufferSpec("none", 0, sparse=True)], sparse=a),
        kv.LayerSpec("b", [kv.BufferSpec("kv", 4096 if wide else 6, sparse=True, chunks=1)],
                     sparse=b),
        kv.LayerSpec("dense", [kv.BufferSpec("k", 8)]),
    ]
    return kv.CacheConfig(tokens_per_page=P, layers=layers, max_rows=MAX_ROWS, max_tokens_per_row=96,
                          gpu_budget_bytes=1 << 20, host_budget_bytes=(8 if wide else 1) << 20,
                          device=device,
                          max_total_input_tokens=max_total_input_tokens)


def token_bytes(key: int, positions: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The bytes the model writes for tokens at ``positions`` of buffer ``key``: [n, nbytes]."""
    t = positions.long().cpu()[:, None]
    return ((t * 131 + key * 29 + torch.arange(nbytes) * 7) % 256).to(torch.uint8)


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """The row index of every entry of a [MAX_ROWS, n] tensor."""
    return torch.arange(t.shape[0])[:, None].expand_as(t)


class Model:
    """Drives a batch the way a serving engine would and checks every byte it can see."""

    def __init__(self, device, seed, max_total_input_tokens=None, wide=False):
        self.device = device
        self.rng = random.Random(seed)
        self.config = make_config(device, max_total_input_tokens, wide)
        self.manager = kv.KVCacheManager(self.config)
        self.batch = kv.Batch(self.manager)
        self.buffers = []  # (layer, role, key, group index, bytes_per_token)
        for group in self.config.selection_groups:
            for layer in group.layers:
                for buf in self.config.layer(layer).sparse_buffers:
                    if buf.bytes_per_token:
                        self.buffers.append((layer, buf.role, len(self.buffers), group.index,
                                             buf.bytes_per_token))
        self.caches = []
        self.checked_tokens = 0

    # ---- host-side actions ----
    def membership(self):
        rng, batch = self.rng, self.batch
        action = rng.random()
        members = batch.members()
        if action < 0.15 and len(members) < MAX_ROWS:
            cache = self.manager.create_cache()
            self.caches.append(cache)
            free = [r for r in range(MAX_ROWS) if r not in members]
            batch.add(cache, row=rng.choice(free) if rng.random() < 0.5 else None)
        elif action < 0.22 and members:
            cache = rng.choice(list(members.values()))
            self.check_host(cache)
            cache.close()
            self.caches.remove(cache)
        elif action < 0.30 and members and len(members) < MAX_ROWS:
            cache = rng.choice(list(members.values()))
            batch.move(cache, rng.choice([r for r in range(MAX_ROWS) if r not in members]))
        elif action < 0.36 and members:
            cache = rng.choice(list(members.values()))
            if cache.suspended:
                cache.resume()
            elif cache.history_length == cache.capacity:
                cache.suspend()

    def grow(self):
        for cache in self.batch.members().values():
            if cache.suspended:
                continue
            h = cache.history_length
            if self.rng.random() < 0.15:
                n = self.rng.randint(1, 24)  # a prefill chunk: mostly straight to host pages
            else:
                n = self.rng.randint(0, 3)  # decode (or speculative) tokens, sometimes none
            n = min(n, self.config.max_tokens_per_row - h)
            if not cache.resize(capacity=h + n):
                assert cache.capacity == h  # a failed resize changes nothing

    # ---- the step ----
    def select(self, group):
        sp = group.sparse
        selected = torch.full((MAX_ROWS, sp.width), -1, dtype=torch.int32)
        for row, cache in self.batch.members().items():
            h, c = cache.history_length, cache.capacity
            s0 = sp.inflight_start(h, c)
            units = list(range(h // sp.tokens_per_unit))
            units += list(range(s0 // sp.tokens_per_unit, -(-c // sp.tokens_per_unit))) if s0 < c else []
            for j in range(sp.width):
                roll = self.rng.random()
                if roll < 0.1:
                    selected[row, j] = -1 - self.rng.randint(0, 5)  # padding
                elif roll < 0.15:
                    selected[row, j] = self.rng.randint(-(-c // sp.tokens_per_unit), 10 ** 6)  # invalid
                elif roll < 0.25 and j:
                    selected[row, j] = selected[row, j - 1]  # duplicate
                elif units:
                    recent = units[-6:] if self.rng.random() < 0.6 else units
                    selected[row, j] = self.rng.choice(recent)  # locality makes hits
        return selected.to(self.device)

    def resolve_and_check(self, group, selected):
        batch = self.batch
        state = batch.groups[group.index]
        sp = group.sparse
        before = reference.state_from_tensors(state.resident, state.recency, state.counters)
        index = batch.resolve(group.index, selected)
        expected_index, expected_misses, _ = reference.resolve(
            before, selected.tolist(), batch.history.tolist(), batch.capacity.tolist(),
            batch.lease.tolist(), sp.tokens_per_unit, P, sp.max_inflight_tokens, group.window or 0)
        assert index.tolist() == expected_index
        n = int(state.miss_count[0])
        assert sorted(map(tuple, state.miss_list[:n].tolist())) == sorted(expected_misses)
        assert state.resident.tolist() == before.resident
        assert state.recency.tolist() == before.recency
        assert state.counters.tolist() == before.counters
        reference.check_res1(before)
        reference.check_res2(before, batch.history.tolist(), batch.capacity.tolist(),
                             batch.lease.tolist(), sp.tokens_per_unit, P, sp.max_inflight_tokens)
        return index

    def write(self, group_index):
        """The model writes its new tokens: [h, s0) to host pages, [s0, c) into cells."""
        batch = self.batch
        table, start = batch.write_indices(group_index)
        table, start = table.cpu(), start.cpu()
        width = max(1, max((c.capacity - c.history_length for c in batch.members().values()), default=1))
        positions = torch.full((MAX_ROWS, width), -1, dtype=torch.int32)
        for row, cache in batch.members().items():
            if cache.suspended:
                continue
            h, s0 = cache.history_length, int(start[row])
            positions[row, :s0 - h] = torch.arange(h, s0, dtype=torch.int32)
        positions = positions.to(self.device)
        for layer, role, key, group, nbytes in self.buffers:
            if group != group_index:
                continue
            host = batch.host_token_indices(layer, role, positions).cpu()
            ok = host >= 0
            view = self.manager.buffer_view(layer, role)
            idx = host[ok].long()
            self.check_host_direct(layer, role, idx)
            pos = positions.cpu()[ok]
            data = self.content(key, pos, self.ids_at(rows_of(host)[ok], pos), nbytes)
            data = data.view(len(idx), *view.shape[1::2])
            view[(idx // P).to(self.device), :, (idx % P).to(self.device)] = data.to(self.device)
            cells = batch.cells(layer, role)
            tokens = (start[:, None] + torch.arange(table.shape[1]))[table >= 0]
            idx = table[table >= 0].long()
            data = self.content(key, tokens, self.ids_at(rows_of(table)[table >= 0], tokens), nbytes)
            data = data.view(len(idx), *cells.shape[1::2])
            cells[(idx // P).to(self.device), :, (idx % P).to(self.device)] = data.to(self.device)

    def check_cells(self, group, selected, index):
        """Every written token of every selected unit reads back from its cell (RES-3)."""
        U = group.sparse.tokens_per_unit
        selected, index = selected.cpu(), index.cpu()
        capacity = self.batch.capacity.cpu()
        ok = index >= 0
        rows = rows_of(index)[ok]
        units, entries = selected[ok].long(), index[ok].long()
        for offset in range(U):
            tokens = units * U + offset
            written = tokens < capacity[rows]
            if not written.any():
                continue
            t, r, idx = tokens[written], rows[written], entries[written] * U + offset
            ids = self.ids_at(r, t)
            for layer, role, key, g, nbytes in self.buffers:
                if g != group.index:
                    continue
                cells = self.batch.cells(layer, role).cpu()
                got = cells[idx // P, :, idx % P].reshape(len(idx), nbytes)
                assert torch.equal(got, self.content(key, t, ids, nbytes)), (layer, role)
                self.checked_tokens += len(idx)

    def settle(self):
        """The host waits for the device's work so far (the last flush's writes to host pages)
        before it reads those pages itself."""
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize()

    def check_host(self, cache):
        """Every token of history reads back from its host page (SAFE-1), once settled."""
        self.settle()
        manager = self.manager
        t = torch.arange(cache.history_length)
        ids = self.history_ids(cache)
        for layer, role, key, _, nbytes in self.buffers:
            pages = torch.tensor(cache.pages(manager.buffer(layer, role).pool_group), dtype=torch.long)
            host = manager.slot_pages(layer, role, device_side=False)
            got = host[pages[t // P], :, t % P].reshape(len(t), nbytes)
            assert torch.equal(got, self.content(key, t, ids, nbytes)), (cache, layer, role)

    # what the model wrote: bytes of a token position (models whose bytes also depend on token
    # ids, test_prefix.SharingModel, return the ids and use them)
    def ids_at(self, rows, positions):
        """Token ids at ``positions`` of the caches seated at ``rows`` (none: bytes depend on the
        position only)."""
        return None

    def check_host_direct(self, layer, role, idx):
        """A check of the host token indices the model writes host-direct tokens to (none)."""

    def history_ids(self, cache):
        """Token ids of ``cache``'s history (none: bytes depend on the position only)."""
        return None

    def content(self, key, positions, ids, nbytes):
        """The bytes of buffer ``key`` the model wrote for tokens at ``positions``."""
        return token_bytes(key, positions, nbytes)

    # ---- the write contract's edges (docs/HOST_PATH.md), tried mid-step ----
    def edges(self):
        """With tokens written but not flushed: growth, removal and a fresh cache's history over
        recycled pages are tried at the contract's edges; a refusal must change nothing, and
        what is allowed keeps every byte (checked by the reads that follow)."""
        rng, batch = self.rng, self.batch
        members = {r: c for r, c in batch.members().items() if not c.suspended}
        if not members:
            return
        row, cache = rng.choice(sorted(members.items(), key=lambda rc: rc[0]))
        h, c = cache.history_length, cache.capacity
        roll = rng.random()
        if roll < 0.08 and h < c:  # grow with unflushed tokens in cells
            grown = min(c + rng.randint(1, 24), self.config.max_tokens_per_row)
            before = (cache.capacity, cache.history_length, cache.pages(0))
            try:
                assert cache.resize(capacity=grown)
            except ValueError as error:
                assert "moves the in-flight start" in str(error)
                assert (cache.capacity, cache.history_length, cache.pages(0)) == before
                return
            assert cache.resize(capacity=c)  # back: the step writes the published range
            batch.publish()
        elif roll < 0.12 and h < c:  # remove with tokens in flight is refused
            with pytest.raises(RuntimeError, match="tokens are in flight"):
                batch.remove(cache)
            assert batch.row_of(cache) == row and cache.capacity == c
        elif roll < 0.14 and h < c:  # abort: discard the in-flight tokens and sit down again
            batch.remove(cache, discard=True)
            assert cache.capacity == cache.history_length == h
            batch.add(cache, row=row)
            batch.publish()
        elif roll < 0.16:  # a fresh cache over recycled pages cannot make them history
            fresh = self.manager.create_cache()
            if fresh.resize(capacity=12):
                with pytest.raises(ValueError, match="SAFE-2"):
                    fresh.resize(history=8)
            fresh.close()

    def step(self, number):
        self.membership()
        self.grow()
        self.batch.publish()
        for group in self.config.selection_groups:
            selected = self.select(group)
            index = self.resolve_and_check(group, selected)
            for layer in group.layers:
                self.batch.fetch(layer)
            self.write(group.index)
            self.check_cells(group, selected, index)
        self.batch.record_host_writes()  # the write path wrote every row's [h, s0) to host pages
        self.edges()
        reject = self.rng.random() < 0.1
        new_history = self.batch.capacity.tolist()
        members = self.batch.members()
        if reject:  # speculative tokens rejected: keep only part of each row's new tokens
            for row, cache in members.items():
                new_history[row] = self.rng.randint(cache.history_length, cache.capacity)
        self.batch.flush(new_history if reject else None)
        for row, cache in members.items():
            if cache.suspended:
                continue
            target = int(new_history[row])
            if self.rng.random() < 0.1 and cache.history_length < cache.capacity:
                # shrink before history moves: host-written tokens may not re-enter the
                # in-flight range (a refusal changes nothing); else the cut tokens are gone
                shrunk = self.rng.randint(cache.history_length, cache.capacity - 1)
                before = (cache.capacity, cache.history_length, cache.pages(0))
                try:
                    assert cache.resize(capacity=shrunk)
                    target = min(target, shrunk)
                except ValueError as error:
                    assert "already on host pages, back into the in-flight range" in str(error)
                    assert (cache.capacity, cache.history_length, cache.pages(0)) == before
            assert cache.resize(history=target)
            assert cache.resize(capacity=target)  # rejected tokens are dropped
        if number % 50 == 0:
            for cache in self.batch.members().values():
                self.check_host(cache)
