// The resolve kernel's building blocks (cuda/resolve.cu is their one user): its parameters and
// shared-memory layout, the CTA-wide scans and chunked shared-memory accesses, the miss-list
// reservation, the 32-bit unit rules, the hash, the load helpers, and the development build's
// phase timer.
#pragma once

#include <cuda_pipeline.h>

#include <cstdint>

#include "../rules.h"

namespace torch_kvcm2 {

#if defined(KVCM2_RESOLVE_THREADS) && !defined(KVCM2_DEV)
#error "KVCM2_RESOLVE_THREADS is a development choice: build with TORCH_KVCM2_DEV=1"
#endif
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
// Wide rows (global_table: the shared layout does not fit, e.g. multi-token selections of
// T·K > 4096 columns) keep the table region in a global scratch of table_bytes per CTA
// (key, hslot, first at those offsets in it) and newrec in shared memory of its own: the
// per-slot and per-column arrays stay in shared memory, only the table moves.
template <typename I>
struct ResolveLayout {
  I key, hslot, first;  // int32 arrays of H entries (the hash), offsets in the table region
  I table_words;        // words in the table region: the longest unit range a direct table takes
  I table_bytes;        // bytes of the table region (global_table: the scratch per CTA)
  I res, infl, admit;   // int32 arrays
  I rec, vlist;         // uint16 arrays
  I vk, cls, pclass, ckind;  // uint8 arrays
  I col_entry, miss_entry;  // int32 arrays
  I newrec;
  I bytes;  // shared memory

  ResolveLayout() = default;
  KVCM2_HD ResolveLayout(I S, I K, I H, I MI, bool global_table = false) {
    I at = 0;
    auto take = [&at](I n) {
      const I off = at;
      at += (n + 15) / 16 * 16;  // keep every array 16-byte aligned
      return off;
    };
    key = take(4 * H);
    hslot = take(4 * H);
    first = take(4 * H);
    if (global_table) {
      table_bytes = at;
      table_words = at / 4;
      at = 0;
      newrec = take(2 * S);
    } else {
      if (at < 2 * S) at = (2 * S + 15) / 16 * 16;
      table_bytes = at;
      table_words = at / 4;
      newrec = 0;
    }
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
  int64_t leases, tokens_per_unit, tokens_per_page, max_inflight_tokens, window, sinks;
  int32_t rows, S, K, MI;
  int32_t hash_bits;  // hash table of 1 << hash_bits entries, >= 2K: load factor <= 1/2
  // The table regions of wide rows, L.table_bytes per CTA (ResolveLayout's global_table), read
  // only by resolve_kernel<true>; nullptr for resolve_kernel<false>, whose table region is in
  // shared memory.
  unsigned char* table_scratch;
  // OP-WRITE's outputs when resolve writes them too ([rows, write_width], [rows]); nullptr: not.
  int32_t* write_table;
  int32_t* write_start;
  int32_t write_width;
#ifdef KVCM2_DEV
  int32_t force_stale;  // Tuning::resolve_force_stale (launch.cuh)
#endif
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
  int32_t sink;     // sink_units: units below it are on the kept sink pages (TIER-3)
  int32_t settled;  // floor(h / U): units wholly history
  int32_t first_inflight;
  uint32_t n_inflight;

  UnitRules() = default;
  __device__ explicit UnitRules(const RowRange& r)
      : live(static_cast<int32_t>(r.first_live_unit > 0 ? r.first_live_unit : 0)),
        sink(static_cast<int32_t>(r.sink_units)),
        settled(static_cast<int32_t>(floor_div(r.history, r.tokens_per_unit))),  // h >= 0
        first_inflight(static_cast<int32_t>(r.first_inflight)),
        n_inflight(static_cast<uint32_t>(r.end_inflight - r.first_inflight)) {}

  // Unsigned difference: a negative u wraps to >= 2^31 - first_inflight > n_inflight.
  __device__ __forceinline__ bool inflight(int32_t u) const {
    return static_cast<uint32_t>(u) - static_cast<uint32_t>(first_inflight) < n_inflight;
  }
  // Bitwise, not short-circuit: four compares and no branches in the loops over S and K. A
  // negative u wraps to >= 2^31 > sink (unsigned), and is below live >= 0.
  __device__ __forceinline__ bool selectable(int32_t u) const {
    return ((static_cast<uint32_t>(u) < static_cast<uint32_t>(sink)) | (u >= live)) &
           ((u < settled) | inflight(u));
  }
  // The lowest selectable unit's bound: 0 with sink units, else the window's first live unit.
  __device__ __forceinline__ int32_t first_selectable() const { return sink > 0 ? 0 : live; }
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

// ---- the state the phase functions of resolve.cu share

// The CTA's shared-memory arrays, at the host-computed offsets into dynamic shared memory.
struct Arrays {
  int32_t* key;
  int32_t* hslot;  // resident slot, then final
  int32_t* res;
  int32_t* infl;
  int32_t* admit;
  uint16_t* rec;
  uint16_t* vlist;
  uint8_t* vk;  // victim kind per slot: 0 none, 1 empty, 2 evictable
  uint8_t* cls;
  uint8_t* pclass;
  uint8_t* ckind;
  uint32_t* first;  // UINT32_MAX: none
  // The direct unit table (rows whose live unit range fits the table region): word u - unit0 is
  // first column << 16 | lowest resident slot, 0xffff in either half for none (no column or
  // slot is 0xffff: the host checks K <= 65535, and shared memory bounds S far lower).
  uint32_t* word;
  int32_t* col_entry;
  int32_t* miss_entry;
  uint16_t* newrec;

  // `table`: where the table region is (smem, or this CTA's part of the global scratch). Each
  // kernel passes one memory space only (resolve_kernel<kGlobalTable>), so the compiler knows
  // the space of every pointer here and addresses it with that space's instructions.
  __device__ __forceinline__ Arrays(unsigned char* smem, unsigned char* table,
                                    const ResolveLayout<uint32_t>& L)
      : key(reinterpret_cast<int32_t*>(table + L.key)),
        hslot(reinterpret_cast<int32_t*>(table + L.hslot)),
        res(reinterpret_cast<int32_t*>(smem + L.res)),
        infl(reinterpret_cast<int32_t*>(smem + L.infl)),
        admit(reinterpret_cast<int32_t*>(smem + L.admit)),
        rec(reinterpret_cast<uint16_t*>(smem + L.rec)),
        vlist(reinterpret_cast<uint16_t*>(smem + L.vlist)),
        vk(smem + L.vk),
        cls(smem + L.cls),
        pclass(smem + L.pclass),
        ckind(smem + L.ckind),
        first(reinterpret_cast<uint32_t*>(table + L.first)),
        word(reinterpret_cast<uint32_t*>(table + L.key)),
        col_entry(reinterpret_cast<int32_t*>(smem + L.col_entry)),
        miss_entry(reinterpret_cast<int32_t*>(smem + L.miss_entry)),
        newrec(reinterpret_cast<uint16_t*>(smem + L.newrec)) {}
};

// The row this CTA resolves: its lease, history and capacity (the early values, then the ones
// that decide), the rules derived from them and where its rows are.
struct Row {
  int r;
  int S, K, bits;      // slots per lease, selected columns, hash bits (p.S, p.K, p.hash_bits read
                       // once: a kernel parameter is reloaded after every barrier)
  int32_t l, h, c;     // lease, history, capacity of the current attempt
  int32_t lv, hv, cv;  // the same, read after the PDL wait: they decide
  RowRange range;
  UnitRules rules;
  int64_t a;      // first in-flight unit
  int nF;         // in-flight units a .. a + nF - 1
  int32_t unit0;  // the direct table covers units [unit0, end)
  int64_t end;
  const int32_t* sel_row;
  int32_t* out;      // the row's index-table row
  int32_t* located;  // its in-flight slot records
  int32_t* res_row;  // the lease's resident row
  int32_t* rec_row;  // its recency row
  int32_t qv[kIlpGlobal];  // the first round of recency loads, in registers
};

// The table of the selected ordinals in one of its two forms. Entry e (complete after the slots
// phase) holds its first column (>= K: none), its unit and its slot (kNoSlot: none).
template <bool kDirect>
struct Table {
  uint32_t* word;
  uint32_t* first;
  int32_t* key;
  int32_t* hslot;
  int32_t unit0;
  int64_t end;
  int bits;

  __device__ __forceinline__ void entry_of(int32_t e, uint32_t& f, int32_t& u, int32_t& sl) const {
    if (kDirect) {
      const uint32_t w = word[e];
      f = w >> 16;
      u = unit0 + e;
      sl = (w & 0xffffu) == 0xffffu ? kNoSlot : static_cast<int32_t>(w & 0xffffu);
    } else {
      f = first[e];
      u = key[e];
      sl = hslot[e];
    }
  }
  __device__ __forceinline__ void set_slot(int32_t e, int32_t sl) const {  // one thread per entry
    if (kDirect)
      word[e] = (word[e] & 0xffff0000u) | (sl == kNoSlot ? 0xffffu : static_cast<uint32_t>(sl));
    else
      hslot[e] = sl;
  }
  // The entry of a selected unit u, else -1.
  __device__ __forceinline__ int32_t find(int32_t u) const {
    if (!kDirect) return hash_find(key, u, bits);
    if (u < unit0 || u >= end) return -1;
    return (word[u - unit0] >> 16) != 0xffffu ? u - unit0 : -1;
  }
  // The unit of entry e.
  __device__ __forceinline__ int32_t unit(int32_t e) const { return kDirect ? unit0 + e : key[e]; }
};

// Visits this thread's own selection copies (copy_async's assignment), col_entry[j] = f(j, v)
// for each: they are visible to it once its copies have landed, before any barrier.
template <typename F>
__device__ __forceinline__ void for_own_columns(int32_t* col_entry, int K, bool sel_aligned,
                                                F&& f) {
  const int tid = threadIdx.x;
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
}

// Only selectable units ever hold a slot (the others were dropped in step 0); l * S + slot <=
// INT32_MAX (checked on the host).
__device__ __forceinline__ int32_t index_entry(int32_t lease_base, int32_t sl) {
  return sl != kNoSlot ? lease_base + sl : BAD;
}

// What the victims phase settles for place and the write-back.
struct Placement {
  int nA;       // admissions
  int placed;   // victims taken: admissions first, then misses
  int fA;       // placed admissions that need a fetch (a prefix of them)
  int n_fetch;  // this row's miss-list entries
  unsigned long long reserved;  // thread 0: the reservation word before this CTA's add
};

// resolve_kernel<kGlobalTable, kWrites> (resolve.cu) of a launch: the table region in global
// scratch or shared memory, with OP-WRITE's outputs or without.
using ResolveKernel = void (*)(ResolveParams);
ResolveKernel resolve_kernel_of(bool global_table, bool writes);

// ---- phase timer (development builds with TORCH_KVCM2_DEV=profile only; nothing otherwise)
// Thread 0 of each CTA stamps clock64() at the kernel's start (KVCM2_PROF_BEGIN), at the end of
// each phase (KVCM2_PROF(1..11)) and at the parts of the load, hash and write phases
// (KVCM2_PROF_PART(0..7)): load = rows issued + row rules, infl fill, selection wait, direct
// insert, verify (the lease, history and capacity read after the PDL wait) + vote; hash = hash
// insert, recency staging, resident wait + barrier; write = miss-list entries, recency row.
// "fill" includes the early reads of the lease, history and capacity. KVCM2_PROF_END prints
// CTA 0's phases and parts and every CTA's cycles after the PDL wait, the lines
// scripts/gpu_check.sh PROFILE=1 summarises.
#ifdef KVCM2_DEV_PROFILE
static __shared__ long long s_prof_phase[12], s_prof_part[8];
#define KVCM2_PROF_BEGIN() KVCM2_PROF(0)
#define KVCM2_PROF(i) (threadIdx.x == 0 ? (void)(s_prof_phase[i] = clock64()) : (void)0)
#define KVCM2_PROF_PART(i) (threadIdx.x == 0 ? (void)(s_prof_part[i] = clock64()) : (void)0)
#define KVCM2_PROF_END()                                                                       \
  if (threadIdx.x == 0) {                                                                      \
    const long long end = clock64();                                                           \
    const long long* t = s_prof_phase;                                                         \
    const long long* q = s_prof_part;                                                          \
    if (blockIdx.x == 0) {                                                                     \
      printf("resolve phases (cycles): %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld " \
             "%lld\n",                                                                         \
             t[1] - t[0], t[2] - t[1], t[3] - t[2], t[4] - t[3], t[5] - t[4], t[6] - t[5],     \
             t[7] - t[6], t[8] - t[7], t[9] - t[8], t[10] - t[9], t[11] - t[10], end - t[11]); \
      printf("resolve parts (cycles): %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld\n",    \
             q[0] - t[3], q[1] - q[0], q[2] - q[1], q[3] - q[2], t[4] - q[3], q[4] - t[4],     \
             q[5] - q[4], t[5] - q[5], q[6] - t[11], q[7] - q[6]);                             \
    }                                                                                          \
    printf("resolve cta (cycles after the wait): %lld\n", end - t[2]);                         \
  }
#else
#define KVCM2_PROF_BEGIN()
#define KVCM2_PROF(i)
#define KVCM2_PROF_PART(i)
#define KVCM2_PROF_END()
#endif

}  // namespace torch_kvcm2
