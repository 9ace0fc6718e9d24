"""KVCacheManager: config -> storage -> caches and batches."""
from __future__ import annotations

import itertools
import logging
import weakref
from typing import Optional

import torch

from ._util import ceil_div, check_int, cite, refuse_during_capture, require_device
from .batch import Batch
from .cache import KVCache
from .config import CacheConfig
from .host_region import DEFAULT_CHUNK_BYTES, check_options, default_threads, resolve_numa
from .lengths import windowed_peak_pages
from .memory import BatchReserve, batch_reserve_bytes
from .prefix import token_array
from .request_table import RequestTable
from .storage import BufferInfo, HostOptions, Storage
from .telemetry import HostCounters, snapshot
from .tiers import DEFAULT_PIECE_BYTES, HostTier, check_piece_bytes
from .transfer import CacheRecord, import_record

logger = logging.getLogger(__name__)


class KVCacheManager:
    """Owns the storage of one config and creates the caches and batches that use it.

    The GPU and host budgets first reserve the memory of one batch of ``config.max_rows`` rows
    (``memory.batch_tensor_specs``: device tables, residency, cells; pinned staging); the pools
    get the rest (docs/DESIGN.md). Raises ``ValueError`` when a budget cannot hold one slot of
    each of its pool groups, and ``RuntimeError`` naming what is missing when the config's
    device cannot be used in this process (``torch_kvcm2.missing_for``: a CPU-only torch, an
    extension without CUDA kernels, no visible GPU), before anything is allocated.

    Host memory (docs/HOST_MEMORY.md): every pool in CPU memory is reserved as address space at
    start and committed ``host_chunk_bytes`` at a time as slots are first handed out (STO-6),
    populated on ``host_threads`` threads (default: the cores this process may use, at most 8)
    and, on CUDA, registered piece by piece as they are populated, and placed by ``numa``
    ("auto": the GPU's NUMA node, preferred; None: no policy; an int: bound strictly to that
    node) (STO-7). ``prefill_host_bytes`` commits that
    much of the host pools at start. ``host_huge_pages`` backs the region with transparent huge
    pages (faster first touch and registration, and GPU reads of host pages). ``close()`` releases it all (STO-9). ``_host_ops`` (tests
    only) replaces the region's system calls, to inject faults.

    ``host_tier_bytes`` (TIER-1, docs/DESIGN.md): that much of the host budget becomes the host
    tier of the dense pool groups (every tier the same number of slots, in the host region,
    committed on demand like the sparse pools), where ``KVCache.suspend(offload=True)`` moves a
    request's dense pages; the sparse pools get the rest. 0 (the default): no tier, and
    ``suspend()`` keeps dense pages on the GPU. Raises ValueError for a tier that cannot hold
    one slot of each dense pool group, that does not fit the host budget, for a config without
    dense pool groups, or with a host group. ``resume_piece_bytes`` (default 8 MiB, about one
    step's share of the host-to-device link): a resume copies the pages back in pieces of at
    most this many bytes, the first at ``resume`` and one per ``Batch.publish`` after
    (``KVCache.returning_bytes``); 0 copies them back whole at ``resume``.

    The interface its caches and batches share (not for callers): ``counts`` (the host counters
    ``metrics()`` reports, ``telemetry.HostCounters``), ``batches`` (the open batches, whose
    device counters it sums), ``reserve`` (the batch reserve), ``tier`` (the host tier's
    copies) and ``check_open(what)``.

    ``host_group`` (docs/TP.md): a ``torch.distributed`` process group of ranks on this host, or
    a ``tp.HostGroup`` over one (to set its timeout and flush split). Then construction is
    collective: the sparse pool groups live in one shared-memory region every rank maps (TP-1),
    slot allocation and commits are SPMD (TP-2), each rank flushes its share and
    ``Batch.sync`` orders the steps (TP-3), a rank that dies or leaves is reported (TP-4).
    """

    def __init__(self, config: CacheConfig, *, host_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 host_threads: Optional[int] = None, numa="auto", prefill_host_bytes: int = 0,
                 host_huge_pages: bool = True, host_group=None, host_tier_bytes: int = 0,
                 resume_piece_bytes: int = DEFAULT_PIECE_BYTES, _host_ops=None):
        if not isinstance(config, CacheConfig):
            raise TypeError(f"KVCacheManager needs a CacheConfig, got {type(config).__name__}")
        require_device(config.device, "KVCacheManager()")
        refuse_during_capture(config.device, "KVCacheManager()")
        self._closed = True  # until the storage exists: close() is a no-op
        host_threads = default_threads() if host_threads is None else host_threads
        check_options(host_chunk_bytes, host_threads)
        check_piece_bytes(resume_piece_bytes)
        numa_node, numa_strict = resolve_numa(numa, config.device)
        if not isinstance(host_huge_pages, bool):
            raise TypeError(f"host_huge_pages must be a bool, got {host_huge_pages!r}")
        host = HostOptions(host_chunk_bytes, host_threads, numa_node, numa_strict,
                           prefill_host_bytes, _host_ops, host_huge_pages, host_tier_bytes)
        self.config = config
        if host_group is not None:
            from .tp import HostGroup

            if not isinstance(host_group, HostGroup):
                host_group = HostGroup(host_group)
            if host_group.bound:
                raise RuntimeError("KVCacheManager: the host group already serves a manager; "
                                   "make one HostGroup per manager")
            if config.gpu_history_bytes:
                # each rank flushes its share of the buffers; a promotion copies every buffer
                raise ValueError("KVCacheManager: GPU-resident history (gpu_history_bytes) is "
                                 "not supported with a host group (TP) yet; set it to 0")
        self.host_group = host_group
        self.storage = Storage(config, host_group)
        self._reserve = batch_reserve_bytes(config, len(self.storage.groups))
        for medium in ("gpu", "host"):
            budget = getattr(config, f"{medium}_budget_bytes")
            if self._reserve[medium] > budget:
                raise ValueError(cite(
                    f"STO-4: the {medium} budget ({budget} bytes) is smaller than the memory of a "
                    f"batch of {config.max_rows} rows ({self._reserve[medium]} bytes)"))
        self.storage.allocate(self._reserve, host)
        # TIER-1: the copies to and from the host tier
        self.tier = HostTier(self.storage, resume_piece_bytes)
        self.reserve = BatchReserve(self._reserve)
        self.counts = HostCounters(config)  # what metrics() reports (telemetry.py)
        self.batches = weakref.WeakSet()  # open batches: their device counters
        self.requests = RequestTable(self)  # every open request's host state (API-1)
        self._ids = itertools.count()
        self._closed = False

    def create_cache(self, token_ids=None) -> KVCache:
        """A new request cache. Without ``token_ids``: empty (capacity 0, history 0). With the
        request's token ids (a list of ints, a CPU integer tensor or a numpy integer array;
        an int64 array or tensor avoids a conversion): its longest committed prefix of whole
        pages is shared (PFX-2, docs/PREFIX.md): the page lists point at the committed slots
        (one more reference each; nothing copied, nothing allocated), and ``history_length``,
        ``capacity``, the flushed watermark and ``cache.reused_tokens`` start at the shared
        length; the caller prefills only the rest. Sharing takes no pool memory, so it cannot
        fail for lack of it. Residency starts empty (PFX-6). Raises TypeError / ValueError
        for bad ``token_ids`` (wrong type or dtype, negative ids, more than
        ``max_tokens_per_row`` tokens), and RuntimeError with ``token_ids`` while the current
        CUDA stream is capturing, with nothing changed."""
        self.check_open("KVCacheManager.create_cache")
        if token_ids is None:
            return KVCache(self, next(self._ids))
        refuse_during_capture(self.config.device, "KVCacheManager.create_cache(token_ids)")
        ids = self._token_ids("create_cache", token_ids)
        prefix = self.storage.prefix
        pages, entries = prefix.match(ids, self.config.max_pages_per_row)
        cache = KVCache(self, next(self._ids))
        if pages:
            cache.reused_tokens = self.requests.start_shared(cache.slot, pages, entries)
        prefix.queries += 1
        prefix.queried_tokens += len(ids)
        prefix.matched_tokens += cache.reused_tokens
        return cache

    def match(self, token_ids) -> int:
        """How many tokens of ``token_ids`` ``create_cache(token_ids)`` would share now (a
        multiple of ``tokens_per_page``), changing nothing (not even recency). Same arguments
        and argument errors as ``create_cache``; allowed during stream capture (it only reads
        host state)."""
        self.check_open("KVCacheManager.match")
        ids = self._token_ids("match", token_ids)
        pages, _ = self.storage.prefix.match(ids, self.config.max_pages_per_row)
        return pages * self.config.tokens_per_page

    def _token_ids(self, what: str, token_ids):
        ids = token_array("token_ids", token_ids)
        if len(ids) > self.config.max_tokens_per_row:
            raise ValueError(f"{what}: token_ids has {len(ids)} tokens, more than "
                             f"max_tokens_per_row ({self.config.max_tokens_per_row})")
        return ids

    def import_cache(self, record: CacheRecord, token_ids=None) -> Optional[KVCache]:
        """A new, detached cache equal to the one ``record`` (``KVCache.export()``, perhaps from
        another manager or process) was made from (TIER-2): capacity = history = the record's,
        pages allocated in every pool group, every byte of ``[0, history)`` written to them and
        declared written (SAFE-2), residency empty; ready for ``Batch.add``. ``token_ids`` (else
        the record's, if any) are committed over the history's whole pages (PFX-1), so later
        requests here can share them. Returns None, with nothing changed, when the pools cannot
        supply the pages (``can_fit(record.history)`` says so beforehand). Raises ValueError
        naming the first mismatching field for a record of an incompatible config (see
        ``transfer.fingerprint``) or a history past ``max_tokens_per_row``, TypeError for a
        non-record, RuntimeError when closed or during stream capture."""
        return import_record(self, record, token_ids)

    def create_batch(self, max_rows=None) -> Batch:
        """Same as ``Batch(manager, max_rows)``."""
        self.check_open("KVCacheManager.create_batch")
        return Batch(self, max_rows)

    def buffer_view(self, layer: str, role: str, device_side: bool = True) -> torch.Tensor:
        """The pages of one buffer, ``uint8[num_slots*scale, chunks, P, B/chunks]``: page
        ``KVCache.host_pages(layer, role)[p]`` holds a request's tokens ``[p*P, (p+1)*P)``, token
        ``t`` at ``[.., :, t % P]`` (the same layout as a cell). ``device_side`` picks the tensor
        ops see (on CUDA, for a sparse buffer, the device-mapped view of the host pages) over the
        host tensor itself. The address never changes."""
        return self.storage.view(layer, role, device_side)

    def buffer(self, layer: str, role: str) -> BufferInfo:
        """Everything a kernel needs to find one buffer (``storage.BufferInfo``): its pool group
        (the index of ``Batch.page_tables`` and ``KVCache.pages``; None for a zero-size buffer),
        its page position in a slot, the slot's pages (``scale``), its medium and page layout,
        and the selection group of a sparse layer. With ``buffer_view`` (the pages),
        ``slot_pages``, ``Batch.page_table`` and ``Batch.cells`` it is the public way to the
        memory; nothing outside the library needs the storage. Raises KeyError for an unknown
        buffer."""
        self.check_open("KVCacheManager.buffer")
        return self.storage.info(layer, role)

    def slot_pages(self, layer: str, role: str, device_side: bool = True) -> torch.Tensor:
        """The buffer's pages indexed by slot id (``KVCache.pages`` entries): ``uint8[num_slots,
        chunks, P, B/chunks]``, a strided view of its pool group's memory; ``device_side`` as
        for ``buffer_view``. Raises KeyError for an unknown or zero-size buffer."""
        self.check_open("KVCacheManager.slot_pages")
        info = self.storage.info(layer, role)
        if info.pool_group is None:
            raise KeyError(f"buffer {role!r} of layer {layer!r} is zero-size: it has no pages")
        return self.storage.slot_pages(layer, role, device_side)

    def pool(self, group: int, device_side: bool = True) -> torch.Tensor:
        """Pool group ``group``'s memory, ``uint8[committed slots, scale, page_bytes]``: the
        slots handed out so far and those before them (a host group's reservation beyond is
        not memory yet). ``device_side`` as for ``buffer_view``. For tools that fill or check a
        whole pool; a buffer's pages are ``buffer_view``."""
        self.check_open("KVCacheManager.pool")
        groups = self.storage.groups
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < len(groups):
            raise KeyError(f"pool group must be an index in [0, {len(groups)}), got {group!r}")
        g = groups[group]
        return (g.device_data if device_side else g.data)[:g.committed_slots]

    @property
    def pool_groups(self) -> int:
        """How many pool groups the config's buffers form (STO-1)."""
        return len(self.storage.groups)

    def stats(self) -> dict:
        """Pool usage per pool group and per medium, plus the batch reserve in use (STO-4);
        per group used / shared / cached / free slots (PFX-4); ``stats()["host_region"]``:
        reserved, committed, registered and used bytes of the host region (None without pools
        in CPU memory); ``stats()["prefix"]``: committed entries, the tokens
        ``create_cache(token_ids)`` was asked for and shared, and their ratio (``hit_rate``).
        Per dense group ``host_tier`` (TIER-1; None without a tier): slots, used / free slots
        and bytes, committed bytes; ``stats()["host"]`` counts the tiers in its used, free and
        committed bytes and gives ``host_tier_bytes`` and ``host_tier_used_bytes``."""
        self.check_open("KVCacheManager.stats")
        stats = self.storage.stats()
        for medium in ("gpu", "host"):
            stats[medium]["batch_bytes_in_use"] = self.reserve.in_use[medium]
        return stats

    # ---- admission and lifetime (STO-8, STO-9) ----
    def can_fit(self, tokens: int, count: int = 1, *, resuming=(),
                prefill_chunk: Optional[int] = None) -> bool:
        """Whether ``count`` new requests of ``tokens`` tokens each fit the pools now, changing
        nothing (STO-8). A request of ``tokens`` tokens needs ``ceil(tokens / P)`` pages in every
        pool group: its prefill allocates the whole prompt's pages before history advances, so a
        windowed group releases the pages behind its window only afterwards. Free slots include
        those in chunks not committed yet: a commit that then fails for lack of memory makes
        ``resize`` return False. Cached pages (committed, unreferenced: PFX-4) count as free,
        since allocation evicts them when it needs their slots. ``resuming``: suspended caches
        whose pages in the host tier (TIER-1) must come back to the GPU pools too
        (``KVCache.offloaded_pages``): with ``tokens=0`` it says whether ``resume()`` can bring
        them back; with ``tokens`` and ``count=1``, whether the first step after a resume can
        also grow by ``tokens`` (``ceil(tokens / P)`` pages per pool group, at least what the
        growth takes). ``prefill_chunk``: the prompt is prefilled in chunks of at most that many
        tokens with history advancing after each (and each step's resize before the publish
        that releases pages behind the window), so a windowed group holds at most its sink
        pages and the pages of ``window + 2 * prefill_chunk`` tokens (the window, the last
        chunk not yet released, the chunk being allocated; ``windowed_peak_pages``) rather than
        the whole prompt's."""
        self.check_open("KVCacheManager.can_fit")
        tokens, count = check_int("tokens", tokens), check_int("count", count)
        config = self.config
        if tokens > config.max_tokens_per_row:
            raise ValueError(f"can_fit: tokens ({tokens}) exceeds max_tokens_per_row "
                             f"({config.max_tokens_per_row})")
        whole = ceil_div(tokens, config.tokens_per_page)
        if prefill_chunk is not None:
            prefill_chunk = check_int("prefill_chunk", prefill_chunk)
        pages = [count * (whole if prefill_chunk is None or not group.window else
                          min(whole, windowed_peak_pages(group.window, group.sinks,
                                                         prefill_chunk, config.tokens_per_page)))
                 for group in self.storage.groups]
        for cache in resuming:
            if not isinstance(cache, KVCache) or cache.manager is not self:
                raise ValueError("can_fit: resuming must hold caches of this manager")
            pages = [p + n for p, n in zip(pages, cache.offloaded_pages())]
        if any(n > group.free_slots + group.cached_slots
               for n, group in zip(pages, self.storage.groups)):
            self.counts.admissions_refused += 1
            logger.debug("can_fit: %d request(s) of %d tokens refused (%s pages per pool group "
                         "needed)", count, tokens, pages)
            return False
        return True

    def metrics(self) -> dict:
        """OBS-1: counters since the manager started and gauges now, as a plain dict (schema in
        docs/METRICS.md), without a host synchronisation: device counters come from each open
        batch's newest read-back of its lengths that has arrived (queued by every ``advance``
        or ``record_advance``), so they lag the device by at most ``memory.READBACKS`` (4)
        advances plus the steps since the last one; closed batches keep their final counts.

        ``selection_groups[name]``: ``hits``, ``misses``, ``invalid`` and ``fetched_bytes``
        (misses x the group's bytes per unit over its layers' sparse buffers);
        ``flushed_bytes`` (device to host: tokens the write watermark passed beyond the
        declared range, x the bytes per token of every sparse buffer this rank flushes);
        ``host_direct_bytes`` (declared host-direct writes); ``prefix``: ``queries``,
        ``queried_tokens``, ``hit_tokens``, ``evicted_slots``; ``admissions_refused``
        (``can_fit`` False), ``preemptions`` (suspend), ``offloads`` (suspends that moved dense
        pages to the host tier, TIER-1), ``resumes``, ``aborts`` (in-flight
        tokens dropped by close or a discarding remove), ``allocations_failed`` (a resize or
        reserve top-up the pools could not supply, an offload or resume the host tier or the GPU
        pools could not); ``advance``: ``refused_rows``,
        ``short_rows``. Gauges: ``pool_groups`` (per pool group ``index``, ``medium``,
        ``used_bytes``, ``cached_bytes``, ``total_bytes``, ``committed_bytes``), ``media``
        (the same summed per medium, plus ``batch_bytes`` of the batch reserve in use),
        ``cached_prefix_bytes``, ``rows``: ``seated``, ``suspended``."""
        self.check_open("KVCacheManager.metrics")
        return snapshot(self)

    def check_ranks(self, *batches) -> None:
        """TP-2 debug check (collective over the host group; every rank passes its batches in
        the same order): compares across ranks each pool group's allocation state (slots handed
        out, free list, committed bytes, page reference counts, cached prefix pages) and each
        given batch's host tables (page tables,
        lengths); raises ``tp.RankDivergence`` naming the first that differs. First raises
        RuntimeError when the group's header records a failed rank (TP-4). Without a host group
        it does nothing."""
        self.check_open("KVCacheManager.check_ranks")
        group = self.host_group
        if group is None:
            return
        group.raise_on_failure("KVCacheManager.check_ranks")
        from .tp import digest

        entries = []
        for g in self.storage.groups:
            entries.append((f"pool group {g.index} ({g.medium})",
                            digest(g.num_slots, *g.free_state(), g.committed_bytes,
                                   g.refs, g.cached_slots)))
        for i, batch in enumerate(batches):
            batch.poll()
            tables = batch.host_tables()
            for g in range(tables["page_tables"].shape[0]):
                entries.append((f"batch {i} page table of pool group {g}",
                                digest(tables["page_tables"][g])))
            entries.append((f"batch {i} lengths", digest(tables["lengths"])))
        group.check(entries)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release every registration and mapping of the pools (STO-9; idempotent). Afterwards
        the manager, its caches and its batches raise RuntimeError; tensors taken from them
        before must not be used. Garbage collection of an unclosed manager releases the host
        region too."""
        if self._closed:
            return
        refuse_during_capture(self.config.device, "KVCacheManager.close")
        self._closed = True
        self.tier.close()  # copies to or from the host tier still running
        self.storage.close()

    def check_open(self, what: str) -> None:
        """RuntimeError once the manager is closed; caches and batches call it too."""
        if self._closed:
            raise RuntimeError(f"{what}: the KVCacheManager is closed")
