"""The host tier of the dense pool groups (REQUIREMENTS §16, TIER-1; docs/DESIGN.md).

``KVCache.suspend(offload=True)`` moves a request's private dense pages (GPU pools) to host
pages of its pool group's host tier (``Storage.tiers``, in the host region) and frees the GPU
slots; ``KVCache.resume()`` moves them back into any free GPU slots. Pages more than one cache
references (shared prefix pages) stay where they are.

On CUDA every copy runs on the manager's copy stream (one side ``torch.cuda.Stream``), between
registered (pinned) host pages and the GPU pool, one ``copy_`` per run of consecutive slots on
both sides, cut where a registration of the host region starts (``copy_segments``), so the copy
engine moves whole runs of pinned memory. Ordering, with no host wait:

* before a copy the copy stream waits for an event recorded on the current stream, so an
  offload reads what the compute stream wrote and a resume overwrites slots only after the
  compute stream's last use of them;
* the GPU slots an offload frees are fenced with the event recorded after its copy: an
  allocation that hands one out makes the stream that will write it wait for that event
  (``PoolGroup.await_fences``), so the slots are free for the host at once and the compute
  stream waits only when it really reuses a slot before the copy ended;
* a resume's copy back (``Restore``) is kept by the request table (``RequestTable.arrival``); whatever next
  reads or frees its pages — the publish of its row, ``host_pages``, ``commit``, ``export``, a
  shrink, ``close`` — issues what is left of it and makes the current stream wait for its last
  event first (``RequestTable.await_pages``).

The copy back goes in pieces of at most ``piece_bytes`` (whole slots, at least one): the first
at ``resume``, then one per ``Batch.publish`` of any batch of the manager (``progress``), each
after the current stream's work queued so far, so a detached request coming back shares the
host-to-device link with one step's fetches per piece rather than with the whole copy. Tier
slots are written and read only by the copy stream (and by ``export``, after its event), so a
tier slot is released as soon as the piece reading it is queued. On a CPU device the copies are
plain synchronous copies, issued piece by piece the same way.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Optional

import numpy as np
import torch

from .config import BAD

#: bytes of one piece of a copy back (about one step's share of the host-to-device link)
DEFAULT_PIECE_BYTES = 8 << 20


def check_piece_bytes(piece_bytes) -> None:
    """ValueError unless ``piece_bytes`` (``resume_piece_bytes``) is a non-negative int."""
    if isinstance(piece_bytes, bool) or not isinstance(piece_bytes, int) or piece_bytes < 0:
        raise ValueError(f"resume_piece_bytes must be a non-negative int, got {piece_bytes!r}")


def slot_runs(src: np.ndarray, dst: np.ndarray) -> list:
    """``(src start, dst start, length)`` of the runs where both ``src`` and ``dst`` slot ids
    go up by one, covering the pairs ``src[i] -> dst[i]`` in order."""
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    if not len(src):
        return []
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(src)]])
    return [(int(src[a]), int(dst[a]), int(b - a)) for a, b in zip(starts.tolist(), ends.tolist())]


def copy_segments(gpu_slots, tier_slots, slot_bytes: int, base: int, starts: list) -> list:
    """``(GPU pool byte offset, tier byte offset, bytes)`` of the copies that move slots
    ``gpu_slots[i] <-> tier_slots[i]``: one per run of ``slot_runs``, cut wherever a
    registration of the host region starts (``starts``: sorted region offsets; the tier's byte
    0 is region offset ``base``), so no copy crosses two registrations."""
    out = []
    for g, t, n in slot_runs(gpu_slots, tier_slots):
        lo, hi = t * slot_bytes, (t + n) * slot_bytes
        edges = [lo]
        i = bisect_right(starts, base + lo)
        while i < len(starts) and starts[i] < base + hi:
            edges.append(starts[i] - base)
            i += 1
        edges.append(hi)
        out.extend((g * slot_bytes + a - lo, a, b - a) for a, b in zip(edges, edges[1:]))
    return out


class Offload:
    """A suspended cache's pages in the host tier: per dense pool group index, the page
    ordinals moved (int64) and the tier slot of each (int32); ``event`` is the CUDA event
    recorded after the copy to host (None on a CPU device)."""

    def __init__(self, ordinals: dict, tier_slots: dict, event):
        self.ordinals, self.tier_slots, self.event = ordinals, tier_slots, event

    @property
    def pages(self) -> int:
        return sum(len(o) for o in self.ordinals.values())

    def needs(self, num_groups: int) -> list:
        """GPU slots per pool group a resume takes."""
        return [len(self.ordinals.get(g, ())) for g in range(num_groups)]

    def tier_index(self, group: int, num_pages: int) -> np.ndarray:
        """int64[num_pages]: the tier slot of each page ordinal of ``group``, BAD elsewhere."""
        out = np.full(num_pages, BAD, dtype=np.int64)
        ordinals = self.ordinals.get(group)
        if ordinals is not None:
            out[ordinals] = self.tier_slots[group]
        return out


class Restore:
    """A resume's copy back from the host tier: per dense pool group index, the GPU slots and
    tier slots (int64, page order) of the pages whose copy is not issued yet; ``event`` is the
    CUDA event recorded after the last piece issued (None on a CPU device or before the first)."""

    def __init__(self, parts: dict):
        self.parts = {g: (gpu, tier) for g, (gpu, tier) in parts.items() if len(gpu)}
        self.event = None

    def pending_bytes(self, storage) -> int:
        """Bytes of the copy back not issued yet."""
        return sum(len(gpu) * storage.groups[g].slot_bytes for g, (gpu, _) in self.parts.items())

    def tier_slots(self, group: int) -> np.ndarray:
        """int64: the tier slots of ``group`` still holding pages of this copy (not issued)."""
        part = self.parts.get(group)
        return part[1] if part is not None else np.zeros(0, dtype=np.int64)

    def take(self, budget: Optional[int], storage, at_least_one: bool = True) -> list:
        """Remove and return the next piece: ``(group index, GPU slots, tier slots)`` of whole
        slots, pool group by pool group, of at most ``budget`` bytes (None: everything) and,
        with ``at_least_one``, at least one slot (a slot larger than the budget still moves)."""
        piece = []
        for g in list(self.parts):
            gpu, tier = self.parts[g]
            size = storage.groups[g].slot_bytes
            n = len(gpu) if budget is None else min(len(gpu), budget // size)
            if n == 0 and not piece and at_least_one:
                n = 1
            if n == 0:
                break
            piece.append((g, gpu[:n], tier[:n]))
            if n == len(gpu):
                del self.parts[g]
            else:
                self.parts[g] = (gpu[n:], tier[n:])
            if budget is not None:
                budget -= n * size
                if budget <= 0:
                    break
        return piece


class HostTier:
    """The copy side of TIER-1 for one manager: its copy stream, the two moves, and the copies
    back still to issue (``piece_bytes`` per piece; 0: each copy back whole, at ``resume``)."""

    def __init__(self, storage, piece_bytes: int = DEFAULT_PIECE_BYTES):
        check_piece_bytes(piece_bytes)
        self.storage = storage
        self.device = storage.config.device
        self.cuda = self.device.type == "cuda"
        self.piece_bytes = piece_bytes
        self._stream: Optional[torch.cuda.Stream] = None
        self._pending: list = []  # Restores with pieces not issued yet, oldest first

    @property
    def enabled(self) -> bool:
        """Whether the manager has a host tier (``host_tier_bytes`` > 0)."""
        return any(t is not None for t in self.storage.tiers)

    @property
    def stream(self) -> torch.cuda.Stream:
        """The copy stream (CUDA only), made at its first use."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def movable(self, pages: np.ndarray, held: list) -> dict:
        """Per dense pool group, the page ordinals an offload moves: every held page (``held``:
        per pool group, the ``[lo, hi)`` page ranges the cache holds, its sink pages included,
        TIER-3) no other cache references (refs == 1); shared prefix pages stay on the GPU."""
        moves = {}
        for group in self.storage.groups:
            if group.sparse:
                continue
            parts = [lo + np.flatnonzero(group.refs[pages[group.index, lo:hi]] == 1)
                     for lo, hi in held[group.index]]
            ordinals = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            if len(ordinals):
                moves[group.index] = ordinals.astype(np.int64)
        return moves

    def _after_current(self):
        """Make the copy stream wait for the work queued on the current stream so far."""
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(ready)

    def _copy(self, pairs: list, to_host: bool) -> Optional[torch.cuda.Event]:
        """Copy ``(GPU pool group, host tier group, GPU slots, tier slots)`` pairs to the host
        tier (``to_host``) or back: on CUDA on the copy stream, after the current stream's work,
        returning the event recorded after them; on a CPU device synchronously (None)."""
        if not self.cuda:
            self._copy_segments(pairs, to_host, [], False)
            return None
        with torch.cuda.device(self.device):
            self._after_current()
            with torch.cuda.stream(self.stream):
                self._copy_segments(pairs, to_host, self.storage.region.registration_starts(), True)
                done = torch.cuda.Event()
                done.record(self.stream)
        return done

    @staticmethod
    def _copy_segments(pairs: list, to_host: bool, starts: list, non_blocking: bool) -> None:
        for group, tier, gpu_slots, tier_slots in pairs:
            gpu, host = group.data.view(-1), tier.data.view(-1)
            for g, t, n in copy_segments(gpu_slots, tier_slots, group.slot_bytes,
                                         tier.region_offset, starts):
                if to_host:
                    host[t:t + n].copy_(gpu[g:g + n], non_blocking=non_blocking)
                else:
                    gpu[g:g + n].copy_(host[t:t + n], non_blocking=non_blocking)

    def offload(self, pages: np.ndarray, held: list) -> Optional[Offload]:
        """Copy the movable dense pages of a cache (its page rows ``pages`` and held page ranges
        ``held``, as ``movable`` takes them) to host tier slots, free their GPU slots (fenced by the copy's event) and set
        their page entries to BAD. None, with nothing changed, when a tier cannot take them."""
        storage = self.storage
        moves = self.movable(pages, held)
        if not moves:
            return Offload({}, {}, None)
        needs = [len(moves.get(g.index, ())) for g in storage.groups]
        taken = storage.allocate_tier_slots(needs)
        if taken is None:
            return None
        pairs, gpu_slots, tier_slots = [], {}, {}
        for index, ordinals in moves.items():
            slots = pages[index, ordinals].astype(np.int64)
            tier = np.asarray(taken[index], dtype=np.int64)
            gpu_slots[index], tier_slots[index] = slots, tier.astype(np.int32)
            pairs.append((storage.groups[index], storage.tiers[index], slots, tier))
        event = self._copy(pairs, to_host=True)
        for index, slots in gpu_slots.items():
            group = storage.groups[index]
            group.release(slots)
            if event is not None:
                group.fence_slots(slots, event)
            pages[index, moves[index]] = BAD
        return Offload(moves, tier_slots, event)

    def restore(self, offload: Offload, pages: np.ndarray) -> Optional[tuple]:
        """Allocate GPU slots (any free ones) for an offload's pages, write them into the page
        rows ``pages`` and issue the first piece of the copy back (``piece_bytes``; the rest
        follows at each ``progress`` or at ``complete``). Returns ``(Restore, groups whose
        entries changed)``, the Restore None when nothing moves; None, with nothing changed,
        when the GPU pools cannot supply the slots."""
        storage = self.storage
        if not offload.pages:
            return None, []
        writer = self.stream if self.cuda else None
        taken = storage.allocate_slots(offload.needs(len(storage.groups)), writer=writer)
        if taken is None:
            return None
        parts = {}
        for index, ordinals in offload.ordinals.items():
            slots = np.asarray(taken[index], dtype=np.int64)
            parts[index] = (slots, offload.tier_slots[index].astype(np.int64))
            pages[index, ordinals] = slots
        restore = Restore(parts)
        self._issue(restore, self.piece_bytes or None)
        if restore.parts:
            self._pending.append(restore)
        return restore, list(offload.ordinals)

    def progress(self) -> None:
        """Issue the next ``piece_bytes`` of the copies back still pending, oldest first (called
        by every ``Batch.publish``: one piece per step)."""
        budget, first = self.piece_bytes, True
        while self._pending and budget > 0:
            restore = self._pending[0]
            before = restore.pending_bytes(self.storage)
            # only the step's first piece may exceed the budget (a slot larger than it)
            if not self._issue(restore, budget, at_least_one=first):
                break
            first = False
            budget -= before - restore.pending_bytes(self.storage)
            if not restore.parts:
                self._pending.pop(0)

    def complete(self, restore: Restore):
        """Issue whatever is left of ``restore`` at once; returns its last event (None on a CPU
        device), which a reader of the pages waits for on its stream."""
        if restore.parts:
            self._issue(restore, None)
            self._pending.remove(restore)
        return restore.event

    def _issue(self, restore: Restore, budget: Optional[int], at_least_one: bool = True) -> bool:
        """Queue the next piece of ``restore`` (at most ``budget`` bytes, None: all of it) and
        release the tier slots it reads: later writers of them are on the copy stream too.
        False when the piece is empty (no slot fits the budget and none is forced)."""
        piece = restore.take(budget, self.storage, at_least_one)
        if not piece:
            return False
        pairs = [(self.storage.groups[g], self.storage.tiers[g], gpu, tier)
                 for g, gpu, tier in piece]
        event = self._copy(pairs, to_host=False)
        if event is not None:
            restore.event = event
        for g, _, tier in piece:
            self.storage.tiers[g].release(tier)
        return True

    def discard(self, offload: Offload) -> None:
        """Free an offload's tier slots (the cache closes while suspended). The copy stream is
        their only writer, so a copy still running into them is ordered before any reuse."""
        for index, tier_slots in offload.tier_slots.items():
            self.storage.tiers[index].release(tier_slots)

    def close(self) -> None:
        """Wait for the copies still running and drop the pieces not issued (the manager
        releases the host region next)."""
        self._pending.clear()
        if self._stream is not None:
            self._stream.synchronize()
