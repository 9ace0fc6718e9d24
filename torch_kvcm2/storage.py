"""Storage (SPEC §4, STO-1..5): pool groups, their memory, budgets and slot allocation.

Buffers that share (life cycle, sparse, page bytes) are coalesced into one pool group whose slot
holds one page of each (STO-1). Dense groups live in GPU memory; sparse groups in host memory
that, on CUDA, is pinned and device-mapped and reaches ops only as a CUDA view (STO-2). On a CPU
device everything is CPU memory and the same code paths run.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional

import torch

from .config import CacheConfig, INT32_MAX


@dataclass(frozen=True)
class BufferPlace:
    """Where one buffer lives: its pool group (None for a zero-size buffer) and position."""

    layer: str
    role: str
    bytes_per_token: int
    chunks: int
    sparse: bool
    group: Optional[int]
    pos: int


class PoolGroup:
    """One memory region whose slots each hold ``scale`` coalesced buffer pages.

    ``data`` is ``uint8[num_slots, scale, page_bytes]`` in the group's medium (what the host
    writes through); ``device_data`` is what ops see (the UVA CUDA view of a host group on CUDA,
    else ``data`` itself). Both addresses are fixed for the manager's lifetime (STO-3).
    """

    def __init__(self, index: int, window: Optional[int], sparse: bool, page_bytes: int):
        self.index = index
        self.window = window
        self.sparse = sparse
        self.page_bytes = page_bytes
        self.buffers: list[tuple[str, str]] = []  # (layer, role) by pos
        self.num_slots = 0
        self.data: Optional[torch.Tensor] = None
        self.device_data: Optional[torch.Tensor] = None
        self._free: list[int] = []

    @property
    def scale(self) -> int:
        return len(self.buffers)

    @property
    def slot_bytes(self) -> int:
        return self.scale * self.page_bytes

    @property
    def medium(self) -> str:
        return "host" if self.sparse else "gpu"

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate_memory(self, num_slots: int, device: torch.device) -> None:
        self.num_slots = num_slots
        shape = (num_slots, self.scale, self.page_bytes)
        if self.sparse and device.type == "cuda":
            from .ops import uva_view  # CUDA builds only

            self.data = torch.zeros(shape, dtype=torch.uint8)
            self.device_data = uva_view(self.data)
        else:
            self.data = torch.zeros(shape, dtype=torch.uint8, device=device)
            self.device_data = self.data
        self._free = list(range(num_slots))  # already a heap

    def allocate(self, n: int) -> Optional[list[int]]:
        """``n`` slots, lowest free first (STO-5), or None with nothing taken."""
        if n > len(self._free):
            return None
        return [heapq.heappop(self._free) for _ in range(n)]

    def release(self, slots) -> None:
        for slot in slots:
            heapq.heappush(self._free, slot)


class Storage:
    """All pool groups of a config. Construction only groups the buffers; ``allocate`` sizes the
    groups from the budgets left after the given reserves and takes their memory."""

    def __init__(self, config: CacheConfig):
        self.config = config
        self.groups: list[PoolGroup] = []
        self.places: dict[tuple[str, str], BufferPlace] = {}
        keys: dict[tuple, PoolGroup] = {}
        P = config.tokens_per_page
        for layer in config.layers:
            for buf in layer.buffers:
                page_bytes = P * buf.bytes_per_token
                group, pos = None, 0
                if page_bytes:
                    key = (layer.window, buf.sparse, page_bytes)
                    if key not in keys:
                        keys[key] = PoolGroup(len(self.groups), *key)
                        self.groups.append(keys[key])
                    group_obj = keys[key]
                    pos = group_obj.scale
                    group_obj.buffers.append((layer.name, buf.role))
                    group = group_obj.index
                self.places[(layer.name, buf.role)] = BufferPlace(
                    layer.name, buf.role, buf.bytes_per_token, buf.chunks, buf.sparse, group, pos
                )
        self.budget = {"gpu": config.gpu_budget_bytes, "host": config.host_budget_bytes}
        self.reserved = {"gpu": 0, "host": 0}

    def allocate(self, reserved: dict) -> None:
        """Size every pool group and take its memory; raises ValueError (nothing allocated) when
        a medium's budget minus ``reserved[medium]`` cannot hold one slot of each of its groups."""
        self.reserved = dict(reserved)
        slots = {m: self._slots_for(m) for m in ("gpu", "host")}
        for group in self.groups:  # every medium validated: allocate only now
            group.allocate_memory(slots[group.medium], self.config.device)

    def _slots_for(self, medium: str) -> int:
        groups = [g for g in self.groups if g.medium == medium]
        if not groups:
            return 0
        available = self.budget[medium] - self.reserved[medium]
        per_slot = sum(g.slot_bytes for g in groups)
        slots = max(available, 0) // per_slot
        if slots == 0:
            raise ValueError(
                f"STO-4: the {medium} budget ({self.budget[medium]} bytes, {self.reserved[medium]} "
                f"reserved for batch tables and staging) cannot hold one slot of each of its "
                f"{len(groups)} pool groups ({per_slot} bytes)"
            )
        # Page and token indices of views are int32: cap the slot count so none can overflow.
        limit = INT32_MAX // (max(g.scale for g in groups) * self.config.tokens_per_page)
        return min(slots, limit)

    # ---- views ----
    def place(self, layer: str, role: str) -> BufferPlace:
        try:
            return self.places[(layer, role)]
        except KeyError:
            raise KeyError(f"unknown buffer {role!r} of layer {layer!r}") from None

    def _page_layout(self, place: BufferPlace) -> tuple[int, int, int]:
        return (place.chunks, self.config.tokens_per_page, place.bytes_per_token // place.chunks)

    def view(self, layer: str, role: str, device_side: bool = True) -> torch.Tensor:
        """The buffer's view ``[num_slots*scale, chunks, P, B/chunks]`` (uint8); page index of slot
        ``s`` is ``s*scale + pos`` (STO-3). ``device_side`` picks the tensor ops see (the UVA view
        for host groups on CUDA) over the host tensor."""
        place = self.place(layer, role)
        if place.group is None:
            return torch.empty((0, *self._page_layout(place)), dtype=torch.uint8,
                               device=self.config.device)
        group = self.groups[place.group]
        data = group.device_data if device_side else group.data
        return data.view(group.num_slots * group.scale, *self._page_layout(place))

    def pool(self, layer: str, role: str, device_side: bool = True) -> tuple[torch.Tensor, int]:
        """``(data, pos)``: the buffer's pool group memory ``uint8[num_slots, scale, page_bytes]``
        and the buffer's position in a slot, as ``fetch`` and ``flush`` take them (the whole pool,
        never a per-buffer view: views of one pool would alias each other inside a compiled
        step). Page of slot ``s``: ``data[s, pos]``."""
        place = self.place(layer, role)
        if place.group is None:
            raise KeyError(f"buffer {role!r} of layer {layer!r} is zero-size: it has no pages")
        group = self.groups[place.group]
        return (group.device_data if device_side else group.data), place.pos

    def slot_pages(self, layer: str, role: str, device_side: bool = True) -> torch.Tensor:
        """The buffer's pages indexed by slot id: ``[num_slots, chunks, P, B/chunks]``, a strided
        view (slot stride = the group's slot bytes), for reading and writing pages by slot."""
        place = self.place(layer, role)
        group = self.groups[place.group]
        data = group.device_data if device_side else group.data
        return data[:, place.pos].view(group.num_slots, *self._page_layout(place))

    # ---- accounting ----
    def stats(self) -> dict:
        """Used/free bytes and slots per pool group and per medium (STO-4)."""
        groups = []
        media = {m: {"budget_bytes": self.budget[m], "reserved_bytes": self.reserved[m],
                     "used_bytes": 0, "free_bytes": 0} for m in ("gpu", "host")}
        for g in self.groups:
            used = g.num_slots - g.free_slots
            groups.append({
                "index": g.index, "medium": g.medium, "window": g.window, "sparse": g.sparse,
                "page_bytes": g.page_bytes, "scale": g.scale, "buffers": list(g.buffers),
                "slots": g.num_slots, "used_slots": used, "free_slots": g.free_slots,
                "used_bytes": used * g.slot_bytes, "free_bytes": g.free_slots * g.slot_bytes,
            })
            media[g.medium]["used_bytes"] += used * g.slot_bytes
            media[g.medium]["free_bytes"] += g.free_slots * g.slot_bytes
        return {"pool_groups": groups, **media}
