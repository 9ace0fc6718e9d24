// CUDA kernels of OP-FETCH. They reproduce cpu/fetch.cpp bit for bit.
//
// Two production kernels, chosen per launch by piece size (kWarpMinPiece):
// fetch_kernel (the vector-item sweep, for rows and other small units): a fixed grid of threads
// takes consecutive 16-byte vectors across miss and buffer boundaries, two loads in flight each;
// fetch_warp_kernel (for pages and other large units): one warp per missed unit, a fixed grid of
// CTAs taking contiguous chunks of the miss list (consecutive misses: mostly one row's, so mostly
// one row's host pages); each warp copies a few misses together, its lanes striding 16-byte
// vectors (narrower for unaligned buffers) loaded through the device-mapped view of pinned host
// memory, several loads in flight per lane before any store. Measured on an H200 (2026-12-01, %
// of the copy engine's H2D rate in the same process): 42-KB pages 88% with warps against 64-77%
// for the sweep and for bulk copies (TMA) through shared memory; 656-B rows of a full step of 61
// layers (P-STEP) 2731-2742 us with the sweep against 3148 us with warps; single 656-B launches
// (P-FETCH-ROW, 64 rows x 20% misses) within a few percent of each other.
// Development builds (launch.cuh) also hold the bulk-copy kernel (fetch_tma_kernel), the choice
// of either kernel for every launch, and warp variants in host-address order or with whole-line
// reads.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "../checks.h"
#include "../rules.h"
#include "launch.cuh"
#include "steps.cuh"

namespace torch_kvcm2 {
namespace {

constexpr int kFetchThreads = 256;
constexpr int kFetchIlp = 2;  // vector loads in flight per thread (Tuning::fetch_ilp)
// Launches whose every piece (one unit in one chunk) is smaller run the vector-item sweep, the
// others one warp per miss (H200, 2026-12-01: 656-B rows of P-STEP's 61-layer step 2731-2742 us
// with the sweep against 3148 us with warps; 42-KB pages 88% of the copy engine with warps
// against 64-77% with the sweep).
constexpr int64_t kWarpMinPiece = 4096;
#ifdef KVCM2_DEV
// fetch_tma_kernel: used for pieces of >= kTmaMinPiece bytes (KVCM2_FETCH_TMA=2), stages of up to
// Tuning::fetch_tma_stage bytes (8192), one CTA per SM with up to kTmaSmemBudget bytes of stages
// and kTmaMaxThreads threads.
constexpr int64_t kTmaMinPiece = 32768;
constexpr int kTmaSmemBudget = 200 * 1024;
constexpr int kTmaMaxThreads = 256;
#endif
constexpr int kMaxFetchBuffers = 8;  // buffers per launch; more are split over several launches

struct FetchBuffer {
  uint8_t* cells;        // [num_cells, chunks, P, B/chunks]
  const uint8_t* host;   // device-mapped view of [host_slots, chunks, P, B/chunks]
  const int32_t* table;  // page table of the buffer's pool group [table_rows, table_pages]
  int64_t num_entries;   // num_cells * E
  int64_t table_rows, table_pages, host_slots, host_stride;
  int64_t page_bytes, chunk_bytes, piece;  // piece = U * B/chunks: one unit in one chunk
  int32_t E;             // units per page
  int32_t vec;           // bytes per part: a vector (16, 8, 4, 2 or 1), or a stage (TMA)
  int32_t vpp;           // parts per piece (the last stage of a piece may be shorter)
  int32_t begin;         // first part of this buffer within one miss's parts
};

// 16-byte aligned, so that every part's entry in FetchGroupParams is (as ResolveParams).
struct alignas(16) FetchParams {
  FetchBuffer buf[kMaxFetchBuffers];
  int32_t nb;
  int32_t per_miss;  // parts per miss over all buffers of this launch
  const int32_t* miss_list;
  const int32_t* miss_count;
  int64_t list_rows;
  bool list_aligned;  // miss_list rows are 16-byte aligned: one int4 load per entry
  int64_t slots;
  int32_t stage_bytes;  // fetch_tma_kernel: bytes per shared-memory stage
  int32_t warp_misses;  // fetch_warp_kernel (development builds): misses a warp copies together
};

// The launch parts of launch_fetch_groups, each a group's buffers (up to kMaxFetchBuffers):
// fetch_groups_kernel sweeps all of them as one item space, fetch_warp_groups_kernel runs part y
// in CTAs (x, y). Parameters of up to 32 KB need CUDA 12.1 and a Volta or newer
// device.
constexpr int kMaxFetchGroups = 32;
struct FetchGroupParams {
  FetchParams part[kMaxFetchGroups];
  int32_t n;  // parts (fetch_groups_kernel; fetch_warp_groups_kernel takes gridDim.y)
};
static_assert(sizeof(FetchGroupParams) <= 32000, "fetch: group parameters over 32 KB");
static_assert(sizeof(FetchParams) % 16 == 0, "fetch: a part's parameters unaligned");

__device__ __forceinline__ uint4 load_vec(const uint8_t* src, int vec) {
  uint4 v = make_uint4(0, 0, 0, 0);
  switch (vec) {  // uniform within a buffer's span of work
    case 16: v = __ldg(reinterpret_cast<const uint4*>(src)); break;
    case 8: {
      const uint2 t = __ldg(reinterpret_cast<const uint2*>(src));
      v.x = t.x, v.y = t.y;
      break;
    }
    case 4: v.x = __ldg(reinterpret_cast<const unsigned int*>(src)); break;
    case 2: v.x = __ldg(reinterpret_cast<const unsigned short*>(src)); break;
    default: v.x = __ldg(reinterpret_cast<const unsigned char*>(src)); break;
  }
  return v;
}

__device__ __forceinline__ void store_vec(uint8_t* dst, const uint4& v, int vec) {
  switch (vec) {  // .cg: the cells are read by the attention kernel, not by this SM's L1
    case 16: __stcg(reinterpret_cast<uint4*>(dst), v); break;
    case 8: __stcg(reinterpret_cast<uint2*>(dst), make_uint2(v.x, v.y)); break;
    case 4: __stcg(reinterpret_cast<unsigned int*>(dst), v.x); break;
    case 2: __stcg(reinterpret_cast<unsigned short*>(dst), static_cast<unsigned short>(v.x)); break;
    default: __stcg(reinterpret_cast<unsigned char*>(dst), static_cast<unsigned char>(v.x)); break;
  }
}


__device__ __forceinline__ int4 load_entry(const FetchParams& p, int64_t m) {
  const int32_t* const entry = p.miss_list + m * kMissFields;
  return p.list_aligned ? __ldg(reinterpret_cast<const int4*>(entry))
                        : make_int4(__ldg(entry), __ldg(entry + 1), __ldg(entry + 2),
                                    __ldg(entry + 3));
}

// The host page slot of miss entry e = (lease, slot, row, unit) in buffer B, or -1: bad device
// data is skipped exactly like the CPU, never written out of bounds.
__device__ __forceinline__ int64_t host_slot_of(const FetchParams& p, const FetchBuffer& B,
                                                const int4& e) {
  return fetch_host_slot(e.x, e.y, e.z, e.w, p.slots, B.num_entries, B.table, B.table_rows,
                         B.table_pages, B.E, B.host_slots);
}

// Part w of entry e's piece in chunk w / vpp: where it is read from (host page host_slot) and
// written to (its cell); `inner` is its offset within the page.
__device__ __forceinline__ int64_t part_offset(const FetchBuffer& B, int w) {
  const int k = w / B.vpp;  // chunk
  return k * B.chunk_bytes + static_cast<int64_t>(w - k * B.vpp) * B.vec;
}
__device__ __forceinline__ const uint8_t* part_src(const FetchBuffer& B, const int4& e,
                                                   int64_t host_slot, int64_t inner) {
  return host_address(B.host, host_slot, B.host_stride, e.w, B.E, B.piece, inner);
}
__device__ __forceinline__ uint8_t* part_dst(const FetchParams& p, const FetchBuffer& B,
                                             const int4& e, int64_t inner) {
  const int64_t entry = static_cast<int64_t>(e.x) * p.slots + e.y;
  return cell_address(B.cells, entry, B.E, B.page_bytes, B.piece, inner);
}

// Work item v = (miss m, buffer b, w = chunk * vpp + part), m-major so that consecutive items are
// consecutive parts of one piece. A part is one vector (fetch_kernel) or one stage of a
// shared-memory staged copy (fetch_tma_kernel).
__device__ __forceinline__ void split_item(const FetchParams& p, int64_t v, int64_t& m, int& b,
                                           int& w) {
  m = v / p.per_miss;
  int ww = static_cast<int>(v - m * p.per_miss);
  int bb = 0;
  while (bb + 1 < p.nb && ww >= p.buf[bb + 1].begin) ++bb;
  b = bb;
  w = ww - p.buf[bb].begin;
}

// One vector per work item. A thread handles ILP items per round in stages (miss entries, then
// page-table entries, then host loads, then stores), so the dependent loads of its items overlap
// instead of forming ILP chains.
template <int ILP>
__device__ __forceinline__ void fetch_sweep(const FetchParams& p) {
  pdl_enter();
  // The count (written by resolve earlier on this stream) is loaded together with the first
  // miss entries rather than before them: entries are read up to the list's size, and only
  // items below count * per_miss are copied. One dependent load less on the critical path.
  const int32_t count = *p.miss_count;
  const int64_t bound = p.list_rows * p.per_miss;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kFetchThreads;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kFetchThreads + threadIdx.x; base < bound;
       base += ILP * stride) {
    int4 e[ILP];   // miss entries (lease, slot, row, unit)
    int b[ILP];    // buffer
    int w[ILP];    // vector within the buffer's part of the miss: chunk * vpp + vector
#pragma unroll
    for (int i = 0; i < ILP; ++i) {
      int64_t v = base + i * stride;
      if (v >= bound) v = base;  // a readable item; its copy is dropped in stage 2
      int64_t m;
      split_item(p, v, m, b[i], w[i]);
      e[i] = load_entry(p, m);
    }
    const int64_t total = min(max(static_cast<int64_t>(count), int64_t{0}), p.list_rows) * p.per_miss;
    if (base >= total) break;
    int64_t host_slot[ILP];
#pragma unroll
    for (int i = 0; i < ILP; ++i)
      host_slot[i] = base + i * stride < total ? host_slot_of(p, p.buf[b[i]], e[i]) : -1;
    uint4 val[ILP];
    uint8_t* dst[ILP];
    int vec[ILP];
#pragma unroll
    for (int i = 0; i < ILP; ++i) {
      const FetchBuffer& B = p.buf[b[i]];
      dst[i] = nullptr;
      vec[i] = B.vec;
      if (host_slot[i] < 0) continue;
      const int64_t inner = part_offset(B, w[i]);
      val[i] = load_vec(part_src(B, e[i], host_slot[i], inner), vec[i]);
      dst[i] = part_dst(p, B, e[i], inner);
    }
#pragma unroll
    for (int i = 0; i < ILP; ++i)
      if (dst[i] != nullptr) store_vec(dst[i], val[i], vec[i]);
  }
}

template <int ILP>
__global__ __launch_bounds__(kFetchThreads) void fetch_kernel(const __grid_constant__ FetchParams p) {
  fetch_sweep<ILP>(p);
}

// The launch parts of several groups at once (launch_fetch_groups), as one item space: part
// 0's items (fetch_kernel's, from its count), then part 1's, ..., swept by the whole grid. So a
// small step's parts are all in flight together, and a large one's are taken part by part with
// the whole grid on each (as one launch per part would, which keeps the host pages in flight
// together few: measured on an H100, 2026-12-06, a grid split between 16 parts at once ran a
// 64-row step 14% slower than one launch per part). One dependent load more than fetch_kernel:
// the counts are read before any entry.
template <int ILP>
__global__ __launch_bounds__(kFetchThreads) void fetch_groups_kernel(
    const __grid_constant__ FetchGroupParams ps) {
  __shared__ int64_t s_end[kMaxFetchGroups];  // items of parts 0..p
  extern __shared__ __align__(16) unsigned char s_raw[];  // the n parts' parameters (launch)
  FetchParams* const parts = reinterpret_cast<FetchParams*>(s_raw);
  stage_words(parts, ps.part, ps.n * static_cast<int>(sizeof(FetchParams) / 4));
  pdl_enter();
  __syncthreads();
  if (threadIdx.x < 32) {  // one warp: each part's items, then an inclusive scan
    int64_t items = 0;
    if (static_cast<int>(threadIdx.x) < ps.n) {
      const FetchParams& P = parts[threadIdx.x];
      items = min(max(static_cast<int64_t>(*P.miss_count), int64_t{0}), P.list_rows) * P.per_miss;
    }
    for (int d = 1; d < 32; d <<= 1) {
      const int64_t left = __shfl_up_sync(0xffffffffu, items, d);
      if (static_cast<int>(threadIdx.x) >= d) items += left;
    }
    s_end[threadIdx.x] = items;
  }
  __syncthreads();
  const int64_t total = s_end[ps.n - 1];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kFetchThreads;
  int part = 0;  // the part of the thread's first item this round (items only grow)
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kFetchThreads + threadIdx.x;
       base < total; base += ILP * stride) {
    int4 e[ILP];
    int q[ILP], b[ILP], w[ILP];
    int64_t host_slot[ILP];
    int at = part;
#pragma unroll
    for (int i = 0; i < ILP; ++i) {
      const int64_t v = base + i * stride;
      host_slot[i] = -1;
      q[i] = at;
      if (v >= total) continue;
      while (s_end[at] <= v) ++at;
      if (i == 0) part = at;
      q[i] = at;
      const FetchParams& P = parts[at];
      int64_t m;
      split_item(P, v - (at > 0 ? s_end[at - 1] : 0), m, b[i], w[i]);
      e[i] = load_entry(P, m);
      host_slot[i] = 0;
    }
#pragma unroll
    for (int i = 0; i < ILP; ++i)
      if (host_slot[i] == 0) {
        const FetchParams& P = parts[q[i]];
        host_slot[i] = host_slot_of(P, P.buf[b[i]], e[i]);
      }
    uint4 val[ILP];
    uint8_t* dst[ILP];
    int vec[ILP];
#pragma unroll
    for (int i = 0; i < ILP; ++i) {
      dst[i] = nullptr;
      vec[i] = 16;
      if (host_slot[i] < 0) continue;
      const FetchParams& P = parts[q[i]];
      const FetchBuffer& B = P.buf[b[i]];
      vec[i] = B.vec;
      const int64_t inner = part_offset(B, w[i]);
      val[i] = load_vec(part_src(B, e[i], host_slot[i], inner), vec[i]);
      dst[i] = part_dst(P, B, e[i], inner);
    }
#pragma unroll
    for (int i = 0; i < ILP; ++i)
      if (dst[i] != nullptr) store_vec(dst[i], val[i], vec[i]);
  }
}

#ifdef KVCM2_DEV
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Bulk asynchronous copies (TMA, compute capability >= 9.0) through shared memory: each work item
// is one stage of up to B.vec bytes of a piece (16-byte aligned on both sides), loaded from the
// device-mapped host page into shared memory (cp.async.bulk, completion on an mbarrier) and
// stored from there to its cell (cp.async.bulk, bulk group). Each thread owns two stages: the
// load of its next item is in flight while the current one is stored. Used for pieces of
// >= kTmaMinPiece bytes only: on an H200 it moved 42-KB pages 3-4% faster than fetch_kernel, but
// 656-B rows 40% slower and 5-KB units 1.6-1.9x slower (each bulk copy of a randomly placed unit
// pays its own round trip; one SM's copies do not overlap like the loads of its 64 warps).
__global__ void fetch_tma_kernel(const __grid_constant__ FetchParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char smem[];
  const int T = blockDim.x, tid = threadIdx.x, SB = p.stage_bytes;
  const uint32_t bar0 = smem_u32(smem) + 16 * tid;  // two 8-byte mbarriers per thread
  const uint32_t stage0 = smem_u32(smem) + 16 * T + 2 * SB * tid;
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0) : "memory");
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0 + 8) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  pdl_enter();
  const int32_t count = *p.miss_count;
  const int64_t total = min(max(static_cast<int64_t>(count), int64_t{0}), p.list_rows) * p.per_miss;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * T;
  // Item v's source, destination and size (0: nothing to copy).
  auto locate = [&](int64_t v, const uint8_t*& src, uint8_t*& dst) -> int {
    if (v >= total) return 0;
    int64_t m;
    int b, w;
    split_item(p, v, m, b, w);
    const FetchBuffer& B = p.buf[b];
    const int4 e = load_entry(p, m);
    const int64_t host_slot = host_slot_of(p, B, e);
    if (host_slot < 0) return 0;
    const int64_t inner = part_offset(B, w);
    src = part_src(B, e, host_slot, inner);
    dst = part_dst(p, B, e, inner);
    const int64_t left = B.piece - (inner - (w / B.vpp) * B.chunk_bytes);
    return static_cast<int>(left < B.vec ? left : B.vec);
  };
  auto load = [&](int s, const uint8_t* src, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar0 + 8 * s),
                 "r"(bytes) : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(stage0 + s * SB), "l"(src), "r"(bytes), "r"(bar0 + 8 * s) : "memory");
  };
  int64_t v = static_cast<int64_t>(blockIdx.x) * T + tid;
  const uint8_t* src = nullptr;
  uint8_t* dst = nullptr;
  int bytes = locate(v, src, dst);
  if (bytes > 0) load(0, src, bytes);
  uint32_t parity = 0;  // bit s: the phase of stage s's barrier to wait for
  for (int s = 0; v < total; v += stride, s ^= 1) {
    const uint8_t* nsrc = nullptr;
    uint8_t* ndst = nullptr;
    const int nbytes = locate(v + stride, nsrc, ndst);
    if (nbytes > 0) {
      // stage s ^ 1 held the previous item: its store must have read it
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      load(s ^ 1, nsrc, nbytes);
    }
    if (bytes > 0) {
      uint32_t done = 0;
      do {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
            "selp.u32 %0, 1, 0, p; }"
            : "=r"(done) : "r"(bar0 + 8 * s), "r"((parity >> s) & 1u) : "memory");
      } while (!done);
      parity ^= 1u << s;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   ::"l"(dst), "r"(stage0 + s * SB), "r"(bytes) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    src = nsrc, dst = ndst, bytes = nbytes;
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}

#endif  // KVCM2_DEV

// ------------------------------------------------------------------------------------------------
// fetch_warp_kernel<false, false> is the production kernel; the other instantiations are
// development variants (Tuning::fetch_warp, fetch_warp_misses, fetch_lines). One warp per missed
// unit. Each CTA takes a contiguous chunk of the miss list at a time (consecutive misses: mostly
// one row's, so mostly one row's host pages), sized so that every CTA of the grid has a chunk;
// its warps split the chunk into contiguous runs and copy warp_misses misses together, the lanes
// striding the misses' parts (16-byte vectors for aligned buffers), kWarpIlp loads in flight per
// lane before any store, so the loads of the next miss are out before the stores of the last.
// SORT: the chunk's misses are taken in host-address order (of the launch's first buffer),
// sorted in shared memory, so misses that share host lines or pages are read together.
// LINES: buffers of 16-byte vectors read every 128-byte line under a piece whole (clamped to the
// buffer's host page) and store only the piece's bytes.
constexpr int kWarpThreads = 256;
constexpr int kWarpChunk = kWarpThreads;  // most misses per chunk: one sort key per thread
constexpr int kWarpIlp = 4;
constexpr int kWarpsPerCta = kWarpThreads / 32;

template <bool SORT, bool LINES>
__device__ __forceinline__ void fetch_warp(const FetchParams& p) {
  __shared__ int4 s_entry[SORT ? kWarpChunk : 1];
  __shared__ unsigned long long s_key[SORT ? kWarpChunk : 1];  // host address << 8 | chunk index
  pdl_enter();
  const int64_t count =
      min(max(static_cast<int64_t>(*p.miss_count), int64_t{0}), p.list_rows);
  if (count == 0) return;
  const int64_t per_cta = (count + gridDim.x - 1) / gridDim.x;
  const int chunk = static_cast<int>(min(static_cast<int64_t>(kWarpChunk), per_cta));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t per_miss = p.per_miss;
  for (int64_t c0 = static_cast<int64_t>(blockIdx.x) * chunk; c0 < count;
       c0 += static_cast<int64_t>(gridDim.x) * chunk) {
    const int n = static_cast<int>(min(static_cast<int64_t>(chunk), count - c0));
    if constexpr (SORT) {
      __syncthreads();  // the previous chunk's entries are read
      const int t = threadIdx.x;
      unsigned long long key = ~0ull;
      int4 e = make_int4(-1, -1, -1, -1);
      if (t < n) {
        e = load_entry(p, c0 + t);
        const int64_t h = host_slot_of(p, p.buf[0], e);
        if (h >= 0)
          key = static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(part_src(p.buf[0], e, h, 0)));
      }
      s_entry[t] = e;
      s_key[t] = (key << 8) | static_cast<unsigned long long>(t);  // the index survives any key
      __syncthreads();
      for (int k = 2; k <= kWarpChunk; k <<= 1) {  // bitonic sort, ascending
        for (int j = k >> 1; j > 0; j >>= 1) {
          const int partner = t ^ j;
          if (partner > t) {
            const unsigned long long a = s_key[t], b = s_key[partner];
            if ((a > b) == ((t & k) == 0)) s_key[t] = b, s_key[partner] = a;
          }
          __syncthreads();
        }
      }
    }
    const int lo = warp * n / kWarpsPerCta, hi = (warp + 1) * n / kWarpsPerCta;
    for (int g = lo; g < hi; g += p.warp_misses) {
      const int64_t items = static_cast<int64_t>(min(p.warp_misses, hi - g)) * per_miss;
      const bool narrow = items <= INT32_MAX;  // warp-uniform: 32-bit divisions
      for (int64_t base = lane; base < items; base += 32 * kWarpIlp) {
        uint4 val[kWarpIlp];
        uint8_t* dst[kWarpIlp];
        int vec[kWarpIlp];
#pragma unroll
        for (int i = 0; i < kWarpIlp; ++i) {
          dst[i] = nullptr;
          vec[i] = 16;
          const int64_t t = base + 32 * i;
          if (t >= items) continue;
          const int q = narrow ? static_cast<int>(static_cast<uint32_t>(t) / static_cast<uint32_t>(per_miss))
                               : static_cast<int>(t / per_miss);
          const int ww = static_cast<int>(t - q * per_miss);
          int b = 0;
          while (b + 1 < p.nb && ww >= p.buf[b + 1].begin) ++b;
          const FetchBuffer& B = p.buf[b];
          const int w = ww - B.begin;
          int4 e;
          if constexpr (SORT) e = s_entry[s_key[g + q] & 0xFF];
          else e = load_entry(p, c0 + g + q);
          const int64_t h = host_slot_of(p, B, e);
          if (h < 0) continue;
          vec[i] = B.vec;
          if (LINES && B.vec == 16) {
            const int k = w / B.vpp;  // chunk; the part is the (w % vpp)-th vector of its lines
            const int64_t start = k * B.chunk_bytes;
            const uint8_t* const src = part_src(B, e, h, start);
            const uint8_t* const page_lo = B.host + h * B.host_stride;
            const uint8_t* const page_hi = page_lo + B.page_bytes;
            const uintptr_t s0 = reinterpret_cast<uintptr_t>(src);
            const uint8_t* line_lo = reinterpret_cast<const uint8_t*>(s0 & ~uintptr_t{127});
            const uint8_t* line_hi =
                reinterpret_cast<const uint8_t*>((s0 + B.piece + 127) & ~uintptr_t{127});
            if (line_lo < page_lo) line_lo = page_lo;
            if (line_hi > page_hi) line_hi = page_hi;
            const uint8_t* const a = line_lo + static_cast<int64_t>(w - k * B.vpp) * 16;
            if (a >= line_hi) continue;
            val[i] = load_vec(a, 16);
            const int64_t off = a - src;
            if (off >= 0 && off < B.piece) dst[i] = part_dst(p, B, e, start) + off;
          } else {
            const int64_t inner = part_offset(B, w);
            val[i] = load_vec(part_src(B, e, h, inner), vec[i]);
            dst[i] = part_dst(p, B, e, inner);
          }
        }
#pragma unroll
        for (int i = 0; i < kWarpIlp; ++i)
          if (dst[i] != nullptr) store_vec(dst[i], val[i], vec[i]);
      }
    }
  }
}

template <bool SORT, bool LINES>
__global__ __launch_bounds__(kWarpThreads) void fetch_warp_kernel(const __grid_constant__ FetchParams p) {
  fetch_warp<SORT, LINES>(p);
}

__global__ __launch_bounds__(kWarpThreads) void fetch_warp_groups_kernel(
    const __grid_constant__ FetchGroupParams ps) {
  __shared__ FetchParams s_part;
  stage_words(&s_part, &ps.part[blockIdx.y], sizeof(FetchParams) / 4);
  __syncthreads();
  fetch_warp<false, false>(s_part);
}

// ------------------------------------------------------------------------------------------------
// host wrapper

using FetchKernel = void (*)(FetchParams);

// The launch parts of one group's fetch: its buffers in sets of up to kMaxFetchBuffers, each
// with the group's miss list.
void plan_fetch(const FetchGroupArgs& a, std::vector<FetchParams>& parts) {
  FetchParams p;
  std::memset(&p, 0, sizeof p);  // every field not set below is 0
  p.miss_list = a.miss_list->data_ptr<int32_t>();
  p.miss_count = a.miss_count->data_ptr<int32_t>();
  p.list_rows = a.miss_list->size(0);
  p.list_aligned = reinterpret_cast<uintptr_t>(p.miss_list) % 16 == 0;
  p.slots = a.slots;
  p.warp_misses = tuning().fetch_warp_misses;
  if (p.list_rows == 0) return;
  for (size_t b = 0; b < a.cells.size(); ++b) {
    const at::Tensor& cell = a.cells[b];
    const HostPages host = host_pages_of(a.host_pools[b], a.positions[b]);
    const int64_t chunks = cell.size(1), P = cell.size(2);
    const int64_t chunk_bytes = P * cell.size(3);
    const int64_t page_bytes = chunks * chunk_bytes;
    if (page_bytes == 0) continue;  // zero-size buffer (CFG-6)
    const int64_t piece = a.tokens_per_unit * cell.size(3);
    const int64_t E = P / a.tokens_per_unit;  // fits int32 (check_fetch)
    FetchBuffer& B = p.buf[p.nb];
    B.cells = cell.data_ptr<uint8_t>();
    B.host = host.data;
    B.table = a.page_tables[b].data_ptr<int32_t>();
    B.num_entries = cell.size(0) * E;
    B.table_rows = a.page_tables[b].size(0);
    B.table_pages = a.page_tables[b].size(1);
    B.host_slots = host.slots;
    B.host_stride = host.slot_stride;
    B.page_bytes = page_bytes;
    B.chunk_bytes = chunk_bytes;
    B.piece = piece;
    B.E = static_cast<int32_t>(E);
    B.vec = vector_bytes({static_cast<uint64_t>(piece), static_cast<uint64_t>(chunk_bytes),
                          static_cast<uint64_t>(page_bytes), static_cast<uint64_t>(B.host_stride),
                          reinterpret_cast<uintptr_t>(B.cells), reinterpret_cast<uintptr_t>(B.host)});
    const int64_t vpp = piece / B.vec;
    const int64_t per_miss = p.per_miss + chunks * vpp;
    TORCH_CHECK(per_miss <= INT32_MAX, "fetch: too many bytes per unit");
    B.vpp = static_cast<int32_t>(vpp);
    B.begin = p.per_miss;
    p.per_miss = static_cast<int32_t>(per_miss);
    if (++p.nb == kMaxFetchBuffers) {
      parts.push_back(p);
      p.nb = 0;
      p.per_miss = 0;
    }
  }
  if (p.nb > 0) parts.push_back(p);
}

// The vector-item sweep for launch parts of small pieces only (kWarpMinPiece), else one warp
// per miss; the development knob may choose either for every part.
bool sweeps(const FetchParams& p) {
  const int warp = tuning().fetch_warp;
  if (warp >= 0) return warp == 0;
  for (int b = 0; b < p.nb; ++b)
    if (p.buf[b].piece >= kWarpMinPiece) return false;
  return true;
}

// The fixed grid of a kernel: every CTA of `threads` threads that fits on each SM (or the
// development knob's number, at most).
int grid_of(const void* kernel, int device, int threads, size_t dynamic_smem = 0) {
  const int fit = std::max(1, blocks_per_sm(kernel, device, threads, dynamic_smem));
  const int per_sm = tuning().fetch_blocks_per_sm > 0 ? std::min(tuning().fetch_blocks_per_sm, fit)
                                                      : fit;
  return device_info(device).sms * per_sm;
}

#ifdef KVCM2_DEV
// Bulk copies for launch parts whose every piece has at least tma_min_piece bytes (INT64_MAX:
// never) and 16-byte aligned buffers, through stages of up to tuning().fetch_tma_stage bytes
// (the widest piece, at most); one CTA per SM with as many threads as two stages each fit.
// False: not this part.
bool launch_tma(FetchParams p, int device, cudaStream_t stream) {
  const DeviceInfo& info = device_info(device);
  const int tma = tuning().fetch_tma;
  const int64_t tma_min_piece =
      (info.cc_major < 9 || tma == 0) ? INT64_MAX : tma == 1 ? 0 : kTmaMinPiece;
  const int smem_budget = std::min(info.smem_optin, kTmaSmemBudget);
  int64_t widest = 0;
  for (int b = 0; b < p.nb; ++b) {
    if (p.buf[b].vec != 16 || p.buf[b].piece < tma_min_piece) return false;
    widest = std::max(widest, p.buf[b].piece);
  }
  const int64_t SB = std::min<int64_t>(tuning().fetch_tma_stage, widest);
  int threads = static_cast<int>(std::min<int64_t>(kTmaMaxThreads, smem_budget / (2 * SB + 16)));
  if (threads >= 32) threads = threads / 32 * 32;
  int64_t per_miss = 0;
  for (int b = 0; b < p.nb; ++b) {
    FetchBuffer& B = p.buf[b];
    const int64_t chunks = B.page_bytes / B.chunk_bytes;
    B.vec = static_cast<int32_t>(SB);
    B.vpp = static_cast<int32_t>((B.piece + SB - 1) / SB);
    B.begin = static_cast<int32_t>(per_miss);
    per_miss += chunks * B.vpp;
  }
  p.per_miss = static_cast<int32_t>(per_miss);  // < the 16-byte vector count, an int32
  p.stage_bytes = static_cast<int32_t>(SB);
  const size_t smem = static_cast<size_t>(threads) * (2 * SB + 16);
  allow_dynamic_smem(kernel_id(fetch_tma_kernel), device, smem);
  launch_kernel(fetch_tma_kernel, dim3(static_cast<unsigned>(info.sms)), dim3(threads), smem,
                stream, p);
  return true;
}

// fetch_kernel with `ilp` loads in flight per thread (Tuning::fetch_ilp).
FetchKernel fetch_kernel_for(int ilp) {
  switch (ilp) {
    case 1: return fetch_kernel<1>;
    case 4: return fetch_kernel<4>;
    case 8: return fetch_kernel<8>;
    default: return fetch_kernel<kFetchIlp>;
  }
}
#endif

// One launch part alone: the per-group op's launch (and, in development builds, any part the
// group kernels do not cover).
void launch_part(FetchParams p, int device, cudaStream_t stream) {
#ifdef KVCM2_DEV
  if (launch_tma(p, device, stream)) return;
  const FetchKernel vector_kernel = fetch_kernel_for(tuning().fetch_ilp);
#else
  const FetchKernel vector_kernel = fetch_kernel<kFetchIlp>;
#endif
  if (sweeps(p)) {
    launch_kernel(vector_kernel, dim3(grid_of(kernel_id(vector_kernel), device, kFetchThreads)),
                  dim3(kFetchThreads), 0, stream, p);
    return;
  }
  FetchKernel kernel = fetch_warp_kernel<false, false>;
#ifdef KVCM2_DEV
  const bool lines = tuning().fetch_lines;
  if (lines) {  // 16-byte buffers: parts are the vectors of the lines a piece can touch
    int64_t per_miss = 0;
    for (int b = 0; b < p.nb; ++b) {
      FetchBuffer& B = p.buf[b];
      if (B.vec == 16) B.vpp = static_cast<int32_t>((B.piece + 112 + 127) / 128 * 8);
      B.begin = static_cast<int32_t>(per_miss);
      per_miss += B.page_bytes / B.chunk_bytes * B.vpp;
    }
    TORCH_CHECK(per_miss <= INT32_MAX, "fetch: too many bytes per unit");
    p.per_miss = static_cast<int32_t>(per_miss);
  }
  kernel = tuning().fetch_warp == 2
               ? (lines ? fetch_warp_kernel<true, true> : fetch_warp_kernel<true, false>)
               : (lines ? fetch_warp_kernel<false, true> : fetch_warp_kernel<false, false>);
#endif
  launch_kernel(kernel, dim3(grid_of(kernel_id(kernel), device, kWarpThreads)),
                dim3(kWarpThreads), 0, stream, p);
}

void fetch_cuda(const at::TensorList& cells, const at::TensorList& host_pools,
                at::IntArrayRef positions, const at::TensorList& page_tables,
                const at::Tensor& miss_list, const at::Tensor& miss_count, int64_t slots,
                int64_t tokens_per_unit) {
  check_fetch(cells, host_pools, positions, page_tables, miss_list, miss_count, slots,
              tokens_per_unit);
  const c10::cuda::CUDAGuard guard(miss_list.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  std::vector<FetchParams> parts;
  plan_fetch({cells, host_pools, page_tables, positions, &miss_list, &miss_count, slots,
              tokens_per_unit},
             parts);
  for (const FetchParams& p : parts) launch_part(p, miss_list.get_device(), stream);
}

}  // namespace

struct FetchPlan {
  std::vector<FetchParams> parts;
};

std::shared_ptr<const FetchPlan> plan_fetch_groups(const std::vector<FetchGroupArgs>& groups) {
  auto plan = std::make_shared<FetchPlan>();
  for (const FetchGroupArgs& a : groups) plan_fetch(a, plan->parts);
  return plan;
}

void launch_fetch_groups(const FetchPlan& plan, cudaStream_t stream, bool apart) {
  const std::vector<FetchParams>& parts = plan.parts;
  if (parts.empty()) return;
  const int device = c10::cuda::current_device();
#ifdef KVCM2_DEV
  // The development variants (bulk copies, other loop widths, sorted or whole-line warps) run
  // part by part, as the per-group op does.
  apart = apart || tuning().fetch_tma != 0 || tuning().fetch_ilp != kFetchIlp ||
          tuning().fetch_lines || tuning().fetch_warp == 2;
#endif
  if (apart) {
    for (const FetchParams& p : parts) launch_part(p, device, stream);
    return;
  }
  // One launch per kernel and per kMaxFetchGroups parts, on the kernel's fixed grid.
  for (const bool sweep : {true, false}) {
    const void* kernel = sweep ? kernel_id(fetch_groups_kernel<kFetchIlp>)
                               : kernel_id(fetch_warp_groups_kernel);
    const int threads = sweep ? kFetchThreads : kWarpThreads;
    const int grid =
        grid_of(kernel, device, threads, sweep ? kMaxFetchGroups * sizeof(FetchParams) : 0);
    std::vector<const FetchParams*> mine;
    for (const FetchParams& p : parts)
      if (sweeps(p) == sweep) mine.push_back(&p);
    for (size_t first = 0; first < mine.size(); first += kMaxFetchGroups) {
      const int n = static_cast<int>(std::min<size_t>(kMaxFetchGroups, mine.size() - first));
      FetchGroupParams ps;
      for (int y = 0; y < n; ++y) ps.part[y] = *mine[first + y];
      ps.n = n;
      if (sweep)  // one item space: the whole grid
        launch_kernel(fetch_groups_kernel<kFetchIlp>, dim3(grid), dim3(threads),
                      n * sizeof(FetchParams), stream, ps);
      else  // part y in CTAs (x, y): the grid shared between the parts
        launch_kernel(fetch_warp_groups_kernel,
                      dim3(static_cast<unsigned>(std::max(4, grid / n)), static_cast<unsigned>(n)),
                      dim3(threads), 0, stream, ps);
    }
  }
}

TORCH_LIBRARY_IMPL(torch_kvcm2, CUDA, m) { m.impl("fetch", &fetch_cuda); }

}  // namespace torch_kvcm2
