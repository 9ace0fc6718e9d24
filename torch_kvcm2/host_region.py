"""The host region (REQUIREMENTS §4, STO-6, STO-7, STO-9): reserved address space, committed in chunks.

One anonymous mapping of the whole budget is reserved at start (``MAP_NORESERVE``: no commit,
no touch) and wrapped as one CPU ``uint8`` tensor, so every view into it keeps its address for
the region's life. ``commit(ranges)`` makes sub-ranges real memory: it populates them (first
touch, ``MADV_POPULATE_WRITE``; ``memset`` on kernels without it) and, when the region serves a
CUDA device, registers them with the driver (pinned and device-mapped), on several threads, all
or nothing. ``close()`` (or garbage collection) unregisters every range and releases the memory;
the address range itself is unmapped when the last tensor viewing it dies. Without ``close()``,
everything is released when the last tensor viewing the region dies (garbage collection).

Every system call goes through a :class:`HostMemoryOps` object, so tests can inject an
out-of-memory or a refused registration and count registrations.

Shared backing (TP-1, docs/TP.md): with ``shared_fd`` the reservation is a ``MAP_SHARED``
mapping of a shared-memory file (``/dev/shm``) at ``file_offset`` instead of anonymous memory,
so every process mapping the file sees the same pages. A commit then allocates the file's pages
(``fallocate``, which never changes bytes another process may already have written) before
populating and registering this process's mapping; a rollback punches the range out of the
file. ``agree`` (set by the host group) makes a commit all or nothing across processes: every
process calls it with its own outcome and keeps its commit only when all succeeded.
"""
from __future__ import annotations

import ctypes
import errno as _errno
import mmap
import os
import platform
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Optional, Sequence

import torch

from ._util import outside_capture

PAGE_SIZE = mmap.PAGESIZE
#: Transparent huge page size (x86-64 and arm64 with 4 KiB base pages). The region is reserved
#: aligned to it and asks for huge pages (MADV_HUGEPAGE): first touch then faults 2 MiB at a time
#: and registration pins 512x fewer pages (docs/HOST_MEMORY.md has the H200 measurements).
HUGE_PAGE = 2 << 20
#: Default commit step: a few hundred MiB keeps the first-touch pause of a growing pool short
#: (tens of ms on many cores) while 64 GiB needs only 256 registrations.
DEFAULT_CHUNK_BYTES = 256 << 20
#: The range one thread populates per turn (whole huge pages). Many pieces per commit keep every
#: thread busy: on the H200 host (16 cores, 2026-12-01) 32 MiB pieces populated 4 GiB with huge
#: pages at 21.9 GB/s on 16 threads, 256 MiB pieces at 10.1 GB/s (benchmarks/host_growth.py).
PIECE_BYTES = 32 << 20

_PROT_NONE, _PROT_READ, _PROT_WRITE = 0, 1, 2
_MAP_SHARED = 0x01
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x02, 0x10, 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value
_MADV_DONTNEED, _MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 4, 14, 23
_MPOL_PREFERRED, _MPOL_BIND = 1, 2
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}.get(platform.machine())

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.syscall.restype = ctypes.c_long


class HostCommitError(RuntimeError):
    """A commit step failed (registration refused, placement impossible); the commit rolls back."""


def _os_error(what: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class HostMemoryOps:
    """The system calls of a host region. Subclass and override to inject faults in tests.

    ``populate`` and ``register`` raise on failure (``MemoryError``/``OSError`` for memory,
    :class:`HostCommitError` for a refused registration); ``discard`` and ``unregister`` must
    not raise for ranges that ``populate``/``register`` accepted.
    """

    _populate_write = True  # MADV_POPULATE_WRITE known to work (Linux >= 5.14)

    def available_bytes(self) -> int:
        """Memory a commit may still take: ``MemAvailable``, capped by a cgroup v2 limit."""
        available = None
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        available = int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
        try:
            with open("/sys/fs/cgroup/memory.max") as f:
                limit = f.read().strip()
            if limit != "max":
                with open("/sys/fs/cgroup/memory.current") as f:
                    left = int(limit) - int(f.read())
                available = left if available is None else min(available, left)
        except (OSError, ValueError):
            pass
        return available if available is not None else 1 << 62

    def populate(self, address: int, nbytes: int) -> None:
        """First-touch ``[address, address + nbytes)`` for writing (releases the GIL)."""
        if self._populate_write:
            if _libc.madvise(address, nbytes, _MADV_POPULATE_WRITE) == 0:
                return
            code = ctypes.get_errno()
            if code != _errno.EINVAL:  # EINVAL: the kernel lacks it; touch by hand below
                raise MemoryError(f"populating {nbytes} bytes of host memory failed: "
                                  f"{os.strerror(code)}")
            type(self)._populate_write = False
        ctypes.memset(address, 0, nbytes)  # fresh pages are zero: writing zeros changes nothing

    def advise_huge(self, address: int, nbytes: int) -> bool:
        """Ask for transparent huge pages over a range (MADV_HUGEPAGE); False when refused."""
        return _libc.madvise(address, nbytes, _MADV_HUGEPAGE) == 0

    def discard(self, address: int, nbytes: int) -> None:
        """Give the pages of a range back (its contents become zero; it stays mapped)."""
        _libc.madvise(address, nbytes, _MADV_DONTNEED)

    def populate_shared(self, fd: int, file_offset: int, address: int, nbytes: int) -> None:
        """Allocate ``nbytes`` of the shared file at ``file_offset`` (``fallocate``: pages another
        process already holds keep their bytes) and map them into ``address`` for writing
        (``MADV_POPULATE_WRITE`` where the kernel has it, which changes no byte either)."""
        if _libc.fallocate(fd, 0, file_offset, nbytes) != 0:
            code = ctypes.get_errno()
            raise MemoryError(f"allocating {nbytes} bytes of shared memory failed: "
                              f"{os.strerror(code)} (is /dev/shm large enough for the pools?)")
        if _libc.madvise(address, nbytes, _MADV_POPULATE_WRITE) != 0 and \
                ctypes.get_errno() != _errno.EINVAL:
            raise _os_error(f"populating {nbytes} bytes of shared memory")

    def discard_shared(self, fd: int, file_offset: int, address: int, nbytes: int) -> None:
        """Give a range of the shared file back, for every process mapping it (contents zero)."""
        _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, file_offset, nbytes)

    def register(self, address: int, nbytes: int, device: int) -> None:
        """Pin and device-map a range for CUDA device ``device`` (cudaHostRegister)."""
        torch.ops.torch_kvcm2.host_register(address, nbytes, device, True)

    def unregister(self, address: int, nbytes: int, device: int) -> None:
        torch.ops.torch_kvcm2.host_register(address, nbytes, device, False)

    def bind(self, address: int, nbytes: int, node: int, strict: bool) -> None:
        """Set the NUMA policy of a range: ``MPOL_BIND`` (strict) or ``MPOL_PREFERRED``."""
        if _SYS_MBIND is None:
            raise OSError(_errno.ENOSYS, f"mbind is not known on {platform.machine()}")
        words = node // 64 + 1
        mask = (ctypes.c_ulong * words)()
        mask[node // 64] = 1 << (node % 64)
        mode = _MPOL_BIND if strict else _MPOL_PREFERRED
        if _libc.syscall(_SYS_MBIND, ctypes.c_void_p(address), ctypes.c_size_t(nbytes),
                         ctypes.c_int(mode), mask, ctypes.c_ulong(words * 64 + 1),
                         ctypes.c_uint(0)) != 0:
            raise _os_error(f"mbind to NUMA node {node}")


class _Mapping:
    """The reserved range and its registrations; shared by the region's finalizer and that of
    the buffer the tensors view, so whichever runs first releases correctly."""

    def __init__(self, address: int, nbytes: int, ops: HostMemoryOps, device: Optional[int],
                 fd: Optional[int] = None):
        self.address, self.nbytes, self.ops, self.device = address, nbytes, ops, device
        self.fd = fd  # shared backing: this process's descriptor of the file (closed on release)
        self.registered: dict[int, int] = {}  # offset -> bytes
        self.protect_on_commit = False  # strict overcommit: reserved PROT_NONE, commit = mprotect
        self.released = self.unmapped = False
        self.lock = threading.Lock()

    def release_memory(self, threads: int = 1) -> None:
        """Unregister every range, then swap the mapping for an inaccessible placeholder that
        holds no memory (stale views fault instead of reaching whatever is mapped there next)."""
        with self.lock:
            if self.released:
                return
            self.released = True
            ranges = sorted(self.registered.items())
            self.registered.clear()

            def unregister(item):
                try:
                    self.ops.unregister(self.address + item[0], item[1], self.device)
                except Exception:  # noqa: BLE001 -- a release must finish; nothing to roll back
                    pass

            run_parallel(unregister, ranges, threads)
            if not self.unmapped:
                # for a shared backing this drops the process's mapping of the file: its pages
                # go once every process has dropped its own and the name is gone
                _libc.mmap(self.address, self.nbytes, _PROT_NONE,
                           _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1, 0)
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None

    def unmap(self) -> None:
        self.release_memory()
        with self.lock:
            if not self.unmapped:
                self.unmapped = True
                _libc.munmap(self.address, self.nbytes)


def run_parallel(fn, items: Sequence, threads: int) -> list:
    """``[fn(item) ...]`` on up to ``threads`` threads (inline for one); exceptions are returned
    in place of results, never raised."""
    def guarded(item):
        try:
            return fn(item)
        except BaseException as exc:  # noqa: BLE001 -- reported to the caller
            return exc

    if threads <= 1 or len(items) <= 1:
        return [guarded(item) for item in items]
    try:
        with ThreadPoolExecutor(max_workers=min(threads, len(items)),
                                thread_name_prefix="kvcm2-host") as pool:
            return list(pool.map(guarded, items))
    except RuntimeError:  # e.g. no new threads at interpreter shutdown
        return [guarded(item) for item in items]


def thp_mode() -> str:
    """The system's transparent huge page mode ("always", "madvise", "never"), or "unknown"."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


#: Default populate threads: at most this many. On the H200 host (16 cores, 2026-12-01) growth
#: by 8 GiB ran at 25.7 GB/s on 8 threads and 17.8 GB/s on 16 (they then contend with the
#: registering thread and with each other's page faults).
MAX_DEFAULT_THREADS = 8


def available_cores() -> int:
    """Cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_threads() -> int:
    """Populate threads when none are given: the cores this process may use, at most
    MAX_DEFAULT_THREADS."""
    return min(available_cores(), MAX_DEFAULT_THREADS)


def online_numa_nodes() -> list[int]:
    """NUMA nodes with online memory, from sysfs ([] when the kernel exposes none)."""
    try:
        with open("/sys/devices/system/node/online") as f:
            text = f.read().strip()
    except OSError:
        return []
    nodes = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        nodes.extend(range(int(lo), int(hi or lo) + 1))
    return nodes


def device_numa_node(device: torch.device) -> Optional[int]:
    """The NUMA node of a CUDA device's PCI function (None: CPU device, or not reported)."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device.index if device.index is not None
                                             else torch.cuda.current_device())
    ids = [getattr(props, f"pci_{name}_id", None) for name in ("domain", "bus", "device")]
    if None in ids:
        return None
    bus_id = f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0"
    try:
        with open(f"/sys/bus/pci/devices/{bus_id}/numa_node") as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def resolve_numa(numa, device: torch.device) -> tuple[Optional[int], bool]:
    """``(node, strict)`` for the ``numa`` argument: "auto" prefers the device's node (no
    binding on a CPU device or where none is reported), None leaves placement alone, an int
    binds strictly to that node (ValueError when it is absent)."""
    if numa is None:
        return None, False
    if isinstance(numa, str):
        if numa != "auto":
            raise ValueError(f"numa must be 'auto', None or a NUMA node id, got {numa!r}")
        node = device_numa_node(device)
        return (node, False) if node is not None and node in online_numa_nodes() else (None, False)
    if not isinstance(numa, int) or isinstance(numa, bool) or numa < 0:
        raise ValueError(f"numa must be 'auto', None or a non-negative NUMA node id, got {numa!r}")
    nodes = online_numa_nodes()
    if numa not in nodes:
        raise ValueError(f"numa={numa}: NUMA node {numa} is not online on this host "
                         f"(online nodes: {nodes or 'none reported'})")
    return numa, True


def check_options(chunk_bytes, threads) -> None:
    """ValueError naming the argument for a bad chunk size or thread count."""
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0 \
            or chunk_bytes % PAGE_SIZE:
        raise ValueError(f"host_chunk_bytes must be a positive multiple of the page size "
                         f"({PAGE_SIZE} bytes), got {chunk_bytes!r}")
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"host_threads must be an int >= 1, got {threads!r}")


class HostRegion:
    """``nbytes`` of reserved host address space, committed on demand.

    ``tensor`` is ``uint8[nbytes]`` over the whole reservation; its address never changes.
    ``device`` (a CUDA device index, or None) is where committed ranges get registered.
    ``numa_node``/``numa_strict`` set the placement of every page the region ever commits.
    ``huge_pages``: reserve 2 MiB aligned and ask for transparent huge pages (``huge_pages``
    in ``stats()`` says whether the kernel accepted, ``thp_mode`` what the system allows).
    Raises ValueError when the address space cannot be reserved and RuntimeError when a strict
    NUMA binding is refused.

    ``shared_fd``: back the region with ``nbytes`` of that shared-memory file from
    ``file_offset`` (page-aligned; the file must be at least that long) instead of anonymous
    memory; the region keeps its own duplicate of the descriptor until it is released.
    ``agree``: None, or a collective ``agree(ok: bool) -> bool`` every commit calls once with
    its own outcome (True only when every process's commit succeeded).
    """

    def __init__(self, nbytes: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 threads: Optional[int] = None, numa_node: Optional[int] = None,
                 numa_strict: bool = False, device: Optional[int] = None,
                 ops: Optional[HostMemoryOps] = None, what: str = "host_budget_bytes",
                 huge_pages: bool = True, shared_fd: Optional[int] = None, file_offset: int = 0,
                 agree=None):
        threads = default_threads() if threads is None else threads
        check_options(chunk_bytes, threads)
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"{what}: a host region needs a positive size, got {nbytes!r}")
        self.ops = ops if ops is not None else HostMemoryOps()
        self.chunk_bytes, self.threads, self.device = chunk_bytes, threads, device
        align = HUGE_PAGE if huge_pages else PAGE_SIZE
        self.nbytes = round_up(nbytes, align)
        self.shared, self.file_offset, self.agree = shared_fd is not None, file_offset, agree
        if self.shared:
            if not isinstance(file_offset, int) or file_offset < 0 or file_offset % align:
                raise ValueError(f"file_offset must be a non-negative multiple of {align} bytes "
                                 f"(the region's alignment), got {file_offset!r}")
            address = self._map_shared(shared_fd, file_offset, self.nbytes, what, align)
            protect, fd = False, os.dup(shared_fd)
        else:
            (address, protect), fd = self._reserve(self.nbytes, what, align), None
        self._mapping = _Mapping(address, self.nbytes, self.ops, device, fd)
        self._mapping.protect_on_commit = protect
        self.address = address
        buffer = (ctypes.c_uint8 * self.nbytes).from_address(address)
        # Without close(), the memory lives as long as any tensor viewing it (the buffer): when
        # the last one dies (garbage collection of the manager and everything it made), the
        # ranges are unregistered and the mapping goes. At exit the process's memory goes anyway.
        weakref.finalize(buffer, outside_capture(self._mapping.unmap)).atexit = False
        self.tensor = torch.frombuffer(buffer, dtype=torch.uint8)
        self.huge_pages = huge_pages and self.ops.advise_huge(address, self.nbytes)
        self.committed_bytes = 0
        self.commits = self.failed_commits = 0
        self.last_error: Optional[str] = None
        self.numa_node, self.numa_strict, self.numa_error = numa_node, numa_strict, None
        if numa_node is not None:
            try:
                self.ops.bind(address, self.nbytes, numa_node, numa_strict)
            except OSError as exc:
                if numa_strict:
                    self.close()
                    raise RuntimeError(f"numa={numa_node}: binding the host region to NUMA node "
                                       f"{numa_node} failed: {exc}") from None
                self.numa_node, self.numa_error = None, str(exc)  # "auto" is best effort

    @staticmethod
    def _reserve(nbytes: int, what: str, align: int) -> tuple[int, bool]:
        """``nbytes`` of address space starting at a multiple of ``align`` (mapped ``align``
        bytes larger, the ends trimmed), and whether commits must mprotect (strict overcommit)."""
        flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE
        extra = align - PAGE_SIZE

        def aligned(address: int) -> int:
            start = round_up(address, align)
            if start > address:
                _libc.munmap(address, start - address)
            if address + nbytes + extra > start + nbytes:
                _libc.munmap(start + nbytes, address + extra - start)
            return start

        address = _libc.mmap(None, nbytes + extra, _PROT_READ | _PROT_WRITE, flags, -1, 0)
        if address not in (None, _MAP_FAILED):
            return aligned(address), False
        first = _os_error("mmap")
        # Strict overcommit (vm.overcommit_memory=2) ignores MAP_NORESERVE: reserve the range
        # inaccessible (not charged) and make each chunk accessible (charged) as it commits.
        address = _libc.mmap(None, nbytes + extra, _PROT_NONE, flags, -1, 0)
        if address not in (None, _MAP_FAILED):
            return aligned(address), True
        raise ValueError(f"{what}: {nbytes} bytes of host address space cannot be reserved "
                         f"({first.strerror}); lower the budget or raise the process's address "
                         f"space limit (ulimit -v)")

    @classmethod
    def _map_shared(cls, fd: int, file_offset: int, nbytes: int, what: str, align: int) -> int:
        """``nbytes`` of the file at ``file_offset`` mapped shared at a multiple of ``align``:
        an aligned reservation, then the file mapped over it."""
        size = os.fstat(fd).st_size
        if size < file_offset + nbytes:
            raise ValueError(f"{what}: the shared file holds {size} bytes, fewer than the "
                             f"{file_offset + nbytes} the region needs")
        start, _ = cls._reserve(nbytes, what, align)
        address = _libc.mmap(start, nbytes, _PROT_READ | _PROT_WRITE,
                             _MAP_SHARED | _MAP_NORESERVE | _MAP_FIXED, fd, file_offset)
        if address in (None, _MAP_FAILED):
            error = _os_error("mmap")
            _libc.munmap(start, nbytes)
            raise ValueError(f"{what}: {nbytes} bytes of the shared file cannot be mapped "
                             f"({error.strerror})")
        return address

    # ---- state ----
    @property
    def closed(self) -> bool:
        return self._mapping.released

    @property
    def registered_bytes(self) -> int:
        return sum(self._mapping.registered.values())

    @property
    def registrations(self) -> int:
        return len(self._mapping.registered)

    def registration_starts(self) -> list[int]:
        """The offsets where a registered range starts, sorted (empty off CUDA). One copy-engine
        transfer must not cross one: a host range spanning two registrations is not one pinned
        range (the host tier's copies cut their runs there, ``tiers.copy_segments``)."""
        with self._mapping.lock:
            return sorted(self._mapping.registered)

    def stats(self) -> dict:
        return {"address": self.address, "reserved_bytes": self.nbytes,
                "committed_bytes": self.committed_bytes, "registered_bytes": self.registered_bytes,
                "registrations": self.registrations, "chunk_bytes": self.chunk_bytes,
                "threads": self.threads, "numa_node": self.numa_node,
                "numa_strict": self.numa_strict, "numa_error": self.numa_error,
                "commits": self.commits, "failed_commits": self.failed_commits,
                "last_error": self.last_error, "huge_pages": self.huge_pages,
                "thp_mode": thp_mode(), "shared": self.shared, "node_bytes": self.node_bytes()}

    def node_bytes(self) -> int:
        """Memory the region's pages hold on this host, counted once however many processes
        map them: the shared file's allocated bytes (its whole file), else ``committed_bytes``."""
        fd = self._mapping.fd
        if not self.shared or fd is None:
            return self.committed_bytes
        return os.fstat(fd).st_blocks * 512

    # ---- commit ----
    def pieces(self, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """The ranges cut into pieces of PIECE_BYTES (whole huge pages when the region has
        them, else whole pages; the last piece of a range may be shorter)."""
        size = round_up(PIECE_BYTES, HUGE_PAGE if self.huge_pages else PAGE_SIZE)
        out = []
        for offset, nbytes in ranges:
            end = offset + nbytes
            while offset < end:
                out.append((offset, min(size, end - offset)))
                offset += size
        return out

    def _populate_and_register(self, pieces, registered: list) -> Optional[BaseException]:
        """Populate ``pieces`` on the region's threads and, on CUDA, register each one on this
        thread as soon as it is populated (the driver serialises registrations; they overlap
        the population of later pieces). Appends what it registered to ``registered``; returns
        the first failure (the remaining pieces are then skipped) or None."""
        ops, base, device = self.ops, self.address, self.device

        def register(piece):
            if device is not None:
                ops.register(base + piece[0], piece[1], device)
                registered.append(piece)

        fd = self._mapping.fd

        def populate(piece):
            if fd is not None:  # shared backing: allocate the file's pages, change no byte
                ops.populate_shared(fd, self.file_offset + piece[0], base + piece[0], piece[1])
            else:
                ops.populate(base + piece[0], piece[1])
            return piece

        try:
            pool = (ThreadPoolExecutor(max_workers=min(self.threads, len(pieces)),
                                       thread_name_prefix="kvcm2-host")
                    if self.threads > 1 and len(pieces) > 1 else None)
        except RuntimeError:  # e.g. no new threads at interpreter shutdown
            pool = None
        if pool is None:
            for piece in pieces:
                try:
                    register(populate(piece))
                except BaseException as exc:  # noqa: BLE001 -- reported to the caller
                    return exc
            return None
        with pool:
            futures = [pool.submit(populate, piece) for piece in pieces]
            for future in as_completed(futures):
                try:
                    register(future.result())
                except BaseException as exc:  # noqa: BLE001 -- reported to the caller
                    for other in futures:
                        other.cancel()
                    return exc  # leaving the block waits for the populates still running
        return None

    def commit(self, ranges: Sequence[tuple[int, int]]) -> bool:
        """Make ``ranges`` (``(offset, nbytes)``, page-aligned, disjoint, not yet committed)
        real memory: populated and, on CUDA, registered. All or nothing: on any failure what
        this call did is undone, ``last_error`` says why, and it returns False. With ``agree``
        the outcome is that of every process: a commit that succeeded here is undone when
        another process's failed."""
        if self.agree is None:
            return self._commit(ranges)[0]
        ok, undo = self._commit(ranges)
        if self.agree(ok):
            return True
        if ok:
            undo()
            self._failed("another process of the host group failed the same commit")
        # a second agreement: every process has undone its part before any commits again (a
        # retry's pages must not be punched out under it)
        self.agree(True)
        return False

    def _commit(self, ranges: Sequence[tuple[int, int]]):
        """``(ok, undo)``: the commit of this process and, when it succeeded, a function that
        undoes it."""
        if self.closed:
            raise RuntimeError("host region: commit after close()")
        ranges = [(o, n) for o, n in ranges if n > 0]
        for offset, nbytes in ranges:
            if offset % PAGE_SIZE or nbytes % PAGE_SIZE or offset < 0 or \
                    offset + nbytes > self.nbytes:
                raise ValueError(f"host region: commit range ({offset}, {nbytes}) is not "
                                 f"page-aligned inside the region ({self.nbytes} bytes)")
        total = sum(n for _, n in ranges)
        if not total:
            return True, lambda: None
        available = self.ops.available_bytes()
        if total > available:
            return self._failed(f"out of host memory: a commit of {total} bytes exceeds the "
                                f"{available} bytes available"), None
        mapping, base = self._mapping, self.address
        if mapping.protect_on_commit:
            done = []
            for offset, nbytes in ranges:
                if _libc.mprotect(base + offset, nbytes, _PROT_READ | _PROT_WRITE) != 0:
                    error = _os_error("mprotect")
                    for o, n in done:
                        _libc.mprotect(base + o, n, _PROT_NONE)
                    return self._failed(f"out of host memory (commit limit): {error}"), None
                done.append((offset, nbytes))

        fd = mapping.fd

        def roll_back(registered_pieces):
            """Unregister what this call registered, give back what it populated."""
            for offset, nbytes in registered_pieces:
                self.ops.unregister(base + offset, nbytes, self.device)
            for offset, nbytes in ranges:
                if fd is not None:
                    self.ops.discard_shared(fd, self.file_offset + offset, base + offset, nbytes)
                else:
                    self.ops.discard(base + offset, nbytes)
                if mapping.protect_on_commit:
                    _libc.mprotect(base + offset, nbytes, _PROT_NONE)

        registered: list[tuple[int, int]] = []
        failure = self._populate_and_register(self.pieces(ranges), registered)
        if failure is None:
            with mapping.lock:
                for offset, nbytes in registered:
                    mapping.registered[offset] = nbytes
            self.committed_bytes += total
            self.commits += 1

            def undo():
                with mapping.lock:
                    for offset, _ in registered:
                        mapping.registered.pop(offset, None)
                roll_back(registered)
                self.committed_bytes -= total
                self.commits -= 1

            return True, undo
        roll_back(registered)
        if isinstance(failure, (MemoryError, OSError, HostCommitError, RuntimeError)):
            return self._failed(f"{type(failure).__name__}: {failure}"), None
        raise failure  # a bug, not a resource failure: never swallowed

    def _failed(self, reason: str) -> bool:
        self.failed_commits += 1
        self.last_error = reason
        return False

    # ---- lifetime ----
    def close(self) -> None:
        """Unregister every range and release the memory (idempotent). The tensor stays a valid
        object but its memory is gone: nothing may read or write it afterwards."""
        self._mapping.release_memory(self.threads)
