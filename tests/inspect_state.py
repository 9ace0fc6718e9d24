"""The manager's internal state that no public call shows, read (or, for a few fault injections,
changed) in this one module: the tests' only reach into ``KVCacheManager.storage``.

Everything else the tests read goes through the public API: ``manager.buffer`` /
``buffer_view`` / ``slot_pages`` / ``pool`` / ``pool_groups`` / ``stats()``, ``Batch.page_table``
and the cache's own getters. What is here is per-slot bookkeeping (reference counts, prefix
owners, the free list), the prefix index's tables, the host tier's per-slot references, the
whole reservation of a pool (``manager.pool`` stops at the committed slots) and the internal
objects that test_storage / test_host_region unit-test. Each function's docstring ends with
the public call that would replace it, or says that it is a test hook (fault injection), which
needs none.
"""
from types import SimpleNamespace
from typing import Optional

import numpy as np

from torch_kvcm2 import BAD


def _groups(manager):
    return manager.storage.groups


# ---- per-slot state of a pool group ----
def slot_refs(manager, group: int) -> np.ndarray:
    """int32[slots]: how many caches' page lists hold each slot of pool group ``group`` (a copy).
    Public call it needs: a per-slot view such as ``manager.slot_state(group)["refs"]``."""
    return _groups(manager)[group].refs.copy()


def slot_owners(manager, group: int) -> np.ndarray:
    """int32[slots]: the prefix entry + 1 that committed each slot, 0 for an uncommitted one (a
    copy). Public call it needs: ``manager.slot_state(group)["entry"]``."""
    return _groups(manager)[group].owner.copy()


def free_slot_mask(manager, group: int) -> np.ndarray:
    """bool[slots]: the slots on the free list (released below the high-water mark, or never
    handed out). Public call it needs: ``manager.slot_state(group)["free"]``."""
    g = _groups(manager)[group]
    free = np.ones(g.num_slots, dtype=bool)
    high, released = g.free_state()
    free[:high] = False
    free[released] = True
    return free


def released_slots(manager, group: int) -> list[int]:
    """The released slots below the high-water mark (the free list's heap), sorted: two states
    with equal ``free_slots`` can differ here. Public call it needs:
    ``manager.slot_state(group)["free"]`` (the mask gives the same comparison)."""
    return _groups(manager)[group].free_state()[1]


def take_slots(manager, group: int, n: int) -> Optional[list[int]]:
    """Test hook (fault injection): hand ``n`` slots of pool group ``group`` to nobody (lowest
    free first; None, nothing taken, when fewer are free), as if other requests held them, to
    squeeze one pool group alone. Needs no public call."""
    return _groups(manager)[group].allocate(n)


def give_back_slots(manager, group: int, slots) -> None:
    """Test hook: return slots ``take_slots`` took."""
    _groups(manager)[group].release(slots)


def pool_reservation(manager, group: int, device_side: bool = False):
    """uint8[slots, scale, page_bytes]: pool group ``group``'s whole reservation, slots beyond
    the committed ones included (``manager.pool`` gives only the committed slots). Public call
    it needs: none for an engine; a ``committed_only=False`` on ``manager.pool``."""
    g = _groups(manager)[group]
    return g.device_data if device_side else g.data


# ---- the host tier (TIER-1) ----
def tier_slot_refs(manager, group: int) -> Optional[np.ndarray]:
    """int32[tier slots]: the suspended caches holding each slot of dense pool group
    ``group``'s host tier (a copy; None without a tier). Public call it needs:
    ``manager.slot_state(group, tier=True)["refs"]``."""
    tier = manager.storage.tiers[group]
    return None if tier is None else tier.refs.copy()


# ---- the prefix index (PFX-1..6) ----
def prefix_tables(manager) -> SimpleNamespace:
    """A copy of the prefix index's tables: ``entry_of`` {key: entry} of every live entry
    (slot-less parents too, which ``stats()["prefix"]["entries"]`` leaves out), ``keys`` [entry]
    (None for a removed one), ``parent`` / ``children`` [entry] and ``slots`` [entry, group]
    (BAD where the entry holds no slot there). Public call it needs:
    ``manager.prefix_entries()`` returning these."""
    prefix = manager.storage.prefix
    return SimpleNamespace(entry_of=dict(prefix._entry_of), keys=list(prefix._keys),
                           parent=prefix._parent.copy(), children=prefix._children.copy(),
                           slots=prefix._slots.copy())


def prefix_keys(manager, ids: np.ndarray, pages: int) -> np.ndarray:
    """The index's keys of the first ``pages`` pages of ``ids``. Public call it needs: none (a
    test of key collisions; ``prefix_tables`` gives the keys present)."""
    return manager.storage.prefix.keys(ids, pages)


def collide_prefix_keys(manager) -> None:
    """Test hook: zero the index's token multipliers, so every key of a depth is its salt alone
    (every page of a depth collides). Needs no public call."""
    manager.storage.prefix._token_mult[:] = 0


def drop_windowed_slot(manager, group: int, slot: int) -> None:
    """Test hook: the prefix index loses committed slot ``slot`` of windowed pool group
    ``group``, as evicting it does (its entry keeps its other groups' slots). Needs no public
    call."""
    g = _groups(manager)[group]
    entry = int(g.owner[slot]) - 1
    g.uncommit(np.array([slot]))
    manager.storage.prefix._slots[entry, group] = BAD


# ---- internal objects, for unit tests of their own modules ----
def pool_group(manager, group: int):
    """The ``storage.PoolGroup`` itself, for unit tests of its allocator and commit path
    (test_storage, test_host_region, test_metrics' growth log). Public call it needs: none (a
    unit test of an internal class)."""
    return _groups(manager)[group]


def host_region(manager):
    """The ``host_region.HostRegion`` itself (None without one), for unit tests of its commit
    path and of its release at close (``stats()["host_region"]`` gives its numbers while the
    manager is open). Public call it needs: none (a unit test of an internal class)."""
    return manager.storage.region


# ---- a request's state (the manager's request table, by the cache's slot) ----
def page_rows(cache) -> np.ndarray:
    """int32[pool groups, max_pages_per_row]: the cache's page rows (a copy). Public calls:
    ``KVCache.pages(group)`` (up to the allocated pages) or ``manager.requests.pages``."""
    return cache.manager.requests.pages[cache.slot].copy()


def live_range(cache, group: int) -> tuple:
    """(first live page, allocated pages) of pool group ``group``. Public call:
    ``manager.requests.live_range(cache.slot, group)[1:3]``."""
    first, keep = cache.manager.requests.live[cache.slot, group].tolist()
    return first, keep


def page_row(cache, group: int) -> np.ndarray:
    """The cache's page row of pool group ``group`` (int32[max_pages_per_row], a view)."""
    return cache.manager.requests.page_row(cache.slot, group)


def flushed(cache) -> int:
    """The SAFE-2 flushed watermark the host holds for the cache (``KVCache.written`` adds the
    declared host writes)."""
    from torch_kvcm2.request_table import FLUSHED
    return int(cache.manager.requests.lengths[cache.slot, FLUSHED])


def set_flushed(cache, tokens: int) -> None:
    """Test hook: as if tokens ``[0, tokens)`` had been flushed to host pages."""
    from torch_kvcm2.request_table import FLUSHED
    cache.manager.requests.lengths[cache.slot, FLUSHED] = tokens


def offload_of(cache):
    """The cache's ``tiers.Offload`` (dense pages in the host tier), or None."""
    return cache.manager.requests.offload[cache.slot]


def arrival_of(cache):
    """The cache's ``tiers.Restore`` (a resume's copy back not yet read), or None."""
    return cache.manager.requests.arrival[cache.slot]


def tier_pages(cache, group: int):
    """``RequestTable.tier_pages`` of the cache: (tier pool, tier slot per page, event) or None."""
    return cache.manager.requests.tier_pages(cache.slot, group)


def replayed_advance(batch, accepted) -> None:
    """Test hook: the device's ``advance`` alone, as a replayed graph runs it (no read-back
    queued, nothing told to the host)."""
    batch._step.advance(accepted)
