"""Moving a request between managers (REQUIREMENTS §16, TIER-2; docs/DESIGN.md).

``KVCache.export()`` copies a request's final tokens out of its manager into a
:class:`CacheRecord`: the config fields that give the bytes their meaning (the *fingerprint*),
the history length, optional token ids, and every buffer's pages of tokens ``[0, history)`` as
CPU uint8 tensors in the page layout ``[pages, chunks, P, B/chunks]``. ``KVCacheManager.
import_cache(record)`` builds an equal, detached cache in another manager whose config has the
same fingerprint: capacity = history = the record's, every byte on its own pages, the tokens
declared written (SAFE-2), ready for ``Batch.add``.

A record is plain data: ``save`` writes ints, strs, lists, dicts and tensors with
``torch.save``, and ``load`` reads them back with ``torch.load(weights_only=True)``, so a file
from elsewhere never runs code and no library object crosses processes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from . import lengths
from ._util import refuse_during_capture
from .config import BAD
from .prefix import token_array

FORMAT = "torch_kvcm2.CacheRecord"
VERSION = 2  # 2: sink pages (TIER-3)


def fingerprint(config) -> dict:
    """The fields of ``config`` an importing manager must match exactly: ``tokens_per_page``
    and, per layer in order, its name, window, sinks, the ``tokens_per_unit`` of its sparse settings
    (None for a dense layer) and its buffers' role, bytes_per_token, sparse flag and chunks.
    Budgets, ``max_rows``, the device and the other sparse settings (width, slots, in-flight
    tokens, query tokens, selection ids) shape cells and in-flight ranges, not history bytes:
    they may differ. ``max_tokens_per_row`` must only hold the record's history."""
    return {
        "tokens_per_page": config.tokens_per_page,
        "layers": [{
            "name": layer.name,
            "window": layer.window,
            "sinks": layer.sinks,
            "tokens_per_unit": None if layer.sparse is None else layer.sparse.tokens_per_unit,
            "buffers": [{"role": b.role, "bytes_per_token": b.bytes_per_token,
                         "sparse": b.sparse, "chunks": b.chunks} for b in layer.buffers],
        } for layer in config.layers],
    }


def first_mismatch(record: dict, target: dict) -> Optional[str]:
    """The first field where fingerprint ``record`` differs from ``target``, as a phrase
    ("layer 'l3' buffer 'kv' bytes_per_token 656 != 512"), or None when they agree."""
    if record["tokens_per_page"] != target["tokens_per_page"]:
        return f"tokens_per_page {record['tokens_per_page']} != {target['tokens_per_page']}"
    ours, theirs = record["layers"], target["layers"]
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a["name"] != b["name"]:
            return f"layer {i} name {a['name']!r} != {b['name']!r}"
        where = f"layer {a['name']!r}"
        for key in ("window", "sinks", "tokens_per_unit"):
            if a[key] != b[key]:
                return f"{where} {key} {a[key]} != {b[key]}"
        roles_a = [buf["role"] for buf in a["buffers"]]
        roles_b = [buf["role"] for buf in b["buffers"]]
        if roles_a != roles_b:
            return f"{where} buffers {roles_a} != {roles_b}"
        for x, y in zip(a["buffers"], b["buffers"]):
            for key in ("bytes_per_token", "sparse", "chunks"):
                if x[key] != y[key]:
                    return f"{where} buffer {x['role']!r} {key} {x[key]} != {y[key]}"
    if len(ours) != len(theirs):
        extra = ours[len(theirs)] if len(ours) > len(theirs) else theirs[len(ours)]
        return f"layer count {len(ours)} != {len(theirs)} (layer {extra['name']!r})"
    return None


@dataclass
class CacheRecord:
    """One request's final tokens, self-contained (TIER-2).

    ``fingerprint``: the exporting config's fields that must match (:func:`fingerprint`).
    ``history``: tokens ``[0, history)``, all final. ``token_ids``: int64[n] CPU tensor or None
    (whatever the caller passed to ``export``). ``pages[layer][role]``: uint8[n, chunks, P,
    B/chunks] CPU tensor: the layer's ``sink_pages[layer]`` sink pages (pages ``0 ..
    sink_pages - 1``, kept by a windowed layer with sink tokens, TIER-3; else none) at ``[0,
    sink_pages)``, then page ``first_page[layer] + i`` of the buffer at ``[sink_pages + i]`` (a
    windowed layer's pages behind its window are gone: its first live page; else 0), up to page
    ``ceil(history / P) - 1``; positions at and past ``history`` in the last page are zero.
    Zero-size buffers have no entry. Both page counts follow from the history and the config
    (``lengths.live_pages``); an importer checks them.
    """

    fingerprint: dict
    history: int
    pages: dict
    first_page: dict
    token_ids: Optional[torch.Tensor] = None
    version: int = field(default=VERSION)
    sink_pages: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of the pages the record carries."""
        return sum(t.numel() for roles in self.pages.values() for t in roles.values())

    def save(self, path) -> None:
        """Write the record to ``path`` (plain tensors, ints, strs, lists and dicts only)."""
        torch.save(self.as_dict(), path)

    def as_dict(self) -> dict:
        """The record as the plain dict ``save`` writes."""
        return {"format": FORMAT, "version": self.version, "fingerprint": self.fingerprint,
                "history": self.history, "pages": self.pages, "first_page": self.first_page,
                "sink_pages": self.sink_pages, "token_ids": self.token_ids}

    @classmethod
    def load(cls, path) -> "CacheRecord":
        """Read a record written by ``save`` (``torch.load(weights_only=True)``: no code runs).
        Raises ValueError for a file that is not a record of this format version."""
        return cls.from_dict(torch.load(path, map_location="cpu", weights_only=True), str(path))

    @classmethod
    def from_dict(cls, data, where: str = "the data") -> "CacheRecord":
        """The record ``as_dict`` gave; ValueError naming ``where`` for anything else."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"CacheRecord.load: {where} is not a {FORMAT} file")
        if data["version"] != VERSION:
            raise ValueError(f"CacheRecord.load: format version {data['version']} is not "
                             f"{VERSION}, the one this library reads")
        return cls(data["fingerprint"], data["history"], data["pages"], data["first_page"],
                   data["token_ids"], data["version"], data["sink_pages"])


def _synchronize(device: torch.device) -> None:
    """The host reads or writes pages that kernels on the current stream may still touch."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _buffers(config):
    """(layer, buffer) for every buffer that has pages."""
    return [(layer, buf) for layer in config.layers for buf in layer.buffers
            if buf.bytes_per_token]


def export_record(cache, token_ids=None) -> CacheRecord:
    """``KVCache.export`` (see there; it checked the cache is open)."""
    manager, config = cache.manager, cache.manager.config
    refuse_during_capture(config.device, "KVCache.export")
    ids = None if token_ids is None else torch.from_numpy(
        token_array("token_ids", token_ids).copy())
    h, c = cache.history_length, cache.capacity
    if h < c:
        raise RuntimeError(
            f"KVCache.export: tokens are in flight (history {h} < capacity {c}); only final "
            f"tokens travel: flush and advance history, or shrink capacity with "
            f"resize(capacity={h}), first")
    P = config.tokens_per_page
    end = -(-h // P)
    requests, slot = manager.requests, cache.slot
    requests.await_pages(slot)  # a resume's copy back from the host tier (TIER-1)
    _synchronize(config.device)
    pages, first_page, sink_pages = {}, {}, {}
    for layer, buf in _buffers(config):
        idx = cache.host_pages(layer.name, buf.role)[:end]
        place = manager.storage.place(layer.name, buf.role)
        tier = requests.tier_pages(slot, place.group)  # a suspended cache's pages in the host tier
        tier_idx = None
        if tier is not None:
            tier_data, tier_slots, event = tier
            if event is not None:
                event.synchronize()  # the copy to the host tier is done
            tier_slots = tier_slots[:end]
            tier_idx = np.where(tier_slots >= 0, tier_slots * tier_data.shape[1] + place.pos, BAD)
        held = idx >= 0 if tier_idx is None else (idx >= 0) | (tier_idx >= 0)
        sinks, first, _ = lengths.live_pages(h, end, P, layer.window, layer.sinks)
        first_page[layer.name], sink_pages[layer.name] = first, sinks
        ordinals = np.concatenate([np.arange(sinks), np.arange(first, end)]).astype(np.int64)
        if not held[ordinals].all() or held[sinks:first].any():
            raise AssertionError(f"export: layer {layer.name!r} holds other pages than its "
                                 f"sinks [0, {sinks}) and window [{first}, {end})")
        idx = idx[ordinals]
        view = manager.buffer_view(layer.name, buf.role, device_side=False)
        if tier_idx is None:
            data = view.index_select(0, torch.from_numpy(idx).to(view.device)).cpu()
        else:
            tier_idx = tier_idx[ordinals]
            data = torch.empty((len(ordinals), *view.shape[1:]), dtype=torch.uint8)
            on_gpu = np.flatnonzero(idx >= 0)
            if len(on_gpu):
                rows = torch.from_numpy(idx[on_gpu]).to(view.device)
                data[torch.from_numpy(on_gpu)] = view.index_select(0, rows).cpu()
            in_tier = np.flatnonzero(tier_idx >= 0)
            tier_view = tier_data.view(-1, *view.shape[1:])
            data[torch.from_numpy(in_tier)] = tier_view[torch.from_numpy(tier_idx[in_tier])]
        if h % P and len(data):
            data[-1, :, h % P:] = 0  # a recycled page's tail may hold another request's KV
        pages.setdefault(layer.name, {})[buf.role] = data
    for layer in config.layers:
        first_page.setdefault(layer.name, 0)
        sink_pages.setdefault(layer.name, 0)
    return CacheRecord(fingerprint(config), h, pages, first_page, ids, sink_pages=sink_pages)


def _check_record(manager, record: CacheRecord) -> None:
    """ValueError naming the first thing ``record`` disagrees with in ``manager``'s config."""
    config = manager.config
    mismatch = first_mismatch(record.fingerprint, fingerprint(config))
    if mismatch is not None:
        raise ValueError(f"import_cache: {mismatch}")
    h = record.history
    if isinstance(h, bool) or not isinstance(h, int) or h < 0:
        raise ValueError(f"import_cache: the record's history must be a non-negative int, got {h!r}")
    if h > config.max_tokens_per_row:
        raise ValueError(f"import_cache: history {h} exceeds max_tokens_per_row "
                         f"{config.max_tokens_per_row}")
    P = config.tokens_per_page
    end = -(-h // P)
    for layer, buf in _buffers(config):
        sinks, expected, _ = lengths.live_pages(h, end, P, layer.window, layer.sinks)
        first = record.first_page.get(layer.name)
        if first != expected:
            raise ValueError(f"import_cache: layer {layer.name!r} first page {first} != "
                             f"{expected} (its window's first live page at history {h})")
        if record.sink_pages.get(layer.name) != sinks:
            raise ValueError(f"import_cache: layer {layer.name!r} sink pages "
                             f"{record.sink_pages.get(layer.name)} != {sinks} (its sink pages "
                             f"at history {h})")
        data = record.pages.get(layer.name, {}).get(buf.role)
        shape = (sinks + end - first, buf.chunks, P, buf.bytes_per_token // buf.chunks)
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or \
                tuple(data.shape) != shape:
            got = None if not isinstance(data, torch.Tensor) else (data.dtype, tuple(data.shape))
            raise ValueError(f"import_cache: layer {layer.name!r} buffer {buf.role!r} pages "
                             f"must be uint8{list(shape)}, got {got}")


def import_record(manager, record: CacheRecord, token_ids=None):
    """``KVCacheManager.import_cache`` (see there)."""
    manager.check_open("KVCacheManager.import_cache")
    refuse_during_capture(manager.config.device, "KVCacheManager.import_cache")
    if not isinstance(record, CacheRecord):
        raise TypeError(f"import_cache needs a CacheRecord, got {type(record).__name__}")
    _check_record(manager, record)
    if token_ids is None:
        token_ids = record.token_ids
    ids = None if token_ids is None else token_array("token_ids", token_ids)
    if ids is not None and len(ids) > manager.config.max_tokens_per_row:
        raise ValueError(f"import_cache: token_ids has {len(ids)} tokens, more than "
                         f"max_tokens_per_row ({manager.config.max_tokens_per_row})")
    h = record.history
    cache = manager.create_cache()

    def write(cache) -> None:
        _synchronize(manager.config.device)  # recycled slots: a kernel may still use them
        for layer, buf in _buffers(manager.config):
            idx = cache.host_pages(layer.name, buf.role)
            sinks, first = record.sink_pages[layer.name], record.first_page[layer.name]
            idx = np.concatenate([idx[:sinks], idx[first:]])
            view = manager.buffer_view(layer.name, buf.role, device_side=False)
            source = record.pages[layer.name][buf.role].to(view.device)
            view.index_copy_(0, torch.from_numpy(idx).to(view.device), source)

    # pages for lengths (h, h), every byte of [0, h) written on them, and those tokens declared
    # written straight to host pages (what record_host_write declares; its bound, the in-flight
    # start, stops short of capacity, and an imported cache has nothing in flight)
    requests = manager.requests
    if requests.apply(cache.slot, h, h) is None:
        cache.close()  # it holds nothing; no one else has it
        return None
    try:
        write(cache)
    except BaseException:
        cache.close()
        raise
    requests.declare(cache.slot, h)
    if ids is not None:
        cache.commit(ids[:h])
    return cache
