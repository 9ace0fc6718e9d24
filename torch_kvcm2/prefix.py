"""Prefix sharing (REQUIREMENTS §12, PFX-1..6; docs/PREFIX.md): page keys and the index of
committed pages.

A committed page is an *entry*: one content key and, per pool group, the slot that holds the
page there (BAD where the committing cache held none: a windowed group's page behind its
window). Page ``i``'s key is the SHA-256 digest of the request's token ids ``[0, (i+1)*P)`` as
little-endian int64, so equal keys mean equal prefixes, not merely equal pages; the keys are
computed incrementally (one pass over the ids). Each slot records its entry (``owner``) in its
pool group; a slot with an owner is *committed* and never written again (PFX-3).

Eviction (PFX-4) takes the least recently used unreferenced slot of the pool group that needs
one. Evicting a full-attention group's slot removes its entry (the page is no longer whole in
every full-attention group) and frees the entry's other unreferenced slots; evicting a windowed
group's slot only drops that slot from its entry (matches whose window covers that page get
shorter, PFX-5). Every touch stamps a chain of entries deepest-oldest, so a page is always
evicted before the pages it extends.
"""
from __future__ import annotations

import hashlib
from typing import Optional

import numpy as np
import torch

from .config import BAD


def token_array(name: str, token_ids) -> np.ndarray:
    """``token_ids`` (a list of ints, a CPU integer tensor or a numpy integer array, 1-D) as a
    contiguous int64 array; TypeError / ValueError naming ``name`` otherwise (negative ids
    included). A numpy int64 array or an int64 CPU tensor is used without a copy."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor, got one on {token_ids.device}")
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or \
                token_ids.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer token ids, got dtype {token_ids.dtype}")
        array = token_ids.detach().numpy()
    elif isinstance(token_ids, np.ndarray):
        array = token_ids
    elif isinstance(token_ids, (list, tuple)):
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in token_ids):
            raise TypeError(f"{name} must be a list of int token ids")
        try:
            array = np.array(token_ids, dtype=np.int64)
        except OverflowError:
            raise ValueError(f"{name}: a token id does not fit int64") from None
    else:
        raise TypeError(f"{name} must be a list of ints, a CPU integer tensor or a numpy integer "
                        f"array, got {type(token_ids).__name__}")
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer token ids, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(array.shape)}")
    if array.dtype.kind == "u" and array.dtype.itemsize == 8 and len(array) and \
            int(array.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name}: a token id does not fit int64")
    if array.dtype.kind == "i" and len(array) and int(array.min()) < 0:
        raise ValueError(f"{name}: token ids must be non-negative, got {int(array.min())}")
    return np.ascontiguousarray(array, dtype="<i8")


def page_keys(ids: np.ndarray, pages: int, tokens_per_page: int) -> list[bytes]:
    """The keys of the first ``pages`` whole pages of ``ids`` (int64): key ``i`` is the SHA-256
    digest of ids ``[0, (i+1)*P)``, so it covers page ``i`` and every page before it."""
    data = memoryview(ids).cast("B")
    step = tokens_per_page * 8
    hasher = hashlib.sha256()
    update, copy = hasher.update, hasher.copy
    keys = []
    for start in range(0, pages * step, step):
        update(data[start:start + step])
        keys.append(copy().digest())
    return keys


class PrefixIndex:
    """The committed pages of one manager's pools: key -> entry -> one slot per pool group.

    ``full`` are the pool groups of full-attention life cycles (every page of a request stays
    live there); the others are windowed. Entry ids index numpy arrays that grow by doubling.
    """

    def __init__(self, groups, tokens_per_page: int):
        self.groups = groups
        self.tokens_per_page = tokens_per_page
        self.full = [g.index for g in groups if g.window is None]
        self.windowed = [g.index for g in groups if g.window is not None]
        self._entry_of: dict[bytes, int] = {}
        self._keys: list[Optional[bytes]] = []
        self._slots = np.full((0, len(groups)), BAD, dtype=np.int32)
        self._free_entries: list[int] = []
        self._clock = 0
        self.queried_tokens = 0  # create_cache(token_ids): tokens asked for, and shared
        self.matched_tokens = 0
        self.evicted_slots = 0
        for group in groups:
            group.prefix = self

    @property
    def entries(self) -> int:
        return len(self._entry_of)

    # ---- lookup ----
    def lookup(self, keys: list[bytes]) -> np.ndarray:
        """Entry ids of ``keys`` (BAD where absent), int64."""
        get = self._entry_of.get
        return np.fromiter((get(k, BAD) for k in keys), dtype=np.int64, count=len(keys))

    def match(self, ids: np.ndarray, max_pages: int) -> tuple[int, np.ndarray]:
        """(pages shared, their entry ids) for a request with token ids ``ids``: the longest
        ``n`` (at most ``max_pages``) such that every full-attention group holds pages
        ``[0, n)`` and every windowed group the pages its window covers at history ``n*P``
        (PFX-5). Changes nothing."""
        P = self.tokens_per_page
        pages = min(len(ids) // P, max_pages)
        if not pages or not self._entry_of:
            return 0, np.zeros(0, dtype=np.int64)
        entries = self.lookup(page_keys(ids, pages, P))
        present = entries >= 0
        n = pages if present.all() else int(np.argmin(present))
        if self.full:
            entries = entries[:n]
        else:  # no full-attention group: pages behind every window are not needed
            n = pages
        n = self._window_limit(entries, n)
        return n, entries[:n]

    def _window_limit(self, entries: np.ndarray, n: int) -> int:
        """The largest ``m <= n`` whose windowed pages ``[first(m), m)`` all have slots."""
        if not self.windowed:
            return n
        P = self.tokens_per_page
        runs = []  # per windowed group: length of the run of held pages ending at each page
        for g in self.windowed:
            held = np.zeros(n, dtype=bool)
            ok = entries[:n] >= 0
            held[ok] = self._slots[entries[:n][ok], g] >= 0
            # run[i] = i + 1 - (index of the last page <= i without a slot, + 1)
            idx = np.arange(n)
            last_gap = np.maximum.accumulate(np.where(held, -1, idx)) if n else idx
            runs.append((self.groups[g].window, idx - last_gap))
        for m in range(n, 0, -1):
            h = m * P
            if all(run[m - 1] >= m - (min((h - w) // P, m) if h > w else 0) for w, run in runs):
                return m
        return 0

    def slots_of(self, entries: np.ndarray, group: int) -> np.ndarray:
        return self._slots[entries, group]

    # ---- recency ----
    def touch(self, entries: np.ndarray) -> None:
        """Stamp a chain of entries (page order; BAD entries skipped) as just used, the deepest
        page oldest."""
        entries = entries[entries >= 0]
        n = len(entries)
        if not n:
            return
        stamps = self._clock + np.arange(n, 0, -1, dtype=np.int64)
        self._clock += n + 1
        for g, group in enumerate(self.groups):
            slots = self._slots[entries, g]
            ok = slots >= 0
            group.restamp(slots[ok], stamps[ok])

    # ---- commit ----
    def commit(self, keys: list[bytes], rows: np.ndarray, live: list) -> int:
        """Commit pages ``[0, len(keys))`` of a cache whose page rows are ``rows`` (int32[G,
        max_pages]) and live ranges ``live``; returns the number of pages newly committed.
        Raises ValueError, changing nothing, when a page the cache holds is committed under
        another key (the token ids disagree with the ones it was committed or shared with)."""
        n = len(keys)
        if not n:
            return 0
        G = len(self.groups)
        cache_slots = np.full((n, G), BAD, dtype=np.int32)
        for g in range(G):
            lo, hi = min(live[g][0], n), min(live[g][1], n)
            cache_slots[lo:hi, g] = rows[g, lo:hi]
        entries = self.lookup(keys)
        owners = np.full((n, G), BAD, dtype=np.int64)
        for g, group in enumerate(self.groups):
            ok = cache_slots[:, g] >= 0
            owners[ok, g] = group.owner[cache_slots[ok, g]].astype(np.int64) - 1
        committed = owners >= 0
        wrong = committed & (owners != entries[:, None])
        if wrong.any():
            page = int(np.argmax(wrong.any(axis=1)))
            raise ValueError(
                f"commit: page {page} of this cache was committed or shared under other token ids "
                f"than token_ids[{page * self.tokens_per_page}:"
                f"{(page + 1) * self.tokens_per_page}] give; pass the request's own token ids")
        created = 0
        for i in np.flatnonzero(entries < 0).tolist():
            slots = cache_slots[i]
            if not (slots >= 0).any():
                continue  # nothing held (behind every window): nothing to offer
            entries[i] = self._new_entry(keys[i], slots)
            created += 1
        # pages already committed by another cache (equal content) stay private; an entry this
        # cache shares in every full-attention group takes the windowed slots it lacks
        shared = np.flatnonzero(entries >= 0)
        if self.full and self.windowed and len(shared):
            mine = np.zeros(n, dtype=bool)
            mine[shared] = (self._slots[entries[shared]][:, self.full]
                            == cache_slots[shared][:, self.full]).all(axis=1)
            for g in self.windowed:
                fill = mine & (cache_slots[:, g] >= 0) & (owners[:, g] < 0)
                fill[shared] &= self._slots[entries[shared], g] < 0
                if fill.any():
                    self._slots[entries[fill], g] = cache_slots[fill, g]
                    self.groups[g].owner[cache_slots[fill, g]] = (entries[fill] + 1).astype(np.int32)
        self.touch(entries[entries >= 0])
        return created

    def _new_entry(self, key: bytes, slots: np.ndarray) -> int:
        if self._free_entries:
            e = self._free_entries.pop()
        else:
            e = len(self._keys)
            if e == len(self._slots):
                grown = np.full((max(1024, 2 * e), len(self.groups)), BAD, dtype=np.int32)
                grown[:e] = self._slots
                self._slots = grown
            self._keys.append(None)
        self._keys[e] = key
        self._entry_of[key] = e
        self._slots[e] = slots
        for g, group in enumerate(self.groups):
            if slots[g] >= 0:
                group.owner[slots[g]] = e + 1
        return e

    # ---- eviction ----
    def evict(self, group) -> None:
        """Reclaim the least recently used cached slot of ``group`` (there must be one): a
        full-attention group's slot removes its entry; a windowed group's slot leaves it."""
        slot = group.pop_lru()
        self.evicted_slots += 1
        e = int(group.owner[slot]) - 1
        if group.window is None:
            self._remove_entry(e)
        else:
            group.uncommit(np.array([slot]))
            self._slots[e, group.index] = BAD
            if not (self._slots[e] >= 0).any():
                self._remove_entry(e)

    def _remove_entry(self, e: int) -> None:
        for g, group in enumerate(self.groups):
            slot = int(self._slots[e, g])
            if slot >= 0:
                group.uncommit(np.array([slot]))
        self._slots[e] = BAD
        del self._entry_of[self._keys[e]]
        self._keys[e] = None
        self._free_entries.append(e)

    def stats(self) -> dict:
        q = self.queried_tokens
        return {"entries": self.entries, "queried_tokens": q, "matched_tokens": self.matched_tokens,
                "hit_rate": (self.matched_tokens / q) if q else 0.0,
                "evicted_slots": self.evicted_slots}
