"""Streams with a compression rate (STR-1, STR-2; docs/DESIGN.md "Streams with a compression
rate"): a request that owns several streams growing at different rates.

A stream of rate r holds one *entry* per r tokens, written when an r-token window closes
(DeepSeek-V4: compressed sparse attention at r = 4, heavily compressed attention at r = 128;
the raw tokens and the compressor's per-token projections at r = 1). Its length is derived from
the request's token count, never set on its own:

* history ``floor(h / r) * r`` tokens: the closed windows' entries;
* capacity ``floor(h / r) * r`` while nothing is in flight, else ``max(floor(c / r), floor(h /
  r) + 1) * r``: the entries of the windows the step's tokens close, and at least the open
  window's entry, which is in flight (its cell or page is reserved) until the token that
  closes it arrives.

An entry of rate r is stored as r token rows of ``entry_bytes / r`` bytes each, so lengths,
pages, flush, export and admission all count *tokens* exactly as for a rate-1 stream, and an
entry is one unit (``SparseSpec.tokens_per_unit = r``) of a sparse stream: resolve selects
entries, a cell slot holds one, and its r rows are written together when its window closes
(the in-flight unit) and flushed together when history passes them.

One ``KVCacheManager`` per rate (as a hybrid allocator keeps one KV-cache group per spec): its
config lists the layers of that rate, each with its buffers' bytes per token row. ``StreamSet``
holds the managers, ``StreamRequest`` a request's cache in each and ``StreamBatch`` a batch in
each, with the same row for a request in every one; their methods take and report the request's
*token* lengths and derive each stream's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np
import torch

from .batch import Batch
from .config import CacheConfig
from .manager import KVCacheManager
from .transfer import CacheRecord


def stream_history(history: int, rate: int) -> int:
    """Tokens of a rate-``rate`` stream's closed windows at a request history of ``history``."""
    return history // rate * rate


def stream_capacity(history: int, capacity: int, rate: int) -> int:
    """A rate-``rate`` stream's capacity for request lengths (``history``, ``capacity``): its
    history while nothing is in flight, else through the windows the tokens up to ``capacity``
    close and at least the open window (module docstring)."""
    if capacity <= history:
        return stream_history(history, rate)
    return max(capacity // rate, history // rate + 1) * rate


def stream_peak(tokens: int, rate: int) -> int:
    """The most tokens a rate-``rate`` stream holds for a request of ``tokens`` tokens: its
    last step's capacity, ``ceil(tokens / r) * r`` (the open window's entry in flight)."""
    return -(-tokens // rate) * rate


def stream_max_tokens(max_tokens_per_row: int, rate: int) -> int:
    """The ``max_tokens_per_row`` a rate-``rate`` stream's config needs for requests of up to
    ``max_tokens_per_row`` tokens (its open window's entry can reach one window past them)."""
    return (max_tokens_per_row // rate + 1) * rate if rate > 1 else max_tokens_per_row


def _check_configs(configs: Mapping[int, CacheConfig]) -> dict:
    if not isinstance(configs, Mapping) or not configs:
        raise ValueError("StreamSet: configs must map each rate to a CacheConfig")
    rates = sorted(configs)
    if 1 not in rates:
        raise ValueError("STR-1: a StreamSet needs a rate-1 stream (the request's tokens, whose "
                         "lengths every other stream derives from)")
    base = configs[1]
    for rate in rates:
        config = configs[rate]
        if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
            raise ValueError(f"STR-1: a rate must be a positive int, got {rate!r}")
        if not isinstance(config, CacheConfig):
            raise TypeError(f"StreamSet: configs[{rate}] must be a CacheConfig")
        if config.device != base.device:
            raise ValueError(f"StreamSet: every stream's device must be {base.device}, "
                             f"configs[{rate}] has {config.device}")
        if config.max_rows != base.max_rows:
            raise ValueError(f"StreamSet: every stream's max_rows must be {base.max_rows}, "
                             f"configs[{rate}] has {config.max_rows}")
        if rate == 1:
            continue
        if config.tokens_per_page % rate:
            raise ValueError(f"STR-1: stream rate {rate}: tokens_per_page "
                             f"({config.tokens_per_page}) must be a multiple of the rate (an "
                             f"entry's {rate} token rows on one page)")
        need = stream_max_tokens(base.max_tokens_per_row, rate)
        if config.max_tokens_per_row < need:
            raise ValueError(f"STR-1: stream rate {rate}: max_tokens_per_row must be at least "
                             f"{need} for requests of {base.max_tokens_per_row} tokens "
                             f"(stream_max_tokens), got {config.max_tokens_per_row}")
        for layer in config.layers:
            sp = layer.sparse
            if layer.sparse_buffers and (sp.tokens_per_unit != rate
                                         or sp.max_inflight_tokens < rate):
                raise ValueError(f"STR-1: stream rate {rate}: sparse layer {layer.name!r} needs "
                                 f"tokens_per_unit = {rate} (one entry per unit) and "
                                 f"max_inflight_tokens >= {rate}, got {sp.tokens_per_unit} and "
                                 f"{sp.max_inflight_tokens}")
            if layer.window is not None:
                raise ValueError(f"STR-1: stream rate {rate}: layer {layer.name!r} has a window; "
                                 f"windows are rate-1 streams")
    return {rate: configs[rate] for rate in rates}


@dataclass
class StreamRecord:
    """``StreamRequest.export()``: one ``CacheRecord`` per rate and the token history."""

    history: int
    records: dict

    @property
    def history_length(self) -> int:
        return self.history

    def save(self, path) -> None:
        """Write the record to ``path`` (plain data: ``CacheRecord.as_dict`` per rate)."""
        torch.save({"format": "torch_kvcm2.stream_set", "history": self.history,
                    "records": {rate: r.as_dict() for rate, r in self.records.items()}}, path)

    @classmethod
    def load(cls, path) -> "StreamRecord":
        """Read a record ``save`` wrote (no code runs); ValueError for anything else."""
        data = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(data, dict) or data.get("format") != "torch_kvcm2.stream_set":
            raise ValueError(f"StreamRecord.load: {path} is not a torch_kvcm2.stream_set file")
        return cls(data["history"], {rate: CacheRecord.from_dict(r, f"{path} (rate {rate})")
                                     for rate, r in data["records"].items()})


class StreamSet:
    """One ``KVCacheManager`` per rate (``configs``: rate -> ``CacheConfig``, rate 1 required);
    ``host_tier_bytes`` goes to each manager. The manager-like face of a request with several
    streams: ``can_fit``, ``create_cache``, ``import_cache``, ``metrics``, ``close``."""

    def __init__(self, configs: Mapping[int, CacheConfig], *, host_tier_bytes: int = 0):
        configs = _check_configs(configs)
        self.rates = tuple(configs)
        self.managers = {}
        try:
            for rate, config in configs.items():
                self.managers[rate] = KVCacheManager(config, host_tier_bytes=host_tier_bytes)
        except Exception:
            self.close()
            raise
        self.config = configs[1]
        self.page_lcm = math.lcm(*(c.tokens_per_page for c in configs.values()))

    @property
    def max_tokens_per_row(self) -> int:
        return self.config.max_tokens_per_row

    def can_fit(self, tokens: int, count: int = 1, *,
                prefill_chunk: Optional[int] = None) -> bool:
        """Whether ``count`` new requests of ``tokens`` tokens fit every stream's pools now
        (``KVCacheManager.can_fit`` with the most each stream holds, ``stream_peak``;
        ``prefill_chunk``: a windowed stream counts its peak during a chunked prefill, not the
        whole prompt). A refusal is counted by the stream that refused."""
        return all(manager.can_fit(stream_peak(tokens, rate), count,
                                   prefill_chunk=prefill_chunk)
                   for rate, manager in self.managers.items())

    def match(self, token_ids) -> int:
        """Tokens of ``token_ids`` every stream would share now (STR-2, PFX-2): the shortest
        committed prefix over the streams, cut to a whole page of every stream (their page
        sizes may differ). A page boundary of a rate-r stream closes every window (its
        ``tokens_per_page`` is a multiple of r), so each stream shares exactly the entries of
        those tokens."""
        step = self.page_lcm
        shared = min(manager.match(token_ids) for manager in self.managers.values())
        shared = shared // step * step
        # a windowed stream matches only a prefix whose window pages were committed and are
        # still held (PFX-5), so a shorter cut may not match there: step back to one that does
        while shared and any(m.match(token_ids[:shared]) < shared
                             for m in self.managers.values()):
            shared -= step
        return shared

    def create_cache(self, token_ids=None) -> "StreamRequest":
        """A new request; with ``token_ids``, its longest prefix every stream has committed is
        shared in each (``KVCacheManager.create_cache``), and ``reused_tokens`` says how many
        tokens that is. The rate-1 stream's windowed layers hold the window and the compressor's
        per-token projections, so a sharer continues with nothing to recompute."""
        if token_ids is None:
            return StreamRequest(self, {rate: m.create_cache() for rate, m in
                                        self.managers.items()})
        shared = self.match(token_ids)
        ids = token_ids[:shared]
        caches = {rate: m.create_cache(ids) if shared else m.create_cache()
                  for rate, m in self.managers.items()}
        request = StreamRequest(self, caches)
        got = [cache.history_length for cache in caches.values()]
        if any(n != shared for n in got):  # match() checked each stream: not expected
            request.close()
            raise RuntimeError(f"StreamSet.create_cache: the streams shared {got} tokens, not "
                               f"{shared} each")
        return request

    def import_cache(self, record: StreamRecord) -> Optional["StreamRequest"]:
        """A request equal to the one ``record`` was exported from, or None (nothing kept)
        when a stream's pools cannot take it."""
        if not isinstance(record, StreamRecord) or set(record.records) != set(self.rates):
            raise ValueError(f"StreamSet.import_cache: a StreamRecord of rates {self.rates} "
                             f"expected")
        caches = {}
        for rate, manager in self.managers.items():
            cache = manager.import_cache(record.records[rate])
            if cache is None:
                for made in caches.values():
                    made.close()
                return None
            caches[rate] = cache
        return StreamRequest(self, caches)

    def metrics(self) -> dict:
        """The rate-1 manager's ``metrics()`` (docs/METRICS.md), with every stream's selection
        groups and its bytes flushed and written straight to host pages added in; each other
        stream's own under ``streams[rate]``."""
        m = self.managers[1].metrics()
        m["streams"] = {rate: self.managers[rate].metrics() for rate in self.rates if rate > 1}
        for sub in m["streams"].values():
            m["selection_groups"].update(sub["selection_groups"])
            for key in ("flushed_bytes", "host_direct_bytes", "admissions_refused",
                        "allocations_failed"):  # each counted by the stream it happened in
                m[key] += sub[key]
        return m

    def close(self) -> None:
        for manager in self.managers.values():
            manager.close()


class StreamRequest:
    """A request's cache in every stream. ``history_length`` and ``capacity`` are in tokens
    (the rate-1 stream's); ``capacity`` is -1 while a stream's lengths are not the ones these
    derive (an advance that was cut short at its pages), which makes a caller resize."""

    def __init__(self, streams: StreamSet, caches: dict):
        self.streams, self.caches = streams, caches

    @property
    def history_length(self) -> int:
        return self.caches[1].history_length

    @property
    def suspended(self) -> bool:
        return all(cache.suspended for cache in self.caches.values())

    @property
    def reused_tokens(self) -> int:
        """Tokens shared from committed pages when the request was created."""
        return self.caches[1].reused_tokens

    def commit(self, token_ids) -> int:
        """``KVCache.commit`` of every stream with the request's token ids from position 0
        (their whole pages within history): each stream offers the pages of those tokens.
        Returns the tokens committed in every stream."""
        ids = token_ids[:self.history_length]
        return min(cache.commit(ids) for cache in self.caches.values())

    @property
    def capacity(self) -> int:
        h, c = self.caches[1].history_length, self.caches[1].capacity
        for rate, cache in self.caches.items():
            if (cache.history_length != stream_history(h, rate)
                    or cache.capacity != stream_capacity(h, c, rate)):
                return -1
        return c

    def lengths(self, rate: int) -> tuple:
        cache = self.caches[rate]
        return cache.history_length, cache.capacity

    def resize(self, capacity: int) -> bool:
        """Every stream to the capacity derived from ``capacity`` tokens, each first dropping
        its unwritten in-flight range (``StreamBatch.resize_rows`` says why). False, with every
        stream at its history (nothing in flight), when a stream's pools cannot supply its
        pages; an error of a stream's lengths leaves them there too, then propagates."""
        h = self.history_length
        for rate, cache in self.caches.items():
            cache.resize(capacity=stream_history(h, rate))
        try:
            grown = all(cache.resize(capacity=stream_capacity(h, capacity, rate))
                        for rate, cache in self.caches.items())
        except Exception:
            grown = None
        if not grown:
            for rate, cache in self.caches.items():
                cache.resize(capacity=stream_history(h, rate))
            if grown is None:
                raise
        return bool(grown)

    def suspend(self, offload: Optional[bool] = None) -> bool:
        """``KVCache.suspend`` of every stream, after taking each stream's open window out of
        flight (nothing of it is written before its window closes)."""
        self.resize(capacity=self.history_length)
        done = []
        for cache in self.caches.values():
            if not cache.suspend(offload):
                if not all(other.resume() for other in done):
                    raise RuntimeError("StreamRequest.suspend: a stream refused and another "
                                       "could not be resumed again; close the request")
                return False
            done.append(cache)
        return True

    def resume(self) -> bool:
        """``KVCache.resume`` of every stream; False, every stream suspended again as it was
        (offloaded ones offloaded), when one cannot come back."""
        done = []
        for cache in self.caches.values():
            offloaded = cache.offloaded
            if not cache.resume():
                for other, was in done:
                    other.suspend(offload=was)
                return False
            done.append((cache, offloaded))
        return True

    def export(self) -> StreamRecord:
        self.resize(capacity=self.history_length)
        return StreamRecord(self.history_length,
                            {rate: cache.export() for rate, cache in self.caches.items()})

    def close(self) -> None:
        for cache in self.caches.values():
            cache.close()

    def __repr__(self):
        return (f"StreamRequest(history {self.history_length}, streams "
                f"{ {rate: self.lengths(rate) for rate in self.caches} })")


class StreamBatch:
    """A ``Batch`` per stream over a ``StreamSet``'s managers, a request at the same row in
    each. The batch-like face the models' generator uses: ``add``, ``remove``, ``members``,
    ``resize_rows`` (token capacities), ``publish``, ``finish_step`` (token counts),
    ``poll``, ``close``; ``batches[rate]`` is each stream's ``Batch``."""

    def __init__(self, streams: StreamSet, max_rows: Optional[int] = None):
        self.streams = streams
        self.batches = {rate: Batch(m, max_rows) for rate, m in streams.managers.items()}
        self.max_rows = self.batches[1].max_rows
        self.config = streams.config
        self._members: dict = {}

    def add(self, request: StreamRequest) -> int:
        rows = {rate: self.batches[rate].add(cache) for rate, cache in request.caches.items()}
        row = rows[1]
        if any(r != row for r in rows.values()):  # the batches' rows move in lockstep
            raise RuntimeError(f"StreamBatch.add: streams seated at different rows {rows}")
        self._members[row] = request
        return row

    def remove(self, request: StreamRequest, discard: bool = False) -> None:
        for rate, cache in request.caches.items():
            self.batches[rate].remove(cache, discard)
        self._members = {row: r for row, r in self._members.items() if r is not request}

    def members(self) -> dict:
        return dict(self._members)

    def resize_rows(self, rows, capacity) -> list:
        """``StreamRequest.resize`` of many rows: each stream's ``Batch.resize_rows`` with the
        capacities derived from the token ``capacity``; a row that fails in one stream is not
        grown in the later ones, and every stream of it is left at its history. Returns the
        rows that failed."""
        rows = list(rows)
        capacity = np.asarray(capacity, dtype=np.int64)
        history = np.array([self._members[row].history_length for row in rows], dtype=np.int64)
        moving = capacity > history
        failed = set()
        for rate, batch in self.batches.items():
            start = history // rate * rate
            target = np.where(moving, np.maximum(capacity // rate, history // rate + 1) * rate,
                              start)
            # Nothing of [history, capacity) is written between steps (the last step flushed
            # and advanced over what it wrote; an open window's entry is written only when it
            # closes), so every stream first drops it: growing past an in-flight range that
            # advance left (history + the step's width, cut at a page) would move the in-flight
            # start over tokens the write contract must assume are in cells (SAFE-1).
            batch.resize_rows(rows, capacity=start)
            live = [i for i, row in enumerate(rows) if row not in failed]
            failed.update(batch.resize_rows([rows[i] for i in live],
                                            capacity=target[live]))
        if failed:  # every stream of a failed row back at its history: a shrink, never refused
            back = [i for i, row in enumerate(rows) if row in failed]
            for rate, batch in self.batches.items():
                batch.resize_rows([rows[i] for i in back],
                                  capacity=history[back] // rate * rate)
        return sorted(failed)

    def publish(self) -> None:
        for batch in self.batches.values():
            batch.publish()

    def finish_step(self, history, accepted, host_writes: bool = False) -> None:
        """Each stream's ``Batch.finish_step`` with the tokens its history advances by:
        ``history`` and ``accepted`` int[max_rows] on the host, the rows' token histories
        before the step and the tokens each accepts."""
        history = np.asarray(history, dtype=np.int64)
        accepted = np.asarray(accepted, dtype=np.int64)
        device = self.config.device
        for rate, batch in self.batches.items():
            moved = (history + accepted) // rate * rate - history // rate * rate
            batch.finish_step(torch.from_numpy(moved.astype(np.int32)).to(device),
                              host_writes=host_writes)

    def poll(self) -> None:
        for batch in self.batches.values():
            batch.poll()

    def close(self, discard: bool = False) -> None:
        for batch in self.batches.values():
            batch.close(discard=discard)
