"""The prefix-sharing model and its checks, shared by test_prefix and test_tiering: the
data-safety model whose requests share committed prefixes (``SharingModel``), the reference-count
and prefix-index checks run after every step (``check_references``, ``check_index``) and managers
of exact slot counts (``sized``)."""
import dataclasses

import numpy as np
import torch

import torch_kvcm2 as kv
from inspect_state import (free_slot_mask, live_range, page_row, prefix_tables, slot_owners,
    slot_refs)
from safety_model import MAX_ROWS, P as SAFETY_P, Model


def check_references(manager, caches):
    """Every slot's reference count is the number of open caches holding it; a free slot is
    unreferenced and uncommitted; counts per group add up (no slot freed while referenced)."""
    for stats in manager.stats()["pool_groups"]:
        g = stats["index"]
        refs, owners, free = slot_refs(manager, g), slot_owners(manager, g), free_slot_mask(manager, g)
        expected = np.zeros(stats["slots"], dtype=np.int64)
        for cache in caches:
            if cache.closed:
                continue
            first, keep = live_range(cache, g)
            row = page_row(cache, g)[first:keep]
            assert (row >= 0).all()
            np.add.at(expected, row, 1)
        assert np.array_equal(refs, expected), g
        assert not (refs[free] != 0).any() and not (owners[free] != 0).any()
        cached = (refs == 0) & (owners != 0)
        assert int(cached.sum()) == stats["cached_slots"]
        assert int(free.sum()) == stats["free_slots"]
        assert not (cached & free).any()
    check_index(manager)


def check_index(manager):
    """The prefix index is consistent: each live entry's key maps to it, its slots are owned by
    it, its parent is live, its child count is the entries naming it, and an entry without
    slots is kept only for its children."""
    prefix = prefix_tables(manager)
    owners = [slot_owners(manager, g) for g in range(manager.pool_groups)]
    live = sorted(prefix.entry_of.values())
    assert len(live) == len(set(live))
    assert all(prefix.entry_of[prefix.keys[e]] == e for e in live)
    children = {e: 0 for e in live}
    for e in live:
        parent = int(prefix.parent[e])
        if parent >= 0:
            assert parent in children, f"entry {e}: parent {parent} was removed"
            children[parent] += 1
    for e in live:
        assert prefix.children[e] == children[e]
        slots = prefix.slots[e]
        assert (slots >= 0).any() or children[e], f"entry {e}: no slot and no child"
        for g, owner in enumerate(owners):
            if slots[g] >= 0:
                assert owner[slots[g]] == e + 1
    for g, owner in enumerate(owners):
        owned = np.flatnonzero(owner)
        entries = owner[owned] - 1
        assert (prefix.slots[entries, g] == owned).all()



def sized(config, slots, **kwargs):
    """A manager of ``config`` whose pool groups hold ``slots[medium]`` slots each."""
    probe = kv.KVCacheManager(config)
    per, reserve = slot_bytes_per_medium(probe), reserved_bytes(probe)
    probe.close()
    config = dataclasses.replace(config, gpu_budget_bytes=reserve["gpu"] + slots["gpu"] * per["gpu"],
                                 host_budget_bytes=reserve["host"] + slots["host"] * per["host"])
    manager = kv.KVCacheManager(config, **kwargs)
    assert all(g["slots"] == slots[g["medium"]] for g in manager.stats()["pool_groups"])
    return manager


def slot_bytes_per_medium(manager):
    """{medium: the bytes of one slot of each of its pool groups, summed} (from ``stats()``)."""
    groups = manager.stats()["pool_groups"]
    return {m: sum(g["page_bytes"] * g["scale"] for g in groups if g["medium"] == m)
            for m in ("gpu", "host")}


def reserved_bytes(manager):
    """{medium: the batch reserve the manager took out of that budget} (STO-4)."""
    stats = manager.stats()
    return {m: stats[m]["reserved_bytes"] for m in ("gpu", "host")}



def content_bytes(key, positions, tokens, nbytes):
    """Bytes of buffer ``key`` for tokens with ids ``tokens`` at ``positions``: a function of
    the token id, so requests with other ids at a position write other bytes there (a wrongly
    shared page reads back wrong)."""
    t = positions.long().cpu()[:, None]
    ids = torch.as_tensor(tokens).long()[:, None]
    return ((ids * 131 + t * 17 + key * 29 + torch.arange(nbytes) * 7) % 256).to(torch.uint8)


class SharingModel(Model):
    """The data-safety model whose requests draw their token ids from a few prompts, diverge
    at random points, commit at random steps and start from shared prefixes; bytes depend on
    the token ids, so every read of a shared page checks that the sharing was right."""

    def __init__(self, device, seed, slots):
        super().__init__(device, seed)  # the config, buffers and rng of the data-safety model
        self.batch.close()
        self.manager.close()
        self.manager = sized(self.config, {"gpu": slots, "host": slots})
        self.config = self.manager.config
        self.batch = kv.Batch(self.manager)
        self.caches = []
        self.everyone = []  # every cache ever made, for the reference counts
        self.ids = {}  # request id -> token ids (numpy int64[max_tokens_per_row])
        self.prompts = [np.array([self.rng.randrange(1000) for _ in range(96)]) for _ in range(3)]
        self.checked_tokens = 0
        self.shared_tokens = 0
        self.commits = 0

    def token_ids(self):
        prompt = self.rng.choice(self.prompts)
        cut = self.rng.choice([0, 4, 9, 16, 30, 48, 96])
        tail = np.array([self.rng.randrange(1000) for _ in range(96 - cut)], dtype=np.int64)
        return np.concatenate([prompt[:cut], tail]).astype(np.int64)

    def tokens_of(self, row):
        return self.ids[self.batch.members()[row].request_id]

    def membership(self):
        rng, batch = self.rng, self.batch
        members = batch.members()
        action = rng.random()
        if action < 0.18 and len(members) < MAX_ROWS:
            ids = self.token_ids()
            length = rng.randint(0, 96)
            cache = self.manager.create_cache(ids[:length] if rng.random() < 0.8 else None)
            self.ids[cache.request_id] = ids
            self.shared_tokens += cache.reused_tokens
            self.caches.append(cache)
            self.everyone.append(cache)
            free = [r for r in range(MAX_ROWS) if r not in members]
            batch.add(cache, row=rng.choice(free))
        elif action < 0.26 and members:
            cache = rng.choice(list(members.values()))
            self.check_host(cache)
            cache.close()
            self.caches.remove(cache)
        elif action < 0.40 and members:
            cache = rng.choice(list(members.values()))
            if cache.history_length >= 4 and not cache.offloaded:  # TIER-1: resume first
                self.commits += 1
                ids = self.ids[cache.request_id]
                cut = cache.history_length if rng.random() < 0.7 else rng.randint(0, cache.history_length)
                assert cache.commit(ids[:cut]) == cut // 4 * 4
        elif action < 0.46 and members:
            cache = rng.choice(list(members.values()))
            if cache.suspended:
                cache.resume()
            elif cache.history_length == cache.capacity:
                cache.suspend()

    def check_host_direct(self, layer, role, idx):
        info = self.manager.buffer(layer, role)
        slots = (idx // SAFETY_P // info.scale).numpy()
        # PFX-3: the host-direct path never reaches a shared or committed page
        assert (slot_refs(self.manager, info.pool_group)[slots] == 1).all()
        assert (slot_owners(self.manager, info.pool_group)[slots] == 0).all()

    def ids_at(self, rows, positions):
        return [int(self.tokens_of(int(row))[int(pos)])
                for row, pos in zip(rows.tolist(), positions.tolist())]

    def history_ids(self, cache):
        return self.ids[cache.request_id][:cache.history_length]

    def content(self, key, positions, ids, nbytes):
        return content_bytes(key, positions, ids, nbytes)

    def step(self, number):
        super().step(number)
        check_references(self.manager, self.everyone)
