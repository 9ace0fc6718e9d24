"""Prefix sharing (REQUIREMENTS §12, PFX-1..6; docs/PREFIX.md): page keys and the index of
committed pages.

A committed page is an *entry*: its page's token ids, its parent (the entry of the page before
it; BAD for page 0) and, per pool group, the slot that holds the page there (BAD where the
committing cache held none: a windowed group's page behind its window). An entry therefore
stands for one exact token prefix: page ``i``'s entry is shared only when its own ids equal the
request's page ``i`` and its parent is the entry shared for page ``i - 1``, so equal entries mean
equal prefixes, compared token by token, never by a digest alone.

Entries are found through 64-bit keys: page ``i``'s key is a keyed multilinear hash of the
request's ids ``[0, (i+1)*P)`` (random multipliers drawn per manager), computed for all pages at
once with a few numpy operations; every key a lookup finds is then verified as above, so a key
collision can cost a match its length (the page and what follows stay unshared) but never
shares a wrong page. Each slot records its entry (``owner``) in its pool group; a slot with an
owner is *committed* and never written again (PFX-3).

Eviction (PFX-4) takes the least recently used unreferenced slot of the pool group that needs
one. Evicting a full-attention group's slot takes the entry's slots away (the page is no longer
whole in every full-attention group) and frees its other unreferenced slots; evicting a
windowed group's slot only drops that slot from its entry (matches whose window covers that
page get shorter, PFX-5). An entry left without slots is kept, slot-less, while deeper entries
name it as their parent (so parents always exist), and is removed with its last child. Every
touch stamps a chain of entries deepest-oldest, so a page is always evicted before the pages it
extends.
"""
from __future__ import annotations

import logging
from itertools import repeat
from typing import Optional

import numpy as np
import torch

from . import lengths
from .config import BAD

logger = logging.getLogger(__name__)


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


class PrefixIndex:
    """The committed pages of one manager's pools: key -> entry -> one slot per pool group.

    ``full`` are the pool groups of full-attention life cycles (every page of a request stays
    live there); the others are windowed. ``max_pages`` bounds the pages of a key chain (the
    pages of a row). Entry ids index numpy arrays that grow by doubling.
    """

    def __init__(self, groups, tokens_per_page: int, max_pages: int):
        self.groups = groups
        self.tokens_per_page = tokens_per_page
        self.max_pages = max_pages
        self.full = [g.index for g in groups if g.window is None]
        self.windowed = [g.index for g in groups if g.window is not None]
        rng = np.random.default_rng()  # OS entropy: keys cannot be aimed at from outside
        def draw(n: int) -> np.ndarray:
            return rng.integers(0, np.iinfo(np.uint64).max, n, dtype=np.uint64, endpoint=True)

        self._token_mult = draw(tokens_per_page) | 1  # odd: a one-token change moves the key
        self._page_mult = draw(max_pages) | 1
        self._page_salt = draw(max_pages)
        self._entry_of: dict[int, int] = {}
        self._keys: list[Optional[int]] = []
        self._slots = np.full((0, len(groups)), BAD, dtype=np.int32)
        self._tokens = np.zeros((0, tokens_per_page), dtype=np.int64)
        self._parent = np.zeros(0, dtype=np.int64)
        self._children = np.zeros(0, dtype=np.int32)
        self._free_entries: list[int] = []
        self._clock = 0
        self.queries = 0  # create_cache(token_ids) calls
        self.queried_tokens = 0  # create_cache(token_ids): tokens asked for, and shared
        self.matched_tokens = 0
        self.evicted_slots = 0

    @property
    def entries(self) -> int:
        """Entries holding at least one slot (slot-less parents kept for their children are
        not counted)."""
        n = len(self._keys)
        return int(np.count_nonzero((self._slots[:n] >= 0).any(axis=1))) if n else 0

    # ---- keys and lookup ----
    def keys(self, ids: np.ndarray, pages: int) -> np.ndarray:
        """The keys of the first ``pages`` whole pages of ``ids`` (int64, ``pages <=
        max_pages``), uint64[pages]: key ``i`` hashes ids ``[0, (i+1)*P)``, page ``i``'s own
        ids through the token multipliers, the pages through the page multipliers, summed
        over the prefix (so it covers page ``i`` and every page before it), salted by depth."""
        P = self.tokens_per_page
        rows = ids[:pages * P].view(np.uint64).reshape(pages, P)
        page_hash = rows.dot(self._token_mult)  # uint64 arithmetic wraps: mod 2**64
        chain = np.cumsum(page_hash * self._page_mult[:pages], dtype=np.uint64)
        return chain ^ self._page_salt[:pages]

    def _chain(self, ids: np.ndarray, keys: list) -> np.ndarray:
        """Entry ids (int64) of the longest run of pages ``[0, n)`` of ``ids`` whose keys are
        present and whose entries are exactly these pages: each entry's token ids equal the
        page's and its parent is the previous page's entry (BAD for page 0). Slot-less entries
        are included (the caller decides what it needs held)."""
        n = len(keys)
        entries = np.fromiter(map(self._entry_of.get, keys, repeat(BAD)), dtype=np.int64,
                              count=n)
        found = entries >= 0
        if not found.all():
            n = int(np.argmin(found))
            entries = entries[:n]
        if not n:
            return entries
        P = self.tokens_per_page
        rows = ids[:n * P].reshape(n, P)
        first = int(entries[0])
        parents = self._parent[entries]
        linked = parents[1:] == entries[:-1]
        if linked.all() and int(entries[-1]) - first == n - 1 and (np.diff(entries) == 1).all():
            tokens = self._tokens[first:first + n]  # a chain committed in one go: a slice
        else:
            tokens = self._tokens[entries]
        if parents[0] == BAD and linked.all() and np.array_equal(tokens, rows):
            return entries
        ok = (tokens == rows).all(axis=1)
        ok[0] &= parents[0] == BAD
        ok[1:] &= linked
        return entries[:int(np.argmin(ok))] if not ok.all() else entries

    def match(self, ids: np.ndarray, max_pages: int) -> tuple[int, np.ndarray]:
        """(pages shared, their entry ids) for a request with token ids ``ids``: the longest
        ``n`` (at most ``max_pages``) such that pages ``[0, n)`` are entries of exactly these
        ids, every full-attention group holds pages ``[0, n)`` and every windowed group the
        pages its window covers at history ``n*P`` (PFX-5). Changes nothing."""
        P = self.tokens_per_page
        pages = min(len(ids) // P, max_pages)
        if not pages or not self._entry_of:
            return 0, np.zeros(0, dtype=np.int64)
        entries = self._chain(ids, self.keys(ids, pages).tolist())
        n = len(entries)
        if self.full and n:
            held = (self._slots[entries][:, self.full] >= 0).all(axis=1)
            if not held.all():
                n = int(np.argmin(held))
                entries = entries[:n]
        n = self._window_limit(entries, n)
        return n, entries[:n]

    def _window_limit(self, entries: np.ndarray, n: int) -> int:
        """The largest ``m <= n`` whose windowed pages ``[first(m), m)`` and sink pages ``[0,
        min(sink pages, first(m)))`` (TIER-3) all have slots."""
        if not self.windowed or not n:
            return n
        P = self.tokens_per_page
        runs = []  # per windowed group: length of the run of held pages ending at each page
        idx = np.arange(n)
        for g in self.windowed:
            held = self._slots[entries[:n], g] >= 0
            # run[i] = i + 1 - (index of the last page <= i without a slot, + 1)
            last_gap = np.maximum.accumulate(np.where(held, -1, idx))
            from_start = int(np.argmin(held)) if not held.all() else n  # pages held from page 0
            sinks = lengths.sink_pages(self.groups[g].sinks, P)
            runs.append((self.groups[g].window, idx - last_gap, sinks, from_start))
        for m in range(n, 0, -1):
            if all(self._covered(m, *run) for run in runs):
                return m
        return 0

    def _covered(self, m: int, window: int, run: np.ndarray, sinks: int, from_start: int) -> bool:
        """Whether a windowed group holds what a cache of ``m`` pages needs: pages ``[first,
        m)`` (``run``: the run of held pages ending at each page) and its sink pages below
        ``first`` (``from_start``: the pages held from page 0 on)."""
        P = self.tokens_per_page
        first = min(lengths.first_live_page(m * P, P, window), m)
        return run[m - 1] >= m - first and min(sinks, first) <= from_start

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
    def commit(self, ids: np.ndarray, pages: int, rows: np.ndarray, live: list) -> int:
        """Commit pages ``[0, pages)`` of ``ids`` (int64) held by a cache whose page rows are
        ``rows`` (int32[G, max_pages], BAD where it holds no page: released pages between a
        windowed group's sink pages and its window, TIER-3) and live ranges ``live`` (per group
        [first live page, allocated pages)); returns the number of pages
        that took this cache's slots as new entries. A page whose key is taken by an entry of
        other ids (a key collision) ends the commit there: it and the pages after it stay
        private. Raises ValueError, changing nothing, when a page the cache holds is committed
        under other ids (the token ids disagree with the ones it was committed or shared
        with)."""
        if not pages:
            return 0
        G, P = len(self.groups), self.tokens_per_page
        cache_slots = np.full((pages, G), BAD, dtype=np.int32)
        for g in range(G):  # the sink pages below the live range included
            hi = min(live[g][1], pages)
            cache_slots[:hi, g] = rows[g, :hi]
        keys = self.keys(ids, pages).tolist()
        chain = self._chain(ids, keys)
        entries = np.full(pages, BAD, dtype=np.int64)
        entries[:len(chain)] = chain
        owners = np.full((pages, G), BAD, dtype=np.int64)
        for g, group in enumerate(self.groups):
            ok = cache_slots[:, g] >= 0
            owners[ok, g] = group.owner[cache_slots[ok, g]].astype(np.int64) - 1
        committed = owners >= 0
        wrong = committed & (owners != entries[:, None])
        if wrong.any():
            page = int(np.argmax(wrong.any(axis=1)))
            raise ValueError(
                f"commit: page {page} of this cache was committed or shared under other token ids "
                f"than token_ids[{page * P}:{(page + 1) * P}] give; pass the request's own "
                f"token ids")
        held = np.flatnonzero((cache_slots >= 0).any(axis=1))
        end = int(held[-1]) + 1 if len(held) else 0  # pages behind every window lead only
        created = 0
        # entries of these ids without any slot (kept for their children, or evicted) take
        # this cache's slots again
        revive = np.flatnonzero((self._slots[chain] < 0).all(axis=1)
                                & (cache_slots[:len(chain)] >= 0).any(axis=1))
        for i in revive.tolist():
            self._take_slots(int(chain[i]), cache_slots[i])
            created += 1
        for i in range(len(chain), end):  # new entries, page order (each the next's parent)
            if keys[i] in self._entry_of:
                break  # a key collision: this page and the pages after it stay private
            parent = int(entries[i - 1]) if i else BAD
            entries[i] = self._new_entry(keys[i], ids[i * P:(i + 1) * P], parent, cache_slots[i])
            created += int((cache_slots[i] >= 0).any())
        # pages already committed by another cache (equal content) stay private; an entry this
        # cache shares in every full-attention group takes the windowed slots it lacks
        shared = np.flatnonzero(entries >= 0)
        if self.full and self.windowed and len(shared):
            mine = np.zeros(pages, dtype=bool)
            mine[shared] = (self._slots[entries[shared]][:, self.full]
                            == cache_slots[shared][:, self.full]).all(axis=1)
            for g in self.windowed:
                fill = mine & (cache_slots[:, g] >= 0) & (owners[:, g] < 0)
                fill[shared] &= self._slots[entries[shared], g] < 0
                if fill.any():
                    self._slots[entries[fill], g] = cache_slots[fill, g]
                    owner = (entries[fill] + 1).astype(np.int32)
                    self.groups[g].owner[cache_slots[fill, g]] = owner
        self.touch(entries[entries >= 0])
        return created

    def _take_slots(self, e: int, slots: np.ndarray) -> None:
        self._slots[e] = slots
        for g, group in enumerate(self.groups):
            if slots[g] >= 0:
                group.owner[slots[g]] = e + 1

    def _new_entry(self, key: int, tokens: np.ndarray, parent: int, slots: np.ndarray) -> int:
        if self._free_entries:
            e = self._free_entries.pop()
        else:
            e = len(self._keys)
            if e == len(self._slots):
                self._grow(max(1024, 2 * e))
            self._keys.append(None)
        self._keys[e] = key
        self._entry_of[key] = e
        self._tokens[e] = tokens
        self._parent[e] = parent
        self._children[e] = 0
        if parent >= 0:
            self._children[parent] += 1
        self._take_slots(e, slots)
        return e

    def _grow(self, size: int) -> None:
        n = len(self._slots)
        for name, fill in (("_slots", BAD), ("_tokens", 0), ("_parent", BAD), ("_children", 0)):
            old = getattr(self, name)
            grown = np.full((size, *old.shape[1:]), fill, dtype=old.dtype)
            grown[:n] = old
            setattr(self, name, grown)

    # ---- eviction ----
    def evict(self, group) -> None:
        """Reclaim the least recently used cached slot of ``group`` (there must be one): a
        full-attention group's slot takes the entry's slots away; a windowed group's slot
        leaves the others."""
        slot = group.pop_lru()
        self.evicted_slots += 1
        logger.debug("prefix: evicted cached slot %d of pool group %d", slot, group.index)
        e = int(group.owner[slot]) - 1
        if group.window is None:
            self._drop_slots(e)
        else:
            group.uncommit(np.array([slot]))
            self._slots[e, group.index] = BAD
            if not (self._slots[e] >= 0).any():
                self._drop_slots(e)

    def _drop_slots(self, e: int) -> None:
        """Uncommit every slot of entry ``e``; remove it unless deeper entries name it."""
        for g, group in enumerate(self.groups):
            slot = int(self._slots[e, g])
            if slot >= 0:
                group.uncommit(np.array([slot]))
        self._slots[e] = BAD
        while e >= 0 and not self._children[e] and not (self._slots[e] >= 0).any():
            parent = int(self._parent[e])
            del self._entry_of[self._keys[e]]
            self._keys[e] = None
            self._parent[e] = BAD
            self._free_entries.append(e)
            if parent >= 0:
                self._children[parent] -= 1
            e = parent

    def stats(self) -> dict:
        q = self.queried_tokens
        return {"entries": self.entries, "queried_tokens": q, "matched_tokens": self.matched_tokens,
                "hit_rate": (self.matched_tokens / q) if q else 0.0,
                "evicted_slots": self.evicted_slots}
