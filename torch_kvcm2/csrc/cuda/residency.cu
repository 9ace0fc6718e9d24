// CUDA kernels of OP-RESOLVE and OP-FETCH. They reproduce cpu/residency.cpp bit for bit; only the
// order of rows inside the miss list may differ (INT-4).
//
// resolve: one CTA per row, the lease's residency rows staged in shared memory, O(K + S) work per
// row and no global sort:
//   preamble  before the PDL wait (pdl.cuh), so it overlaps the previous kernel: the row's lease,
//             history and capacity read early (checked after the wait; a stale attempt is redone)
//             and the row rules, then the shared-memory init;
//   load      the selection (cp.async, first), resident (cp.async) and recency (to registers);
//             a row whose live unit range fits the table's space fills a direct table of one
//             word per unit (first column << 16 | lowest slot) from each thread's own copies
//             of the selection as they land: no hashing, no probes;
//   hash      for the other rows (long live ranges, or a selected ordinal outside the range), a
//             shared open-addressing hash of the selected ordinals (atomicCAS insert; atomicMin
//             keeps each ordinal's first column), >= 4K entries when shared memory allows (short
//             probes), filled while the lease's rows still arrive; then recency from registers.
//             The phases after this choice are compiled once per mode;
//   slots     step 0 (a dropped unit's slot is written back at once) and each slot's victim kind
//             (empty or evictable); every resident slot looks its unit up in the table
//             (atomicMin: lowest slot wins, like the CPU's slot_of.emplace) and the in-flight
//             array (which in-flight units are resident);
//   scan 1    columns: first-occurrence kinds (invalid, hit, miss), hit slots (step 2) and pinned
//             slots (step 1) lose their victim kind, hit slots take their class, the index
//             entries that place cannot change are written (step 5), admissions; one block scan
//             ranks misses in column order, admissions in unit order and the victims among
//             recency positions 0..511 (one per thread); further rounds of 512 positions (warp
//             ballots) only while victims are missing: the victims are the first `placed` empty
//             slots, then evictable ones, each in recency order; it also sums hits/invalid for
//             the counters;
//   place     victim k takes admission k, then miss k - #admissions (the resident row is
//             written at the placed slots);
//   index     the row's in-flight slot records and the index entries left pending (placed
//             misses and admissions; every column after place hid a slot, on bad data);
//   scan 2    the stable 4-way partition of recency (untouched, misses, pinned, hits);
//   write     the row's miss-list entries at a base reserved with one 64-bit atomic per CTA
//             (reserve / publish_if_last: issued after scan 1, consumed at the end to hide its
//             latency; no memset before launch), then recency.
// Scans run over blocked per-thread ranges of whole 4/8/16-byte chunks (load_chunk /
// store_chunk), so the sequential shared arrays are read without bank conflicts.
//
// fetch: a fixed grid sweeps (miss, buffer, chunk, vector) work items, several vector loads in
// flight per thread before any store, loads through the device-mapped view of pinned host memory;
// pieces of >= 32 KiB go by bulk copies (TMA) through shared memory instead (fetch_tma_kernel).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_pipeline.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <type_traits>

#include "../kvcm2.h"
#include "pdl.cuh"

namespace torch_kvcm2 {
namespace {

// ------------------------------------------------------------------------------------------------
// Device properties, queried once per device (host calls only, no synchronisation, capture-safe).

constexpr int kMaxDevices = 64;

struct DeviceInfo {
  bool ready = false;
  int sms = 0;
  int smem_optin = 0;           // max shared memory per block (static + dynamic), opt-in
  int resolve_static_smem = 0;  // resolve_kernel's static shared memory (scan temp storage)
  int resolve_smem_set = 0;     // dynamic shared memory limit already raised for resolve_kernel
  int fetch_blocks_per_sm = 0;  // fetch CTAs per SM of the fixed grid (default: all that fit)
  int fetch_ilp = 2;            // vector loads in flight per fetch thread
  // Bulk-copy fetches (fetch_tma_kernel) for launches whose every piece has at least
  // fetch_tma_min_piece bytes (INT64_MAX: never), through stages of up to fetch_tma_stage bytes.
  int64_t fetch_tma_min_piece = INT64_MAX;
  int fetch_tma_stage = 8192;
  // KVCM2_RESOLVE_FORCE_STALE=1 (tests only): the resolve kernel alters the lease, history and
  // capacity it reads before the PDL wait, so every row takes the path that redoes a stale
  // attempt with the values read after the wait (scripts/gpu_check.sh runs the residency tests
  // so too).
  bool resolve_force_stale = false;
};

// Development knobs for benchmarks/fetch_sweep.py, read once per process: KVCM2_FETCH_ILP (1, 2,
// 4 or 8 loads in flight per thread), KVCM2_FETCH_BLOCKS_PER_SM (fetch grid size), KVCM2_FETCH_TMA
// (0: vector loads only; 1: bulk copies for every 16-byte aligned launch) and
// KVCM2_FETCH_TMA_STAGE (bytes per bulk-copy stage). Unset, the measured defaults apply: ILP 2,
// every CTA that fits, bulk copies of 8-KB stages for pieces of >= 32 KiB (benchmarks/NOTES.md:
// ILP 2 was at or above ILP 4 on every shape; bulk copies gained 3-4% on 42-KB pages and lost
// on 656-B rows (-40%), 5-KB units (1.6-1.9x slower) and 21-KB units).
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? std::atoi(v) : fallback;
}

std::mutex g_info_mutex;
DeviceInfo g_info[kMaxDevices];

void init_device_info(DeviceInfo& info, int device);  // after the kernels are declared

// Call with g_info_mutex held; the guard has made `device` current.
DeviceInfo& device_info(int device) {
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "torch_kvcm2: device index ", device,
              " out of range");
  DeviceInfo& info = g_info[device];
  if (!info.ready) {
    init_device_info(info, device);
    info.ready = true;
  }
  return info;
}

// ------------------------------------------------------------------------------------------------
// resolve

#ifndef KVCM2_RESOLVE_THREADS
#define KVCM2_RESOLVE_THREADS 512
#endif
constexpr int kResolveThreads = KVCM2_RESOLVE_THREADS;
constexpr int kIlpGlobal = 8;  // recency loads in flight per thread while staging
constexpr int32_t kNoSlot = INT32_MAX;  // "no slot yet": the identity of atomicMin
constexpr int32_t kEmptyKey = -1;       // hash keys are selected ordinals, all >= 0
constexpr uint8_t kPending = 4;  // ckind flag: a selectable unit's column without a slot yet

// Shared-memory layout of one resolve CTA; the host sizes the launch with the same function
// (I = int64_t there, uint32_t on the device where every size is small). The table region comes
// first: the hash (key, hslot, first) or, for a row whose live unit range fits, the direct unit
// table (one word per unit over the whole region); it is dead after the index phase, so newrec
// (uint16, written by scan 2) reuses it.
template <typename I>
struct ResolveLayout {
  I key, hslot, first;  // int32 arrays of H entries (the hash)
  I table_words;        // words in the table region: the longest unit range a direct table takes
  I res, infl, admit;   // int32 arrays
  I rec, vlist;         // uint16 arrays
  I vk, cls, pclass, ckind;  // uint8 arrays
  I col_entry, miss_entry;  // int32 arrays
  I newrec;
  I bytes;

  ResolveLayout() = default;
  KVCM2_HD ResolveLayout(I S, I K, I H, I MI) {
    I at = 0;
    auto take = [&at](I n) {
      const I off = at;
      at += (n + 15) / 16 * 16;  // keep every array 16-byte aligned
      return off;
    };
    key = take(4 * H);
    hslot = take(4 * H);
    first = take(4 * H);
    if (at < 2 * S) at = (2 * S + 15) / 16 * 16;
    table_words = at / 4;
    newrec = 0;
    res = take(4 * S);
    infl = take(4 * MI);
    admit = take(4 * MI);
    rec = take(2 * S);
    vlist = take(2 * S);
    vk = take(S);
    cls = take(S);
    pclass = take(S);
    ckind = take(K);
    col_entry = take(4 * K);
    miss_entry = take(4 * K);
    bytes = at;
  }
};

struct ResolveParams {
  int32_t* resident;   // [leases, S]
  int32_t* recency;    // [leases, S]
  int32_t* index_table;  // [rows, K]
  int32_t* miss_list;  // [>= rows * (K + MI), 4]
  int32_t* miss_count; // [kMissCountWords]: the count at [0], the reservation word at [2:4]
  unsigned long long* reservation;  // CTAs done << 32 | entries reserved; 0 between launches
  unsigned long long* counters;  // int64[3], two's complement: unsigned atomics are exact
  int32_t* inflight_slots;       // [rows, MI]
  const int32_t* selected;       // [rows, K]
  const int32_t* history;
  const int32_t* capacity;
  const int32_t* lease;
  int64_t leases, tokens_per_unit, tokens_per_page, max_inflight_tokens, window;
  int32_t rows, S, K, MI;
  int32_t hash_bits;  // hash table of 1 << hash_bits entries, >= 2K: load factor <= 1/2
  int32_t force_stale;  // DeviceInfo::resolve_force_stale
  // Offsets in dynamic shared memory, computed on the host: kernel parameters live in the
  // constant bank, so the kernel does not spend registers on 13 array addresses.
  ResolveLayout<uint32_t> L;
};

constexpr int kResolveWarps = kResolveThreads / 32;
constexpr unsigned kAll = 0xffffffffu;

// What a block scan ranks: counts in 16-bit lanes of one 64-bit word (scan 1: misses, admissions,
// and the empty and evictable slots of the victim search's first round; scan 2: the four recency
// classes); every count is <= 65535 (S, K and MI are checked on the host), so no lane carries
// into the next. And what scan 1 only totals, in 16-bit halves of a 32-bit word: one warp
// reduction (REDUX) each, no shuffle scan.
struct Tally {
  unsigned long long rank;
  uint32_t hits_invalid;  // hits | invalid << 16
  uint32_t fetch_empty;   // admissions that need a fetch (partly written head units) | empty
                          // slots << 16
};

enum RankLane : int { kMissLane = 0, kAdmitLane = 16, kEmptyLane = 32, kEvictLane = 48 };

__device__ __forceinline__ uint32_t lane16(unsigned long long w, int shift) {
  return static_cast<uint32_t>(w >> shift) & 0xffffu;
}

// Block-wide with one barrier: returns the exclusive prefix of x.rank (a shuffle scan per warp;
// after the barrier lane w of every warp reads warp w's total and a second shuffle scan over those
// kResolveWarps lanes gives each warp the sum of the warps before it) and sets `total` to the
// block's sums of every field. warp_total must not be reused by another scan before a later
// barrier.
__device__ __forceinline__ unsigned long long block_scan(const Tally& x, Tally& total,
                                                         Tally* warp_total) {
  static_assert(kResolveWarps <= 32, "one lane per warp total");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long inc = x.rank;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const unsigned long long y = __shfl_up_sync(kAll, inc, d);
    if (lane >= d) inc += y;
  }
  const uint32_t hi = __reduce_add_sync(kAll, x.hits_invalid);
  const uint32_t fe = __reduce_add_sync(kAll, x.fetch_empty);
  if (lane == 31) warp_total[warp] = Tally{inc, hi, fe};
  __syncthreads();
  const Tally t = lane < kResolveWarps ? warp_total[lane] : Tally{};
  unsigned long long w = t.rank;
#pragma unroll
  for (int d = 1; d < kResolveWarps; d <<= 1) {  // lanes >= kResolveWarps hold unused sums
    const unsigned long long y = __shfl_up_sync(kAll, w, d);
    if (lane >= d) w += y;
  }
  total.rank = __shfl_sync(kAll, w, kResolveWarps - 1);
  total.hits_invalid = __reduce_add_sync(kAll, t.hits_invalid);
  total.fetch_empty = __reduce_add_sync(kAll, t.fetch_empty);
  const unsigned long long below = __shfl_sync(kAll, w, warp > 0 ? warp - 1 : 0);  // uniform
  // The exclusive warp prefix is the inclusive prefix of the previous lane.
  const unsigned long long prev = __shfl_up_sync(kAll, inc, 1);
  return (warp > 0 ? below : 0ull) + (lane > 0 ? prev : 0ull);
}

// This thread's contiguous share [lo, hi) of n items, whole chunks of V items (only the last
// share may end inside one): scans need a blocked arrangement so ranks follow item order, and a
// chunk loads and stores as one vector (V * sizeof(item) = 4, 8 or 16 bytes), which keeps the
// sequential arrays free of bank conflicts.
template <int V>
__device__ __forceinline__ void blocked_range(int n, int& lo, int& hi) {
  const int per = ((n + kResolveThreads - 1) / kResolveThreads + V - 1) / V * V;
  lo = min(n, static_cast<int>(threadIdx.x) * per);
  hi = min(n, lo + per);
}

template <int Bytes> struct VectorOf;
template <> struct VectorOf<4> { using type = uint32_t; };
template <> struct VectorOf<8> { using type = uint2; };
template <> struct VectorOf<16> { using type = uint4; };

// Chunk [b, b + V) of a 16-byte-aligned shared array, b a multiple of V: one vector access when
// the chunk lies within [.., hi), else item by item (`fill` past hi).
template <int V, typename T>
union Chunk {
  typename VectorOf<V * sizeof(T)>::type vec;
  T item[V];
};

template <int V, typename T>
__device__ __forceinline__ void load_chunk(const T* a, int b, int hi, T (&v)[V], T fill) {
  Chunk<V, T> c;
  if (b + V <= hi) {
    c.vec = *reinterpret_cast<const decltype(c.vec)*>(a + b);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) c.item[i] = b + i < hi ? a[b + i] : fill;
  }
#pragma unroll
  for (int i = 0; i < V; ++i) v[i] = c.item[i];
}

template <int V, typename T>
__device__ __forceinline__ void store_chunk(T* a, int b, int hi, const T (&v)[V]) {
  Chunk<V, T> c;
#pragma unroll
  for (int i = 0; i < V; ++i) c.item[i] = v[i];
  if (b + V <= hi) {
    *reinterpret_cast<decltype(c.vec)*>(a + b) = c.vec;
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i)
      if (b + i < hi) a[b + i] = c.item[i];
  }
}

// Miss-list reservation, once per CTA by one thread: every CTA adds (1 << 32) + n to the
// reservation word (reserve: the returned word's low half is its first entry); the one that saw
// all others done publishes the total as miss_count[0] and resets the word for the next launch
// (publish_if_last). So miss_count needs no memset (a graph node of its own) before each resolve.
// The two are apart so the atomic's round trip overlaps the CTA's later phases.
__device__ __forceinline__ unsigned long long reserve(const ResolveParams& p, int n) {
  return atomicAdd(p.reservation, (1ull << 32) + static_cast<unsigned>(n));
}

__device__ __forceinline__ void publish_if_last(const ResolveParams& p, unsigned long long old,
                                                int n) {
  if (static_cast<uint32_t>(old >> 32) == static_cast<uint32_t>(p.rows - 1)) {
    p.miss_count[0] = static_cast<int32_t>(static_cast<uint32_t>(old) + n);
    *p.reservation = 0;  // every other CTA's add precedes ours in the word's atomic order
  }
}

// RowRange's unit rules in 32-bit arithmetic, for the loops that test thousands of units per row.
// Every bound fits int32 (h and c are int32, U >= 1), and (u + 1) * U <= h  <=>  u < floor(h / U),
// so the answers equal RowRange's for every int32 u.
struct UnitRules {
  int32_t live;     // max(first_live_unit, 0)
  int32_t settled;  // floor(h / U): units wholly history
  int32_t first_inflight;
  uint32_t n_inflight;

  UnitRules() = default;
  __device__ explicit UnitRules(const RowRange& r)
      : live(static_cast<int32_t>(r.first_live_unit > 0 ? r.first_live_unit : 0)),
        settled(static_cast<int32_t>(floor_div(r.history, r.tokens_per_unit))),  // h >= 0
        first_inflight(static_cast<int32_t>(r.first_inflight)),
        n_inflight(static_cast<uint32_t>(r.end_inflight - r.first_inflight)) {}

  // Unsigned difference: a negative u wraps to >= 2^31 - first_inflight > n_inflight.
  __device__ __forceinline__ bool inflight(int32_t u) const {
    return static_cast<uint32_t>(u) - static_cast<uint32_t>(first_inflight) < n_inflight;
  }
  // Bitwise, not short-circuit: three compares and no branches in the loops over S and K.
  __device__ __forceinline__ bool selectable(int32_t u) const {
    return (u >= live) & ((u < settled) | inflight(u));
  }
};

__device__ __forceinline__ int hash_home(int32_t u, int bits) {
  return static_cast<int>((static_cast<uint32_t>(u) * 2654435769u) >> (32 - bits));
}

// Only called once the table is complete (after a barrier); the table is never full.
__device__ __forceinline__ int hash_find(const int32_t* key, int32_t u, int bits) {
  const int mask = (1 << bits) - 1;
  for (int h = hash_home(u, bits);; h = (h + 1) & mask) {
    const int32_t k = key[h];
    if (k == u) return h;
    if (k == kEmptyKey) return -1;
  }
}

// A global load issued exactly here: an asm volatile load is neither sunk into a later branch
// nor merged with another.
__device__ __forceinline__ int32_t load_in_place(const int32_t* src) {
  int32_t v;
  asm volatile("ld.global.b32 %0, [%1];" : "=r"(v) : "l"(src));
  return v;
}

// The row rules of one row, out of line: the kernel needs them at three places (the preamble,
// an early hole, a stale attempt), and each inlined copy of RowRange's int64 divisions is
// ~2 KB of code; one copy keeps the hot path denser in the instruction cache.
// (Scalars, not the parameter struct: a reference to a kernel parameter would copy it to local
// memory.)
__device__ __noinline__ RowRange row_range(int32_t h, int32_t c, int64_t U, int64_t P, int64_t I,
                                           int64_t window) {
  return RowRange(h, c, U, P, I, window);
}

// v, hidden from the optimiser: what is computed from the result stays after this point (an
// asm volatile is not hoisted out of a loop), so no loop-invariant use of a value loaded just
// before waits for that load ahead of the loop.
__device__ __forceinline__ int32_t opaque(int32_t v) {
  int32_t out;
  asm volatile("mov.b32 %0, %1;" : "=r"(out) : "r"(v));
  return out;
}

// Starts copying src[0 .. n) to dst (16-byte aligned shared memory) with the CTA, 16 bytes per
// cp.async when src is 16-byte aligned.
__device__ __forceinline__ void copy_async(int32_t* dst, const int32_t* src, int n) {
  int done = 0;
  if ((reinterpret_cast<uintptr_t>(src) & 15) == 0) {
#pragma unroll 1
    for (int i = threadIdx.x; i < n / 4; i += kResolveThreads)
      __pipeline_memcpy_async(dst + 4 * i, src + 4 * i, 16);
    done = n / 4 * 4;
  }
#pragma unroll 1
  for (int i = done + threadIdx.x; i < n; i += kResolveThreads)
    __pipeline_memcpy_async(dst + i, src + i, 4);
}

// Sets p[0 .. n) to v with the CTA: 16-byte stores, then the tail. p must be 16-byte aligned.
__device__ __forceinline__ void fill_words(int32_t* p, int n, int32_t v) {
  const int4 v4 = make_int4(v, v, v, v);
#pragma unroll 4
  for (int i = threadIdx.x; i < n / 4; i += kResolveThreads) reinterpret_cast<int4*>(p)[i] = v4;
  for (int i = n / 4 * 4 + threadIdx.x; i < n; i += kResolveThreads) p[i] = v;
}

// Visits first, first + step, ... < end, N items at a time: f(idx, ok) can issue the loads of all
// N items before using any. Measured on an H200: worth it (N = 8) for phases of sequential
// accesses; phases of random shared-memory accesses and atomics got slower (bank-conflict
// throughput, not latency, bounds them), so they use N = 1.
template <int N, typename F>
__device__ __forceinline__ void for_chunks(int first, int end, int step, F&& f) {
#pragma unroll 1
  for (int base = first; base < end; base += N * step) {
    int idx[N];
    bool ok[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      idx[i] = base + i * step;
      ok[i] = idx[i] < end;
      if (!ok[i]) idx[i] = base;  // a readable index; its result is ignored
    }
    f(idx, ok);
  }
}

// For this thread's recency positions q in [lo, hi) (a blocked_range<8>): out[q] =
// by_slot[rec[q]], one byte gather per position; returns the sum of weight(out[q]).
template <typename T, typename W>
__device__ __forceinline__ T gather_by_recency(const uint16_t* rec, const uint8_t* by_slot,
                                               uint8_t* out, int lo, int hi, W weight) {
  T sum = 0;
#pragma unroll 1
  for (int b = lo; b < hi; b += 8) {
    uint16_t sl[8];
    uint8_t k[8];
    load_chunk(rec, b, hi, sl, uint16_t{0});
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      k[i] = b + i < hi ? by_slot[sl[i]] : 0;
      if (b + i < hi) sum += weight(k[i]);
    }
    store_chunk(out, b, hi, k);
  }
  return sum;
}

#ifdef KVCM2_PROFILE  // phase timing of CTA 0, for development only
// Phases end at PROF(1..11); the load, hash and write phases are split further at
// PROF_PART(0..7): load = rows issued + row rules, infl fill, selection wait, direct insert,
// verify (the lease, history and capacity read after the PDL wait) + vote; hash = hash insert,
// recency staging, resident wait + barrier; write = miss-list entries, recency row. "fill"
// includes the early reads of the lease, history and capacity.
#define KVCM2_PROF_BEGIN() long long prof_t[12], prof_p[8]; prof_t[0] = clock64()
#define KVCM2_PROF(i) prof_t[i] = clock64()
#define KVCM2_PROF_PART(i) prof_p[i] = clock64()
#define KVCM2_PROF_END()                                                                       \
  const long long prof_end = clock64();                                                        \
  if (blockIdx.x == 0 && threadIdx.x == 0) {                                                   \
    printf("resolve phases (cycles): %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld "  \
           "%lld\n",                                                                           \
           prof_t[1] - prof_t[0], prof_t[2] - prof_t[1], prof_t[3] - prof_t[2],                \
           prof_t[4] - prof_t[3], prof_t[5] - prof_t[4], prof_t[6] - prof_t[5],                \
           prof_t[7] - prof_t[6], prof_t[8] - prof_t[7], prof_t[9] - prof_t[8],                \
           prof_t[10] - prof_t[9], prof_t[11] - prof_t[10], prof_end - prof_t[11]);            \
    printf("resolve parts (cycles): %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld\n",      \
           prof_p[0] - prof_t[3], prof_p[1] - prof_p[0], prof_p[2] - prof_p[1],                \
           prof_p[3] - prof_p[2], prof_t[4] - prof_p[3], prof_p[4] - prof_t[4],                \
           prof_p[5] - prof_p[4], prof_t[5] - prof_p[5], prof_p[6] - prof_t[11],               \
           prof_p[7] - prof_p[6]);                                                             \
  }                                                                                            \
  if (threadIdx.x == 0) printf("resolve cta (cycles after the wait): %lld\n", prof_end - prof_t[2])
#else
#define KVCM2_PROF_BEGIN()
#define KVCM2_PROF(i)
#define KVCM2_PROF_PART(i)
#define KVCM2_PROF_END()
#endif

// One CTA per row, 1 CTA per SM (K=2048, S=4096 takes ~158 KB of shared memory with the sparse
// hash). Measured on an H200 (P-RES: 64 rows, K=2048, S=4096, 1% misses): 7.8-8.1 us per
// graph-replayed launch, median 7.8 over twelve processes (~13.5K cycles per CTA after the PDL
// wait in the last profile). Nsight Compute (session 7, before the per-mode compilation): 35.5K
// warp instructions per CTA, each warp issuing one every ~9 cycles, mostly waiting on the
// previous instruction's result (integer and shared-memory dependency chains), not on
// shared-memory bandwidth: the time follows the instructions per warp. benchmarks/NOTES.md has
// the phase profile (TORCH_KVCM2_PROFILE=1 builds print it) and what was tried.
__global__ __launch_bounds__(kResolveThreads, 1) void resolve_kernel(const ResolveParams p) {
  __shared__ Tally s_tally[kResolveWarps];                 // scan 1 warp totals
  __shared__ Tally s_classes[kResolveWarps];               // scan 2 warp totals
  __shared__ uint32_t s_round[2][kResolveWarps];           // victim search rounds >= 1
  __shared__ int32_t s_miss_base;
  __shared__ int32_t s_erased;  // place hid a unit's surviving slot (bad data): redo every column
  extern __shared__ __align__(16) unsigned char smem[];

  const int tid = threadIdx.x;
  KVCM2_PROF_BEGIN();
  const int r = blockIdx.x;
  const int S = p.S, K = p.K;
  const int bits = p.hash_bits;
  const int H = 1 << bits;
  const ResolveLayout<uint32_t>& L = p.L;
  int32_t* const key = reinterpret_cast<int32_t*>(smem + L.key);
  int32_t* const hslot = reinterpret_cast<int32_t*>(smem + L.hslot);  // resident slot, then final
  int32_t* const res = reinterpret_cast<int32_t*>(smem + L.res);
  int32_t* const infl = reinterpret_cast<int32_t*>(smem + L.infl);
  int32_t* const admit = reinterpret_cast<int32_t*>(smem + L.admit);
  uint16_t* const rec = reinterpret_cast<uint16_t*>(smem + L.rec);
  uint16_t* const vlist = reinterpret_cast<uint16_t*>(smem + L.vlist);
  uint8_t* const vk = smem + L.vk;  // victim kind per slot: 0 none, 1 empty, 2 evictable
  uint8_t* const cls = smem + L.cls;
  uint8_t* const pclass = smem + L.pclass;
  uint8_t* const ckind = smem + L.ckind;
  uint32_t* const first = reinterpret_cast<uint32_t*>(smem + L.first);  // UINT32_MAX: none
  // The direct unit table (rows whose live unit range fits the table region): word u - unit0 is
  // first column << 16 | lowest resident slot, 0xffff in either half for none (no column or
  // slot is 0xffff: the host checks K <= 65535, and shared memory bounds S far lower).
  uint32_t* const word = reinterpret_cast<uint32_t*>(smem + L.key);
  int32_t* const col_entry = reinterpret_cast<int32_t*>(smem + L.col_entry);
  int32_t* const miss_entry = reinterpret_cast<int32_t*>(smem + L.miss_entry);
  uint16_t* const newrec = reinterpret_cast<uint16_t*>(smem + L.newrec);

  // ---- preamble, before the PDL wait (pdl.cuh), so under PDL it overlaps the previous kernel of
  // the stream. The row's lease, history and capacity are read here, early: only `publish` writes
  // them (with torch ops, between steps), never a library kernel, so they almost always hold their
  // final values already; but before the wait nothing guarantees that, so they are read again
  // after it and compared (at the vote below). The first attempt loads the lease's rows and
  // derives the row rules from the early values, which takes the lease's global round trip and
  // the rules off the critical path; an attempt whose early values differ is abandoned before it
  // has written anything but shared memory, and redone with the values read after the wait.
  int32_t l = load_in_place(p.lease + r);
  int32_t h = load_in_place(p.history + r), c = load_in_place(p.capacity + r);
  if (p.force_stale) {  // tests: a stale lease, history or capacity, or an early hole, by row
    const int kind = r & 3;
    if (kind == 0 && l >= 0 && p.leases > 1) l = static_cast<int32_t>((l + 1) % p.leases);
    if (kind == 1) h += 1;
    if (kind == 2) l = -1;
    if (kind == 3) c += 7;
  }
  // Then the shared-memory init that reads no global memory (16 bytes per store; every array
  // starts 16-byte aligned).
  static_assert(kEmptyKey == -1, "one fill serves key, first and the direct table");
  fill_words(key, static_cast<int>(L.table_words), -1);
  static_assert(kUntouched == 0, "cls starts zeroed");
  fill_words(reinterpret_cast<int32_t*>(cls), S / 4, 0);
  for (int s = S / 4 * 4 + tid; s < S; s += kResolveThreads) cls[s] = 0;
  if (tid == 0) s_erased = 0;
  auto range_of = [&](int32_t hh, int32_t cc) {
    return row_range(hh, cc, p.tokens_per_unit, p.tokens_per_page, p.max_inflight_tokens,
                     p.window);
  };
  RowRange range = range_of(h, c);
  __syncthreads();  // the table is filled before any thread inserts into it (before the vote)
  KVCM2_PROF(1);
  pdl_enter();
  KVCM2_PROF(2);

  // The selection does not depend on the lease: start copying it (into col_entry, converted to
  // hash entries below) at once. cp.async keeps the loads in flight without holding registers.
  const int32_t* const sel_row = p.selected + static_cast<int64_t>(r) * K;
  copy_async(col_entry, sel_row, K);
  __pipeline_commit();
  // The values read after the wait, which decide; their round trip overlaps the rows' loads.
  const int32_t lv = load_in_place(p.lease + r);
  const int32_t hv = load_in_place(p.history + r), cv = load_in_place(p.capacity + r);
  int32_t* const out = p.index_table + static_cast<int64_t>(r) * K;
  int32_t* const located = p.inflight_slots + static_cast<int64_t>(r) * p.MI;
  auto hole = [&](int32_t lease) { return lease < 0 || lease >= p.leases; };
  const bool sel_aligned = (reinterpret_cast<uintptr_t>(sel_row) & 15) == 0;
  // Visits this thread's own selection copies (copy_async's assignment), col_entry[j] = f(j, v)
  // for each: they are visible to it once its copies have landed, before any barrier.
  auto for_own_columns = [&](auto&& f) {
    int done = 0;
    if (sel_aligned) {
#pragma unroll 1
      for (int i = tid; i < K / 4; i += kResolveThreads) {
        int4 v = reinterpret_cast<const int4*>(col_entry)[i];
        v.x = f(4 * i, v.x);
        v.y = f(4 * i + 1, v.y);
        v.z = f(4 * i + 2, v.z);
        v.w = f(4 * i + 3, v.w);
        reinterpret_cast<int4*>(col_entry)[i] = v;
      }
      done = K / 4 * 4;
    }
#pragma unroll 1
    for (int j = done + tid; j < K; j += kResolveThreads) col_entry[j] = f(j, col_entry[j]);
  };
  // The table filled again and the selection copied again (a direct insert changed both), once
  // every copy in flight has landed.
  auto restart_table = [&]() {
    __pipeline_wait_prior(0);
    fill_words(key, static_cast<int>(L.table_words), -1);
    copy_async(col_entry, sel_row, K);
    __pipeline_commit();
  };
  // Hole, suspended row, or a bad lease: touch no residency. Holes are not speculated on.
  auto leave_hole = [&]() {
    if (tid == 0) publish_if_last(p, reserve(p, 0), 0);
    __pipeline_wait_prior(0);
#pragma unroll 1
    for (int j = tid; j < K; j += kResolveThreads) out[j] = BAD;
#pragma unroll 1
    for (int i = tid; i < p.MI; i += kResolveThreads) located[i] = BAD;
  };
  // Takes the values read after the wait; false for a hole, which it has left. (opaque: in the
  // redo path below their uses would otherwise be hoisted above the attempt loop, which would
  // wait for the verifying loads before the first attempt's row loads are issued.)
  auto adopt_verified = [&]() {
    l = opaque(lv);
    h = opaque(hv);
    c = opaque(cv);
    if (hole(l)) {
      leave_hole();
      return false;
    }
    range = range_of(h, c);
    return true;
  };
  if (hole(l) && !adopt_verified()) return;
  KVCM2_PROF(3);
  int32_t* res_row;
  int32_t* rec_row;
  int32_t qv[kIlpGlobal];
  UnitRules rules;
  int64_t a, end;
  int nF;
  int32_t unit0;
  bool use_direct;
#pragma unroll 1
  for (;;) {  // at most two attempts: the early values, then (rarely) the verified ones
    res_row = p.resident + static_cast<int64_t>(l) * S;
    rec_row = p.recency + static_cast<int64_t>(l) * S;
    copy_async(res, res_row, S);
    __pipeline_commit();
    // Recency goes through registers (to uint16); its first round of loads is issued before the
    // row rules, so their work hides the loads' latency.
#pragma unroll
    for (int i = 0; i < kIlpGlobal; ++i) {
      const int q = tid + i * kResolveThreads;
      qv[i] = q < S ? rec_row[q] : 0;
    }

    rules = UnitRules(range);
    a = range.first_inflight;
    // In-flight units a .. a + nF - 1; nF <= MI always (CFG-3 bound), clamped only for safety.
    const int64_t n_inflight = range.end_inflight - a;
    nF = static_cast<int>(n_inflight < p.MI ? n_inflight : p.MI);
    KVCM2_PROF_PART(0);

    fill_words(infl, nF, kNoSlot);
    // The direct unit table covers [unit0, end): every selectable unit, and the non-selectable
    // gap between history and the in-flight range. A row takes it when the range fits the table
    // region and every selected ordinal >= 0 lies in it; else (long live ranges, bad ordinals)
    // the hash.
    unit0 = rules.live;
    end = rules.settled > range.end_inflight ? rules.settled : range.end_inflight;
    bool outside = end - unit0 > static_cast<int64_t>(L.table_words);
    KVCM2_PROF_PART(1);
    __pipeline_wait_prior(1);  // the selection has landed (the group before the rows' last)
    KVCM2_PROF_PART(2);
    // A row whose live range fits inserts its selection into the direct table right away (its
    // own copies, so no barrier first): col_entry becomes unit - unit0, -1 for padding; a selected
    // ordinal outside the range leaves the row to the hash (below).
    bool bad = false;
    if (!outside) {
      for_own_columns([&](int j, int32_t u) -> int32_t {
        if (u < 0) return -1;
        if (u < unit0 || u >= end) {
          bad = true;
          return u;
        }
        atomicMin(&word[u - unit0], static_cast<uint32_t>(j) << 16 | 0xffffu);
        return u - unit0;
      });
    }
    KVCM2_PROF_PART(3);
    // The early values may differ between threads (nothing ordered them), the verified ones do
    // not: a second vote, only when the first one is raised, tells a stale attempt from a row
    // that takes the hash (`outside` is uniform once the values are not stale).
    const bool stale = l != lv || h != hv || c != cv;
    use_direct = !__syncthreads_or(outside || bad || stale);
    if (use_direct) break;
    if (!__syncthreads_or(stale)) {
      if (!outside) {  // a selected ordinal outside the range: the hash, on a clean table
        restart_table();
        __pipeline_wait_prior(0);
        __syncthreads();
      }
      break;
    }
    restart_table();  // a stale attempt: redone with the verified values
    __syncthreads();
    if (!adopt_verified()) return;
  }
  KVCM2_PROF(4);
  // The rest is compiled once per table mode (`direct` is a constant in each), so neither mode's
  // loops carry the other's branches.
  auto rest = [&](auto mode) {
    constexpr bool direct = decltype(mode)::value;
    // Entry e of the table (complete after the slots phase): its first column (>= K: none), its
    // unit and its slot (kNoSlot: none).
    auto entry_of = [&](int32_t e, uint32_t& f, int32_t& u, int32_t& sl) {
      if (direct) {
        const uint32_t w = word[e];
        f = w >> 16;
        u = unit0 + e;
        sl = (w & 0xffffu) == 0xffffu ? kNoSlot : static_cast<int32_t>(w & 0xffffu);
      } else {
        f = first[e];
        u = key[e];
        sl = hslot[e];
      }
    };
    auto set_slot = [&](int32_t e, int32_t sl) {  // one thread per entry at a time
      if (direct)
        word[e] = (word[e] & 0xffff0000u) | (sl == kNoSlot ? 0xffffu : static_cast<uint32_t>(sl));
      else
        hslot[e] = sl;
    };
    auto find = [&](int32_t u) -> int32_t {  // the entry of a selected unit u, else -1
      if (!direct) return hash_find(key, u, bits);
      if (u < unit0 || u >= end) return -1;
      return (word[u - unit0] >> 16) != 0xffffu ? u - unit0 : -1;
    };

    // ---- the table of the selected ordinals, with each ordinal's first column, while the lease's
    // rows are still arriving; then recency, from registers. col_entry becomes each column's entry
    // (hash entry, or unit - unit0 in the direct table), -1 for padding.
    const int mask = H - 1;
    if (!direct) for_chunks<1>(tid, K, kResolveThreads, [&](const auto& j, const auto& ok) {
      constexpr int kN = sizeof(ok);
      int32_t u[kN], e[kN], prev[kN];
#pragma unroll
      for (int i = 0; i < kN; ++i) u[i] = ok[i] ? col_entry[j[i]] : -1;  // selected ordinals
#pragma unroll
      for (int i = 0; i < kN; ++i) {  // first insert attempts of the chunk, all in flight
        e[i] = hash_home(u[i], bits);
        prev[i] = (ok[i] && u[i] >= 0) ? atomicCAS(&key[e[i]], kEmptyKey, u[i]) : kEmptyKey;
      }
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        if (!ok[i]) continue;
        if (u[i] < 0) {
          col_entry[j[i]] = -1;  // padding
          continue;
        }
        while (prev[i] != kEmptyKey && prev[i] != u[i]) {  // collision: linear probing
          e[i] = (e[i] + 1) & mask;
          prev[i] = atomicCAS(&key[e[i]], kEmptyKey, u[i]);
        }
        // hslot is read only at inserted entries, and only after the next barrier: the insert
        // that took the entry initialises it (no fill of the whole table).
        if (prev[i] == kEmptyKey) hslot[e[i]] = kNoSlot;
        atomicMin(&first[e[i]], static_cast<uint32_t>(j[i]));
        col_entry[j[i]] = e[i];
      }
    });
    KVCM2_PROF_PART(4);
    // recency must be a permutation of [0, S) (bad device data); an out-of-range
    // entry is replaced so that nothing here can index out of bounds.
    auto stage_rec = [&](int q, int32_t v) {
      rec[q] = static_cast<uint16_t>(static_cast<uint32_t>(v) < static_cast<uint32_t>(S) ? v : q);
    };
#pragma unroll
    for (int i = 0; i < kIlpGlobal; ++i) {
      const int q = tid + i * kResolveThreads;
      if (q < S) stage_rec(q, qv[i]);
    }
    for_chunks<kIlpGlobal>(tid + kIlpGlobal * kResolveThreads, S, kResolveThreads, [&](const auto& q, const auto& ok) {
      constexpr int kN = sizeof(ok);
      int32_t v[kN];
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = ok[i] ? rec_row[q[i]] : 0;
#pragma unroll
      for (int i = 0; i < kN; ++i)
        if (ok[i]) stage_rec(q[i], v[i]);
    });
    KVCM2_PROF_PART(5);
    __pipeline_wait_prior(0);  // the resident row
    __syncthreads();
    KVCM2_PROF(5);

    // ---- slots: step 0 on each resident slot (a negative unit other than BAD is bad data:
    // dropped too) and its victim kind (empty, or evictable until scan 1 flags it hit or pinned);
    // which selected / in-flight units are resident, lowest slot first (slot_of). The lease's
    // resident row is written where it changes (here and in place), not copied back whole.
    uint32_t my_empty = 0;
    // Step 0 and the victim kind of slot q holding u; true if u stays (is selectable: never BAD
    // or another negative, as live >= 0).
    auto keep_slot = [&](int q, int32_t u) {
      const bool sel = rules.selectable(u);
      if (!sel & (u != BAD)) {  // dropped (rare)
        res[q] = BAD;
        res_row[q] = BAD;
      }
      vk[q] = sel ? 2 : 1;
      my_empty += !sel;
      return sel;
    };
    if (direct) {
      // One slot per iteration with one branch around the table lookup (the rest predicated):
      // a selectable unit lies in the table's range, and its first column (the word's high
      // half) is final since the last barrier.
#pragma unroll 1
      for (int q = tid; q < S; q += kResolveThreads) {
        const int32_t u = res[q];
        if (keep_slot(q, u)) {
          uint32_t* const wp = word + (u - unit0);
          const uint32_t w = *wp;
          if ((w >> 16) != 0xffffu) atomicMin(wp, (w & 0xffff0000u) | static_cast<uint32_t>(q));
          const uint32_t f = static_cast<uint32_t>(u - rules.first_inflight);
          if (f < static_cast<uint32_t>(nF)) atomicMin(&infl[f], q);
        }
      }
    } else for_chunks<1>(tid, S, kResolveThreads, [&](const auto& q, const auto& ok) {
      constexpr int kN = sizeof(ok);
      int32_t u[kN], e[kN], k0[kN];
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        u[i] = ok[i] ? res[q[i]] : BAD;
        if (!ok[i] || !keep_slot(q[i], u[i])) u[i] = BAD;
      }
#pragma unroll
      for (int i = 0; i < kN; ++i) {  // first probes of the chunk, all in flight
        e[i] = hash_home(u[i], bits);
        k0[i] = (ok[i] && u[i] >= 0) ? key[e[i]] : kEmptyKey;
      }
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        if (!ok[i] || u[i] < 0) continue;
        while (k0[i] != u[i] && k0[i] != kEmptyKey) {
          e[i] = (e[i] + 1) & mask;
          k0[i] = key[e[i]];
        }
        if (k0[i] == u[i]) atomicMin(&hslot[e[i]], q[i]);
        if (rules.inflight(u[i])) {
          const int f = u[i] - rules.first_inflight;
          if (f < nF) atomicMin(&infl[f], q[i]);
        }
      }
    });
    __syncthreads();
    KVCM2_PROF(6);

    // ---- scan 1: misses, admissions, victims; hits and invalid ordinals for the counters.
    // Part 1, columns: the kind of each column (first occurrence of a distinct ordinal): 0
    // none/padding/duplicate, 1 invalid, 2 hit (resident, or in flight: admitted, never fetched
    // for the selection), 3 miss. A resident hit's slot is no victim (step 2), nor is a pinned
    // in-flight slot (step 1): both clear the slot's victim kind. In-flight units not resident
    // are admissions. The column kinds are kept (ckind; each thread reads back only what it
    // wrote) so the ranking pass does not repeat the dependent loads.
    // Step 5 is done here for every column whose slot place cannot change: the index entry of a
    // resident unit (its slot is no victim) and BAD for a unit that can never get one (padding,
    // not selectable); a resident hit's slot takes its class (kHit) here too. The columns of
    // selectable units without a slot yet (misses and admissions, duplicates included) are
    // flagged kPending in ckind and finished after place.
    const int32_t lease_base = l * S;  // l * S + slot <= INT32_MAX (checked on the host)
    // Only selectable units ever hold a slot: the others were dropped in step 0.
    auto index_entry = [&](int32_t sl) { return sl != kNoSlot ? lease_base + sl : BAD; };
    const bool out_aligned = (reinterpret_cast<uintptr_t>(out) & 15) == 0;
    Tally mine{0, 0, my_empty << 16};
    uint32_t hits_invalid = 0, misses = 0;
    int lo, hi;
    blocked_range<4>(K, lo, hi);
#pragma unroll 1
    for (int b = lo; b < hi; b += 4) {
      int32_t e[4], o[4];
      uint8_t k[4];
      load_chunk(col_entry, b, hi, e, -1);
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // kinds by selects, not branches; one predicated store
        uint32_t f = 0xffffu;
        int32_t u = -1, sl = kNoSlot;
        if (e[i] >= 0) entry_of(e[i], f, u, sl);
        const bool first = (e[i] >= 0) & (f == static_cast<uint32_t>(b + i));
        const bool sel = rules.selectable(u), resident = sl != kNoSlot;
        const uint8_t kind = !first ? 0 : !sel ? 1 : (resident | rules.inflight(u)) ? 2 : 3;
        if (first & sel & resident) {
          vk[sl] = 0;
          cls[sl] = kHit;
        }
        hits_invalid += kind == 2 ? 1u : kind == 1 ? 1u << 16 : 0u;
        misses += kind == 3;
        o[i] = index_entry(sl);
        k[i] = kind | (sel & !resident ? kPending : 0);
      }
      store_chunk(ckind, b, hi, k);
      if (out_aligned & (b + 4 <= hi)) {
        *reinterpret_cast<int4*>(out + b) = make_int4(o[0], o[1], o[2], o[3]);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (b + i < hi) out[b + i] = o[i];
      }
    }
    static_assert(kMissLane == 0, "misses are the rank's low lane");
    mine.rank += misses;
    mine.hits_invalid += hits_invalid;
    blocked_range<1>(nF, lo, hi);
#pragma unroll 1
    for (int i = lo; i < hi; ++i) {
      const int32_t sl = infl[i];
      if (sl != kNoSlot) {
        vk[sl] = 0;
        // A pinned slot whose unit is selected is its entry's lowest slot: a hit, classed by the
        // columns above (kHit wins; nothing here races with them).
        const int32_t u = static_cast<int32_t>(a + i);
        if (!(rules.selectable(u) && find(u) >= 0)) cls[sl] = kPinned;
      } else {
        mine.rank += 1ull << kAdmitLane;
        mine.fetch_empty += range.needs_fetch_on_admit(a + i);
      }
    }
    __syncthreads();
    KVCM2_PROF(7);

    // Part 2, victims in taking order: empty slots, then evictable ones (neither hit nor pinned),
    // each in recency order. Only the first nA + nM are taken (a few per step in steady state,
    // and the least recently used slots are the untouched ones at the front of recency), so they
    // are searched for from the front, one position per thread per round: round 0's ranks ride
    // in this block scan; further rounds (rare: empty slots deep in recency, or many victims)
    // rank by warp ballots. Empty positions are searched for only when some slot is empty (with
    // bad data recency may name a slot twice, so their number is only known once counted), until
    // they are enough or recency is exhausted; then evictable ones, after them.
    uint16_t sl0 = 0;
    uint8_t k0 = 0;
    if (tid < S) {
      sl0 = rec[tid];
      k0 = vk[sl0];
    }
    mine.rank += k0 == 1 ? 1ull << kEmptyLane : k0 == 2 ? 1ull << kEvictLane : 0ull;
    Tally total;
    const unsigned long long before = block_scan(mine, total, s_tally);
    const int nM = static_cast<int>(lane16(total.rank, kMissLane));
    const int nA = static_cast<int>(lane16(total.rank, kAdmitLane));
    const uint32_t need = static_cast<uint32_t>(nA + nM);
    int rounds = 0;  // rounds searched after round 0 (alternates the warp-count buffers)
    // Rounds >= 1 of a search for positions of `kind`: vlist[offset + rank] for the ranks below
    // `want`; `found` counts them (round 0's included). The condition is uniform over the CTA.
    auto search = [&](uint8_t kind, uint32_t& found, uint32_t want, uint32_t offset) {
      const int lane = tid & 31, warp = tid >> 5;
#pragma unroll 1
      for (int q = kResolveThreads + tid; found < want && q - tid < S; q += kResolveThreads) {
        const uint16_t sl = q < S ? rec[q] : 0;
        const bool is = q < S && vk[sl] == kind;
        const unsigned ballot = __ballot_sync(kAll, is);
        uint32_t* const counts = s_round[++rounds & 1];
        if (lane == 0) counts[warp] = __popc(ballot);
        __syncthreads();
        uint32_t lower = 0, all = 0;  // this round's finds in the warps below this one, in all
#pragma unroll
        for (int w = 0; w < kResolveWarps; ++w) {
          const uint32_t c = counts[w];
          lower += w < warp ? c : 0u;
          all += c;
        }
        const uint32_t rank = found + lower + __popc(ballot & ((1u << lane) - 1u));
        if (is && rank < want) vlist[offset + rank] = sl;
        found += all;
      }
    };
    uint32_t f1 = 0;  // empty positions found: all of them unless need of them were found
    if (total.fetch_empty >> 16) {
      f1 = lane16(total.rank, kEmptyLane);
      const uint32_t rank0 = lane16(before, kEmptyLane);
      if (k0 == 1 && rank0 < need) vlist[rank0] = sl0;
      search(1, f1, need, 0);
    }
    uint32_t f2 = 0;  // evictable positions found
    if (f1 < need) {
      f2 = lane16(total.rank, kEvictLane);
      const uint32_t rank0 = lane16(before, kEvictLane);
      if (k0 == 2 && rank0 < need - f1) vlist[f1 + rank0] = sl0;
      search(2, f2, need - f1, f1);
    }
    const int placed = static_cast<int>(min(need, f1 + f2));
    const int pA = min(nA, placed);  // placed admissions
    const int pM = placed - pA;      // placed misses
    // Admissions that need a fetch (partly written head units) are a prefix of the ascending
    // admissions, so the placed ones are the first fA.
    const int fA = min(static_cast<int>(total.fetch_empty & 0xffffu), pA);
    {
      uint32_t m = lane16(before, kMissLane);
      blocked_range<4>(K, lo, hi);
#pragma unroll 1
      for (int b = lo; b < hi; b += 4) {
        int32_t e[4];
        uint8_t k[4];
        load_chunk(col_entry, b, hi, e, -1);
        load_chunk(ckind, b, hi, k, uint8_t{0});
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if ((k[i] & 3) == 3) miss_entry[m++] = e[i];
      }
      uint32_t ad = lane16(before, kAdmitLane);
      blocked_range<1>(nF, lo, hi);
#pragma unroll 1
      for (int i = lo; i < hi; ++i)
        if (infl[i] == kNoSlot) admit[ad++] = i;
    }
    const int n_fetch = fA + pM;
    unsigned long long reserved = 0;
    if (tid == 0) {
      reserved = reserve(p, n_fetch);  // consumed at the end, to hide the atomic's latency
      const unsigned long long hits = total.hits_invalid & 0xffffu, misses = pM;
      const unsigned long long invalid = (total.hits_invalid >> 16) +
                                         static_cast<unsigned>(nA - pA) +
                                         static_cast<unsigned>(nM - pM);
      if (hits) atomicAdd(p.counters + kHits, hits);
      if (misses) atomicAdd(p.counters + kMisses, misses);
      if (invalid) atomicAdd(p.counters + kInvalid, invalid);
    }
    __syncthreads();
    KVCM2_PROF(8);

    // ---- place: admissions take victims first, then misses in first-occurrence order.
#pragma unroll 1
    for (int k = tid; k < placed; k += kResolveThreads) {
      const int sl = vlist[k];
      const int32_t old = res[sl];
      // The CPU erases slot_of[old] when a slot is reused. A reused slot's unit can only be
      // selected if it was resident twice (bad data) and this is not its lowest slot: the erase
      // then hides the unit's surviving slot from the index table. Reproduce that: the surviving
      // slot loses the hit class the columns phase gave it, and every column's index entry is
      // redone below.
      if (old >= 0) {
        const int32_t e_old = find(old);
        if (e_old >= 0) {
          uint32_t f_old;
          int32_t u_old, sl_old;
          entry_of(e_old, f_old, u_old, sl_old);
          if (sl_old != kNoSlot)  // pinned if the unit has an in-flight record
            cls[sl_old] = static_cast<uint32_t>(old - rules.first_inflight) <
                                  static_cast<uint32_t>(nF) ? kPinned : kUntouched;
          set_slot(e_old, kNoSlot);
          s_erased = 1;
        }
      }
      int32_t u, e;
      if (k < nA) {
        u = static_cast<int32_t>(a + admit[k]);
        e = u >= 0 ? find(u) : -1;  // a selected in-flight unit lands here: a hit
        cls[sl] = e >= 0 ? kHit : kPinned;
        infl[admit[k]] = sl;  // its in-flight slot record
      } else {
        e = miss_entry[k - nA];
        u = direct ? unit0 + e : key[e];
        cls[sl] = kMissed;
      }
      if (e >= 0) set_slot(e, sl);
      res[sl] = u;
      res_row[sl] = u;
    }
    __syncthreads();
    KVCM2_PROF(9);

    // In-flight slot records (final since place): the lowest slot that held the unit (pinned, so
    // it still does), or the admission's slot; BAD for an admission that found no victim. Stored
    // here, so their stores drain under the index and scan-2 phases instead of queueing at the
    // end behind the recency row.
#pragma unroll 1
    for (int i = tid; i < p.MI; i += kResolveThreads)
      located[i] = (i < nF && infl[i] != kNoSlot) ? infl[i] : BAD;

    // ---- index table (step 5), the columns the columns phase left pending (a placed miss or
    // admission, or none found), or every column after an erase. No barrier after it: scan 2
    // reads only what place wrote, and its first writes into the table region (newrec) follow
    // its block scan's barrier, which every thread reaches after its lookups here.
    const bool redo_all = s_erased != 0;
    blocked_range<4>(K, lo, hi);
#pragma unroll 1
    for (int b = lo; b < hi; b += 4) {
      uint8_t k[4];
      load_chunk(ckind, b, hi, k, uint8_t{0});
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (b + i >= hi || !(redo_all || (k[i] & kPending))) continue;
        const int32_t e = col_entry[b + i];
        uint32_t f;
        int32_t u, sl = kNoSlot;
        if (e >= 0) entry_of(e, f, u, sl);
        out[b + i] = index_entry(sl);
      }
    }
    KVCM2_PROF(10);

    // ---- scan 2: recency = untouched, misses, pinned, hits, each keeping its previous order.
    // Pass 1 counts each thread's positions per class in 8-bit lanes of a 32-bit word (a thread
    // holds at most 128 positions: S <= 65535, checked on the host), widened to 16-bit lanes of a
    // 64-bit word for the block scan (totals <= S: no carries). A thread whose share is one whole
    // chunk (when S <= 8 x threads: every thread but the last one holding positions) keeps its
    // slots and classes in registers for the ranking pass; other shares go through pclass.
    {
      int lo, hi;
      blocked_range<8>(S, lo, hi);
      const bool one_chunk = hi - lo == 8;
      uint16_t sl[8];
      uint8_t c[8];
      uint32_t mine8 = 0;
      if (one_chunk) {
        load_chunk(rec, lo, hi, sl, uint16_t{0});
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          c[i] = cls[sl[i]];
          mine8 += 1u << (8 * c[i]);
        }
      } else {
        mine8 = gather_by_recency<uint32_t>(rec, cls, pclass, lo, hi,
                                            [](int k) { return 1u << (8 * k); });
      }
      const unsigned long long mine_c =
          (mine8 & 0xffu) | (static_cast<unsigned long long>((mine8 >> 8) & 0xffu) << 16) |
          (static_cast<unsigned long long>((mine8 >> 16) & 0xffu) << 32) |
          (static_cast<unsigned long long>(mine8 >> 24) << 48);
      Tally total_c;
      const unsigned long long before_c = block_scan(Tally{mine_c, 0, 0}, total_c, s_classes);
      // Lane c of `next` = start of class c (the counts of the classes below it) + this thread's
      // rank within the class.
      const unsigned long long starts =
          (total_c.rank << 16) + (total_c.rank << 32) + (total_c.rank << 48);
      unsigned long long next = before_c + starts;
      auto place_chunk = [&](int n) {  // the first n of sl / c, in order
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if (i >= n) break;
          const int shift = 16 * c[i];
          newrec[(next >> shift) & 0xffffu] = sl[i];
          next += 1ull << shift;
        }
      };
      if (one_chunk) {
        place_chunk(8);
      } else {
#pragma unroll 1
        for (int b = lo; b < hi; b += 8) {
          load_chunk(rec, b, hi, sl, uint16_t{0});
          load_chunk(pclass, b, hi, c, uint8_t{0});
          place_chunk(hi - b);
        }
      }
    }
    if (tid == 0) {  // the atomic's latency overlapped place/index/scan 2
      s_miss_base = static_cast<int32_t>(static_cast<uint32_t>(reserved));
      publish_if_last(p, reserved, n_fetch);
    }
    __syncthreads();
    KVCM2_PROF(11);

    // ---- write back: this row's miss-list entries first (a few scattered stores),
    const int32_t base = s_miss_base;
#pragma unroll 1
    for (int k = tid; k < placed; k += kResolveThreads) {
      int idx;
      if (k < nA) {
        if (k >= fA) continue;  // admitted unit wholly in flight: nothing to fetch
        idx = k;
      } else {
        idx = fA + (k - nA);
      }
      const int sl = vlist[k];
      int32_t* const entry = p.miss_list + static_cast<int64_t>(base + idx) * kMissFields;
      entry[kMissLease] = l;
      entry[kMissSlot] = sl;
      entry[kMissRow] = r;
      entry[kMissUnit] = res[sl];
    }
    KVCM2_PROF_PART(6);
    // Then the lease's recency row (16-byte stores when aligned; resident was written where it
    // changed), last: its 16 KB of stores queue behind nothing the CTA still has to issue.
    if ((reinterpret_cast<uintptr_t>(rec_row) & 15) == 0) {
#pragma unroll 1
      for (int b = 8 * tid; b < S; b += 8 * kResolveThreads) {
        uint16_t v[8];
        load_chunk(newrec, b, S, v, uint16_t{0});
        if (b + 8 <= S) {
          reinterpret_cast<int4*>(rec_row + b)[0] = make_int4(v[0], v[1], v[2], v[3]);
          reinterpret_cast<int4*>(rec_row + b)[1] = make_int4(v[4], v[5], v[6], v[7]);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j)
            if (b + j < S) rec_row[b + j] = v[j];
        }
      }
    } else {
#pragma unroll 1
      for (int q = tid; q < S; q += kResolveThreads) rec_row[q] = newrec[q];
    }
    KVCM2_PROF_PART(7);
    KVCM2_PROF_END();
  };
  if (use_direct)
    rest(std::true_type{});
  else
    rest(std::false_type{});
}

// ------------------------------------------------------------------------------------------------
// fetch

constexpr int kFetchThreads = 256;
// fetch_tma_kernel: used for pieces of >= kTmaMinPiece bytes, stages of up to kTmaStage bytes
// (measured on an H200, benchmarks/NOTES.md), one CTA per SM with up to kTmaSmemBudget bytes of
// stages and kTmaMaxThreads threads.
constexpr int64_t kTmaMinPiece = 32768;
constexpr int kTmaStage = 8192;
constexpr int kTmaSmemBudget = 200 * 1024;
constexpr int kTmaMaxThreads = 256;
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

struct FetchParams {
  FetchBuffer buf[kMaxFetchBuffers];
  int32_t nb;
  int32_t per_miss;  // parts per miss over all buffers of this launch
  const int32_t* miss_list;
  const int32_t* miss_count;
  int64_t list_rows;
  bool list_aligned;  // miss_list rows are 16-byte aligned: one int4 load per entry
  int64_t slots;
  int32_t stage_bytes;  // fetch_tma_kernel: bytes per shared-memory stage
};

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
  const int32_t lease = e.x, slot = e.y, row = e.z, unit = e.w;
  const int64_t entry = static_cast<int64_t>(lease) * p.slots + slot;
  if (lease < 0 || slot < 0 || slot >= p.slots || entry >= B.num_entries || row < 0 ||
      row >= B.table_rows || unit < 0 || unit / B.E >= B.table_pages)
    return -1;
  const int64_t h = B.table[row * B.table_pages + unit / B.E];
  return h < B.host_slots ? h : -1;
}

// Part w of entry e's piece in chunk w / vpp: where it is read from (host page host_slot) and
// written to (its cell); `inner` is its offset within the page.
__device__ __forceinline__ int64_t part_offset(const FetchBuffer& B, int w) {
  const int k = w / B.vpp;  // chunk
  return k * B.chunk_bytes + static_cast<int64_t>(w - k * B.vpp) * B.vec;
}
__device__ __forceinline__ const uint8_t* part_src(const FetchBuffer& B, const int4& e,
                                                   int64_t host_slot, int64_t inner) {
  return B.host + host_slot * B.host_stride + (e.w % B.E) * B.piece + inner;
}
__device__ __forceinline__ uint8_t* part_dst(const FetchParams& p, const FetchBuffer& B,
                                             const int4& e, int64_t inner) {
  const int64_t entry = static_cast<int64_t>(e.x) * p.slots + e.y;
  return B.cells + (entry / B.E) * B.page_bytes + (entry % B.E) * B.piece + inner;
}

// One vector per work item. A thread handles ILP items per round in stages (miss entries, then
// page-table entries, then host loads, then stores), so the dependent loads of its items overlap
// instead of forming ILP chains.
template <int ILP>
__global__ __launch_bounds__(kFetchThreads) void fetch_kernel(const __grid_constant__ FetchParams p) {
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

// ------------------------------------------------------------------------------------------------
// host wrappers

void init_device_info(DeviceInfo& info, int device) {
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.smem_optin,
                                        cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device));
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, resolve_kernel));
  info.resolve_static_smem = static_cast<int>(attr.sharedSizeBytes);
  info.resolve_force_stale = env_int("KVCM2_RESOLVE_FORCE_STALE", 0) != 0;
  const int ilp = env_int("KVCM2_FETCH_ILP", 2);
  info.fetch_ilp = (ilp == 1 || ilp == 4 || ilp == 8) ? ilp : 2;
  const void* kernel = info.fetch_ilp == 1   ? reinterpret_cast<const void*>(fetch_kernel<1>)
                       : info.fetch_ilp == 4 ? reinterpret_cast<const void*>(fetch_kernel<4>)
                       : info.fetch_ilp == 8 ? reinterpret_cast<const void*>(fetch_kernel<8>)
                                             : reinterpret_cast<const void*>(fetch_kernel<2>);
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kFetchThreads, 0));
  blocks = std::max(1, blocks);
  info.fetch_blocks_per_sm =
      std::min(std::max(1, env_int("KVCM2_FETCH_BLOCKS_PER_SM", blocks)), blocks);
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  const int tma = env_int("KVCM2_FETCH_TMA", -1);
  if (major >= 9 && tma != 0) {
    info.fetch_tma_min_piece = tma == 1 ? 0 : kTmaMinPiece;
    info.fetch_tma_stage =
        std::min(std::max(env_int("KVCM2_FETCH_TMA_STAGE", kTmaStage), 16), 32768) / 16 * 16;
    C10_CUDA_CHECK(cudaFuncSetAttribute(fetch_tma_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        std::min(info.smem_optin, kTmaSmemBudget)));
  }
}

int ceil_log2(int64_t n) {
  int bits = 0;
  while ((int64_t{1} << bits) < n) ++bits;
  return bits;
}

void resolve_cuda(const at::Tensor& resident, const at::Tensor& recency,
                  const at::Tensor& index_table, const at::Tensor& miss_list,
                  const at::Tensor& miss_count, const at::Tensor& counters,
                  const at::Tensor& inflight_slots, const at::Tensor& selected,
                  const at::Tensor& history, const at::Tensor& capacity, const at::Tensor& lease,
                  int64_t tokens_per_unit, int64_t tokens_per_page, int64_t max_inflight_tokens,
                  int64_t window) {
  check_resolve(resident, recency, index_table, miss_list, miss_count, counters, inflight_slots,
                selected, history, capacity, lease, tokens_per_unit, tokens_per_page,
                max_inflight_tokens, window);
  const c10::cuda::CUDAGuard guard(resident.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t rows = selected.size(0), K = selected.size(1), S = resident.size(1);
  int32_t* const count = miss_count.data_ptr<int32_t>();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(count) % 8 == 0,
              "resolve: miss_count must be 8-byte aligned (its reservation word is 64-bit)");
  if (rows == 0) {  // no CTA publishes a count
    C10_CUDA_CHECK(cudaMemsetAsync(count, 0, sizeof(int32_t), stream));
    return;
  }
  const int64_t MI = max_inflight_units(max_inflight_tokens, tokens_per_unit);
  TORCH_CHECK(rows * (K + MI) <= INT32_MAX, "resolve: too many miss-list entries for int32");
  // Scan counts are 16-bit lanes (Tally); shared memory bounds both far lower anyway.
  TORCH_CHECK(K <= 65535, "resolve: at most 65535 selected columns per row, got ", K);
  TORCH_CHECK(MI <= 65535, "resolve: max_inflight_tokens / tokens_per_unit too large");
  // Hash of >= 4K entries (load <= 1/4: measured 3.4 us faster than 1/2 at K=2048, S=4096) when
  // shared memory allows, else >= 2K (load <= 1/2).
  int bits = std::max(1, ceil_log2(4 * K));
  if (ResolveLayout<int64_t>(S, K, int64_t{1} << bits, MI).bytes > 200 * 1024)
    bits = std::max(1, ceil_log2(2 * K));
  const ResolveLayout<int64_t> layout(S, K, int64_t{1} << bits, MI);
  const int smem = static_cast<int>(layout.bytes);
  bool force_stale = false;
  {
    const std::lock_guard<std::mutex> lock(g_info_mutex);
    DeviceInfo& info = device_info(resident.get_device());
    force_stale = info.resolve_force_stale;
    TORCH_CHECK(layout.bytes + info.resolve_static_smem <= info.smem_optin, "resolve: S=", S,
                ", K=", K, ", max in-flight units=", MI, " need ",
                layout.bytes + info.resolve_static_smem,
                " bytes of shared memory per row; the device allows ", info.smem_optin);
    if (smem > 48 * 1024 && smem > info.resolve_smem_set) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(resolve_kernel,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      info.resolve_smem_set = smem;
    }
  }
  ResolveParams p{};
  p.resident = resident.data_ptr<int32_t>();
  p.recency = recency.data_ptr<int32_t>();
  p.index_table = index_table.data_ptr<int32_t>();
  p.miss_list = miss_list.data_ptr<int32_t>();
  p.miss_count = count;
  p.reservation = reinterpret_cast<unsigned long long*>(count + kMissReservation);
  p.counters = reinterpret_cast<unsigned long long*>(counters.data_ptr<int64_t>());
  p.inflight_slots = inflight_slots.data_ptr<int32_t>();
  p.selected = selected.data_ptr<int32_t>();
  p.history = history.data_ptr<int32_t>();
  p.capacity = capacity.data_ptr<int32_t>();
  p.lease = lease.data_ptr<int32_t>();
  p.leases = resident.size(0);
  p.tokens_per_unit = tokens_per_unit;
  p.tokens_per_page = tokens_per_page;
  p.max_inflight_tokens = max_inflight_tokens;
  p.window = window;
  p.rows = static_cast<int32_t>(rows);
  p.S = static_cast<int32_t>(S);
  p.K = static_cast<int32_t>(K);
  p.MI = static_cast<int32_t>(MI);
  p.hash_bits = bits;
  p.force_stale = force_stale ? 1 : 0;
  p.L = ResolveLayout<uint32_t>(static_cast<uint32_t>(S), static_cast<uint32_t>(K),
                                uint32_t{1} << bits, static_cast<uint32_t>(MI));
  launch_kernel(resolve_kernel, dim3(static_cast<unsigned>(rows)), dim3(kResolveThreads),
                static_cast<size_t>(smem), stream, p);
}

// Widest vector that divides every offset the kernel forms: piece, chunk and page strides and
// both base addresses.
int32_t vector_bytes(int64_t piece, int64_t chunk_bytes, int64_t page_bytes, int64_t host_stride,
                     const void* cells, const void* host) {
  const uint64_t bits = static_cast<uint64_t>(piece) | static_cast<uint64_t>(chunk_bytes) |
                        static_cast<uint64_t>(page_bytes) | static_cast<uint64_t>(host_stride) |
                        reinterpret_cast<uintptr_t>(cells) | reinterpret_cast<uintptr_t>(host);
  int32_t vec = 16;
  while (vec > 1 && (bits & (vec - 1)) != 0) vec >>= 1;
  return vec;
}

void fetch_cuda(const at::TensorList& cells, const at::TensorList& host_pools,
                at::IntArrayRef positions, const at::TensorList& page_tables,
                const at::Tensor& miss_list, const at::Tensor& miss_count, int64_t slots,
                int64_t tokens_per_unit) {
  check_fetch(cells, host_pools, positions, page_tables, miss_list, miss_count, slots,
              tokens_per_unit);
  const c10::cuda::CUDAGuard guard(miss_list.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (miss_list.size(0) == 0) return;
  unsigned grid, sms;
  int ilp, tma_stage, smem_budget;
  int64_t tma_min_piece;
  {
    const std::lock_guard<std::mutex> lock(g_info_mutex);
    const DeviceInfo& info = device_info(miss_list.get_device());
    grid = static_cast<unsigned>(info.sms * info.fetch_blocks_per_sm);
    sms = static_cast<unsigned>(info.sms);
    ilp = info.fetch_ilp;
    tma_stage = info.fetch_tma_stage;
    tma_min_piece = info.fetch_tma_min_piece;
    smem_budget = std::min(info.smem_optin, kTmaSmemBudget);
  }
  FetchParams p{};
  p.miss_list = miss_list.data_ptr<int32_t>();
  p.miss_count = miss_count.data_ptr<int32_t>();
  p.list_rows = miss_list.size(0);
  p.list_aligned = reinterpret_cast<uintptr_t>(p.miss_list) % 16 == 0;
  p.slots = slots;
  // Bulk copies when every buffer of the launch is 16-byte aligned throughout and its pieces are
  // large enough (its parts become stages: the widest piece, at most tma_stage bytes; one CTA
  // per SM with as many threads as two stages each fit).
  auto launch_tma = [&]() -> bool {
    int64_t widest = 0;
    for (int b = 0; b < p.nb; ++b) {
      if (p.buf[b].vec != 16 || p.buf[b].piece < tma_min_piece) return false;
      widest = std::max(widest, p.buf[b].piece);
    }
    const int64_t SB = std::min<int64_t>(tma_stage, widest);
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
    launch_kernel(fetch_tma_kernel, dim3(sms), dim3(threads),
                  static_cast<size_t>(threads) * (2 * SB + 16), stream, p);
    return true;
  };
  auto launch = [&]() {
    if (p.nb == 0) return;
    if (!launch_tma()) {
      void (*kernel)(FetchParams) = ilp == 1   ? fetch_kernel<1>
                                    : ilp == 4 ? fetch_kernel<4>
                                    : ilp == 8 ? fetch_kernel<8>
                                               : fetch_kernel<2>;
      launch_kernel(kernel, dim3(grid), dim3(kFetchThreads), 0, stream, p);
    }
    p.nb = 0;
    p.per_miss = 0;
  };
  for (size_t b = 0; b < cells.size(); ++b) {
    const at::Tensor& cell = cells[b];
    const HostPages host = host_pages_of(host_pools[b], positions[b]);
    const int64_t chunks = cell.size(1), P = cell.size(2);
    const int64_t chunk_bytes = P * cell.size(3);
    const int64_t page_bytes = chunks * chunk_bytes;
    if (page_bytes == 0) continue;  // zero-size buffer (CFG-6)
    const int64_t piece = tokens_per_unit * cell.size(3);
    const int64_t E = P / tokens_per_unit;
    TORCH_CHECK(E <= INT32_MAX, "fetch: too many units per page");
    FetchBuffer& B = p.buf[p.nb];
    B.cells = cell.data_ptr<uint8_t>();
    B.host = host.data;
    B.table = page_tables[b].data_ptr<int32_t>();
    B.num_entries = cell.size(0) * E;
    B.table_rows = page_tables[b].size(0);
    B.table_pages = page_tables[b].size(1);
    B.host_slots = host.slots;
    B.host_stride = host.slot_stride;
    B.page_bytes = page_bytes;
    B.chunk_bytes = chunk_bytes;
    B.piece = piece;
    B.E = static_cast<int32_t>(E);
    B.vec = vector_bytes(piece, chunk_bytes, page_bytes, B.host_stride, B.cells, B.host);
    const int64_t vpp = piece / B.vec;
    const int64_t per_miss = p.per_miss + chunks * vpp;
    TORCH_CHECK(per_miss <= INT32_MAX, "fetch: too many bytes per unit");
    B.vpp = static_cast<int32_t>(vpp);
    B.begin = p.per_miss;
    p.per_miss = static_cast<int32_t>(per_miss);
    if (++p.nb == kMaxFetchBuffers) launch();
  }
  launch();
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CUDA, m) {
  m.impl("resolve", &resolve_cuda);
  m.impl("fetch", &fetch_cuda);
}

}  // namespace torch_kvcm2
