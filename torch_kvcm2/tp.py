"""Tensor-parallel ranks of one node sharing one host pool (REQUIREMENTS §14, TP-1..4; docs/TP.md).

A :class:`HostGroup` wraps a ``torch.distributed`` process group of ranks on one host. A manager
built with ``host_group=`` keeps its sparse pool groups in one shared-memory file that rank 0
creates in ``/dev/shm`` and every rank maps (``MAP_SHARED``) and, on CUDA, registers; the name
is unlinked as soon as every rank has mapped it, so nothing outlives the processes. Dense pools,
cells and device tables stay private to each rank.

The file ends with one page, the rank header (``csrc/rank_sync.h``): one generation counter
and one "left" flag per rank, and the failure record. ``signal`` then ``wait`` (``Batch.sync``,
once per step, after the previous flush and before the first fetch) are per-step ops on it, so
the ordering holds in eager code and inside captured CUDA graphs without any collective in the step. Collectives
(gloo, on CPU tensors) run only at construction, on commits (growth is all or nothing across
ranks) and in :meth:`check`.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import weakref
from typing import Optional

import torch

from . import ops
from ._util import outside_capture
from .host_region import HUGE_PAGE, PAGE_SIZE, HostRegion, round_up

#: The rank header's layout (mirrors csrc/rank_sync.h).
HEADER_WORDS = 512
MAX_WORLD = 64
MAGIC = 0x6B76636D32545031  # "kvcm2TP1"
_MAGIC, _WORLD, _FAILED, _FAIL_WAITER, _FAIL_MISSING, _FAIL_GEN, _FAIL_REASON, _FAIL_SEEN = range(8)
_COUNTERS, _LEFT = 16, 16 + MAX_WORLD
_REASONS = {1: "timeout", 2: "left"}
#: Bytes of the header at the end of the shared file (a whole page; the pools come first, so
#: they start huge-page aligned in the file as in memory).
HEADER_BYTES = round_up(HEADER_WORDS * 8, PAGE_SIZE)
SPLITS = ("layer", "pool_group")
SHM_DIR = "/dev/shm"


class RankDivergence(RuntimeError):
    """The ranks of a host group made different calls (``KVCacheManager.check_ranks``)."""


class HostGroup:
    """Ranks of one node sharing one host pool.

    ``group``: a ``torch.distributed`` process group (None: the default group) whose ranks all
    run on this host and build their managers from the same config, making the same calls in
    the same order (SPMD). When its backend is not gloo (NCCL, say), a gloo group of the same
    ranks is made for the host-side collectives; ``torch.distributed.new_group`` is collective
    over the default group, so then every process of the default group must build its manager
    at the same point.

    ``timeout_s``: how long ``wait`` lets a rank lag before it gives up (TP-4).
    ``split``: which rank flushes what (TP-3): "layer" (the ``i``-th layer of the config is
    flushed by rank ``i % world``) or "pool_group" (sparse pool group ``g`` by rank
    ``g % world``).
    """

    def __init__(self, group=None, *, timeout_s: float = 60.0, split: str = "layer"):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("HostGroup: torch.distributed is not initialised; call "
                               "init_process_group first")
        if group is None:
            group = dist.group.WORLD
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
                not 0 < timeout_s <= 3600:
            raise ValueError(f"timeout_s must be a number of seconds in (0, 3600], got "
                             f"{timeout_s!r}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.group, self.timeout_s, self.split = group, float(timeout_s), split
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("HostGroup: this process is not a member of the group")
        if self.world > MAX_WORLD:
            raise ValueError(f"HostGroup: at most {MAX_WORLD} ranks share a host pool, the "
                             f"group has {self.world}")
        if dist.get_backend(group) == "gloo":
            self.cpu_group = group
        else:
            self.cpu_group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo")
        self._src = dist.get_global_rank(self.cpu_group, 0)
        self.path: Optional[str] = None
        self.header_region: Optional[HostRegion] = None
        self.header: Optional[torch.Tensor] = None  # int64[512], host view
        self.header_device: Optional[torch.Tensor] = None  # what the ops take
        self.gen: Optional[torch.Tensor] = None  # int64[1] on the device: this rank's generation
        self.bound = False
        self.closed = False

    def __repr__(self):
        return (f"HostGroup(rank={self.rank}, world={self.world}, split={self.split!r}, "
                f"timeout_s={self.timeout_s})")

    # ---- construction (collective) ----
    def create_region(self, nbytes: int, torch_device: torch.device,
                      **region_kwargs) -> HostRegion:
        """The shared host region of ``nbytes`` (collective: every rank calls it with the same
        size). Rank 0 creates the file (region + header page, sparse: nothing allocated),
        every rank maps it, then the name is unlinked. ``region_kwargs`` go to
        :class:`HostRegion` (``device`` there is the CUDA index to register for, or None).
        Raises ValueError (on every rank) when the ranks' sizes differ or
        a rank cannot create or map the file."""
        import torch.distributed as dist

        if self.bound:
            raise RuntimeError("HostGroup: already serves a manager; make one per manager")
        self.bound = True
        sizes = [None] * self.world
        dist.all_gather_object(sizes, nbytes, group=self.cpu_group)
        if len(set(sizes)) != 1:
            raise ValueError(f"host_group: the ranks' host pools differ in size (bytes by rank: "
                             f"{sizes}); every rank must build its manager from the same config")
        path, error, fd = None, None, None
        header_offset = round_up(nbytes, HUGE_PAGE)  # past the region, whatever its alignment
        if self.rank == 0:
            path = os.path.join(SHM_DIR, f"torch_kvcm2-{os.getpid()}-{secrets.token_hex(8)}")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.ftruncate(fd, header_offset + HEADER_BYTES)
            except OSError as exc:
                error = f"rank 0 cannot create {path}: {exc}"
        shared = [path, error]
        dist.broadcast_object_list(shared, src=self._src, group=self.cpu_group)
        path, error = shared
        region = header = None
        try:
            if error is None:
                try:
                    if fd is None:
                        fd = os.open(path, os.O_RDWR)
                    header = HostRegion(HEADER_BYTES, chunk_bytes=HEADER_BYTES, threads=1,
                                        device=region_kwargs.get("device"),
                                        ops=region_kwargs.get("ops"), what="host_group header",
                                        huge_pages=False, shared_fd=fd,
                                        file_offset=header_offset)
                    region = HostRegion(nbytes, shared_fd=fd, file_offset=0, agree=self.agree,
                                        **region_kwargs)
                except (OSError, ValueError, RuntimeError) as exc:
                    error = f"rank {self.rank} cannot map {path}: {exc}"
            errors = [None] * self.world
            dist.all_gather_object(errors, error, group=self.cpu_group)  # every rank has mapped
        finally:
            if fd is not None:
                os.close(fd)  # the regions hold their own descriptors
            if self.rank == 0 and path is not None:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        failed = [e for e in errors if e is not None]
        if failed:
            for r in (region, header):
                if r is not None:
                    r.close()
            raise ValueError(f"host_group: the shared host region cannot be set up: {failed[0]}")
        if not header.commit([(0, HEADER_BYTES)]):
            region.close()
            header.close()
            raise RuntimeError(f"host_group: committing the rank header failed: "
                               f"{header.last_error}")
        self.path, self.header_region = path, header
        self.header = header.tensor[:HEADER_WORDS * 8].view(torch.int64)
        if self.rank == 0:
            self.header[_WORLD] = self.world
            self.header[_MAGIC] = MAGIC
        device = torch_device
        if device.type == "cuda":
            with torch.cuda.device(device):
                view = ops.uva_view(header.tensor, register=False)
            self.header_device = view[:HEADER_WORDS * 8].view(torch.int64)
        else:
            self.header_device = self.header
        # a rank whose process exits (or drops its manager) without close() has left too
        self._leave = weakref.finalize(self, outside_capture(_mark_left), self.header, header,
                                       self.rank)
        self.gen = torch.zeros(1, dtype=torch.int64, device=device)
        for t in (self.header_device, self.gen):
            torch._dynamo.mark_static_address(t, guard=True)
        self.barrier()  # rank 0's header words are in place before any rank reads them
        return region

    # ---- collectives (host side) ----
    def agree(self, ok: bool) -> bool:
        """Whether every rank's ``ok`` is True (collective; the commit agreement)."""
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return bool(flag.item())

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.cpu_group)

    def check(self, digests: list) -> None:
        """Compare ``digests`` (a list of ``(name, digest)`` in the same order on every rank)
        across the ranks (collective); raises :class:`RankDivergence` on every rank, naming the
        first entry that differs and the ranks on each side, when any differs."""
        import torch.distributed as dist

        everyone = [None] * self.world
        dist.all_gather_object(everyone, list(digests), group=self.cpu_group)
        mine = everyone[0]
        for r, theirs in enumerate(everyone[1:], start=1):
            if theirs == mine:
                continue
            names = [n for n, _ in mine]
            if [n for n, _ in theirs] != names:
                raise RankDivergence(f"check_ranks: rank {r} has different pool groups, caches "
                                     f"or batches than rank 0 ({[n for n, _ in theirs]} vs "
                                     f"{names})")
            first = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
            same = [q for q in range(self.world) if everyone[q][first] == mine[first]]
            other = [q for q in range(self.world) if q not in same]
            raise RankDivergence(f"check_ranks: {mine[first][0]} diverges across ranks: ranks "
                                 f"{same} agree, ranks {other} differ (the ranks did not make "
                                 f"the same calls in the same order)")

    # ---- per-step ordering (TP-3) ----
    def owns(self, layer_index: int, pool_group: int) -> bool:
        """Whether this rank flushes layer ``layer_index``'s buffers of ``pool_group``."""
        key = layer_index if self.split == "layer" else pool_group
        return key % self.world == self.rank

    def signal(self, pools: list) -> None:
        """This rank's writes to the shared ``pools`` are done (its flush share, host-direct
        writes): generation += 1, then publish it in the header (per-step op; capturable).
        ``Batch.sync`` calls it, then :meth:`wait`."""
        self._check_open("signal")
        ops.rank_signal(self.header_device, self.gen, pools, self.rank, self.world)

    def wait(self, pools: list) -> None:
        """After :meth:`signal`, before the step's first fetch: until every rank has signalled
        this rank's current generation (per-step op; capturable). On CPU a rank that left or a
        timeout raises RuntimeError naming the rank and generation; on CUDA it records the
        failure in the header and traps (see :meth:`failure`)."""
        self._check_open("wait")
        ops.rank_wait(self.header_device, pools, self.gen, self.rank, self.world,
                      int(self.timeout_s * 1e6))

    # ---- failures and lifetime (TP-4) ----
    def failure(self) -> Optional[dict]:
        """The header's failure record (None when no rank gave up): ``waiter`` (the rank that
        gave up), ``missing`` (the rank it waited for), ``generation``, ``reason`` ("timeout" or
        "left"), ``last_generation`` (what ``missing`` had signalled); plus ``left`` (ranks that
        left). Reads host memory only: usable after a CUDA trap."""
        if self.header is None or self.header_region.closed:
            return None
        words = self.header.tolist()
        left = [r for r in range(self.world) if words[_LEFT + r]]
        if not words[_FAILED]:
            return {"left": left} if left else None
        return {"waiter": words[_FAIL_WAITER], "missing": words[_FAIL_MISSING],
                "generation": words[_FAIL_GEN], "reason": _REASONS.get(words[_FAIL_REASON], "?"),
                "last_generation": words[_FAIL_SEEN], "left": left}

    def counters(self) -> list[int]:
        """Every rank's last signalled generation (host read of the header)."""
        return self.header[_COUNTERS:_COUNTERS + self.world].tolist()

    def raise_on_failure(self, what: str) -> None:
        """RuntimeError naming the rank when the header holds a failure record."""
        record = self.failure()
        if record is not None and "waiter" in record:
            raise RuntimeError(
                f"{what}: the host group failed: rank {record['waiter']} gave up waiting for rank "
                f"{record['missing']} at generation {record['generation']} ({record['reason']}; "
                f"rank {record['missing']} had signalled {record['last_generation']}); the group "
                f"must be rebuilt")

    def close(self) -> None:
        """Mark this rank as left (the others' next ``wait`` raises instead of hanging) and
        release the header mapping (idempotent). The manager releases the pool region."""
        if self.closed:
            return
        self.closed = True
        if self.header_region is not None:
            self._leave()  # marks this rank as left, then releases the header mapping

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"HostGroup.{what}: the group is closed")
        if self.header is None:
            raise RuntimeError(f"HostGroup.{what}: the group serves no manager yet")


def _mark_left(header: torch.Tensor, region: HostRegion, rank: int) -> None:
    if not region.closed:
        header[_LEFT + rank] = 1
        region.close()


def digest(*arrays) -> str:
    """A short hash of numpy arrays / ints (the per-entry digest of ``check_ranks``)."""
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(a.tobytes() if hasattr(a, "tobytes") else repr(a).encode())
    return h.hexdigest()
