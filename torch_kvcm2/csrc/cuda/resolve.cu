// CUDA kernel of OP-RESOLVE. It reproduces cpu/resolve.cpp bit for bit; only the order of rows
// inside the miss list may differ (INT-4).
//
// One CTA per row, the lease's residency rows staged in shared memory, O(K + S) work per row and
// no global sort. resolve_kernel is the sequence of its phases:
//   preamble  before the PDL wait (launch.cuh), so it overlaps the previous kernel: the row's
//             lease, history and capacity read early (checked after the wait; a stale attempt is
//             redone) and the row rules, then the shared-memory init;
//   load      the selection (cp.async, first), resident (cp.async) and recency (to registers);
//             a row whose live unit range fits the table's space fills a direct table of one
//             word per unit (first column << 16 | lowest slot) from each thread's own copies
//             of the selection as they land: no hashing, no probes;
//   hash      for the other rows (long live ranges, or a selected ordinal outside the range), a
//             shared open-addressing hash of the selected ordinals (atomicCAS insert; atomicMin
//             keeps each ordinal's first column), >= 4K entries when shared memory allows (short
//             probes), filled while the lease's rows still arrive; then recency from registers.
//             The phases after this choice are compiled once per mode (Table<kDirect>);
//   slots     step 0 (a dropped unit's slot is written back at once) and each slot's victim kind
//             (empty or evictable); every resident slot looks its unit up in the table
//             (atomicMin: lowest slot wins, like the CPU's slot_of.emplace) and the in-flight
//             array (which in-flight units are resident);
//   columns   (scan 1, part 1) first-occurrence kinds (invalid, hit, miss), hit slots (step 2)
//             and pinned slots (step 1) lose their victim kind, hit slots take their class, the
//             index entries that place cannot change are written (step 5), admissions;
//   victims   (scan 1, part 2) one block scan ranks misses in column order, admissions in unit
//             order and the victims among recency positions 0..511 (one per thread); further
//             rounds of 512 positions (warp ballots) only while victims are missing: the victims
//             are the first `placed` empty slots, then evictable ones, each in recency order; it
//             also sums hits/invalid for the counters;
//   place     victim k takes admission k, then miss k - #admissions (the resident row is
//             written at the placed slots);
//   index     the row's in-flight slot records and the index entries left pending (placed
//             misses and admissions; every column after place hid a slot, on bad data);
//   scan 2    the stable 4-way partition of recency (untouched, misses, pinned, hits);
//   write     the row's miss-list entries at a base reserved with one 64-bit atomic per CTA
//             (reserve / publish_if_last: issued in the victims phase, consumed at the end to
//             hide its latency; no memset before launch), then recency.
// Scans run over blocked per-thread ranges of whole 4/8/16-byte chunks (load_chunk /
// store_chunk), so the sequential shared arrays are read without bank conflicts. Every phase
// function is __forceinline__: the kernel compiles to one function, as if written in one piece.
// It is compiled once per memory space of the table region (resolve_kernel<kGlobalTable, ...>):
// in shared memory for every row that fits the shared layout, in a global scratch for wide rows
// (multi-token selections); everything else is in shared memory in both. Each is compiled with
// and without OP-WRITE's outputs (kWrites), written after the index phase. The host wrapper,
// which sizes the layout and picks the instantiation (resolve_kernel_of), is resolve_launch.cu.
#include <cuda_pipeline.h>

#include <algorithm>
#include <cstdint>

#include "../rules.h"
#include "launch.cuh"
#include "resolve.cuh"

namespace torch_kvcm2 {
namespace {

// Per-CTA scalars and warp totals (static shared memory).
__shared__ Tally s_tally[kResolveWarps];        // scan 1 warp totals
__shared__ Tally s_classes[kResolveWarps];      // scan 2 warp totals
__shared__ uint32_t s_round[2][kResolveWarps];  // victim search rounds >= 1
__shared__ int32_t s_miss_base;
__shared__ int32_t s_erased;  // place hid a unit's surviving slot (bad data): redo every column

// The row rules of one row, out of line: the kernel needs them at three places (the preamble,
// an early hole, a stale attempt), and each inlined copy of RowRange's int64 divisions is
// ~2 KB of code; one copy keeps the hot path denser in the instruction cache.
// (Scalars, not the parameter struct: a reference to a kernel parameter would copy it to local
// memory.)
__device__ __noinline__ RowRange row_range(int32_t h, int32_t c, int64_t U, int64_t P, int64_t I,
                                           int64_t window, int64_t sinks) {
  return RowRange(h, c, U, P, I, window, sinks);
}

__device__ __forceinline__ RowRange range_of(const ResolveParams& p, int32_t h, int32_t c) {
  return row_range(h, c, p.tokens_per_unit, p.tokens_per_page, p.max_inflight_tokens, p.window,
                   p.sinks);
}

// ---- preamble, before the PDL wait (launch.cuh), so under PDL it overlaps the previous kernel of
// the stream. The row's lease, history and capacity are read here, early: only `publish` writes
// them (with torch ops, between steps), never a library kernel, so they almost always hold their
// final values already; but before the wait nothing guarantees that, so they are read again
// after it and compared (at the vote in load_rows). The first attempt loads the lease's rows and
// derives the row rules from the early values, which takes the lease's global round trip and
// the rules off the critical path; an attempt whose early values differ is abandoned before it
// has written anything but shared memory, and redone with the values read after the wait.
template <bool kGlobalTable>
__device__ __forceinline__ void preamble(const ResolveParams& p, const Arrays& A, Row& row) {
  const int r = row.r, S = row.S, tid = threadIdx.x;
  row.l = load_in_place(p.lease + r);
  row.h = load_in_place(p.history + r), row.c = load_in_place(p.capacity + r);
#ifdef KVCM2_DEV
  if (p.force_stale) {  // tests: a stale lease, history or capacity, or an early hole, by row
    const int kind = r & 3;
    if (kind == 0 && row.l >= 0 && p.leases > 1)
      row.l = static_cast<int32_t>((row.l + 1) % p.leases);
    if (kind == 1) row.h += 1;
    if (kind == 2) row.l = -1;
    if (kind == 3) row.c += 7;
  }
#endif
  // Then the shared-memory init that reads no global memory (16 bytes per store; every array
  // starts 16-byte aligned).
  static_assert(kEmptyKey == -1, "one fill serves key, first and the direct table");
  // (A table region in global scratch is filled after the PDL wait, in resolve_kernel: the
  // previous kernel may be a resolve still using it.)
  if (!kGlobalTable) fill_words(A.key, static_cast<int>(p.L.table_words), -1);
  static_assert(kUntouched == 0, "cls starts zeroed");
  fill_words(reinterpret_cast<int32_t*>(A.cls), S / 4, 0);
  for (int s = S / 4 * 4 + tid; s < S; s += kResolveThreads) A.cls[s] = 0;
  if (tid == 0) s_erased = 0;
  row.range = range_of(p, row.h, row.c);
  __syncthreads();  // the table is filled before any thread inserts into it (before the vote)
}

// After the wait: the selection does not depend on the lease, so copying it (into col_entry,
// converted to table entries later) starts at once; cp.async keeps the loads in flight without
// holding registers. Then the values that decide, whose round trip overlaps the rows' loads.
__device__ __forceinline__ void start_loads(const ResolveParams& p, const Arrays& A, Row& row) {
  const int r = row.r, K = row.K;
  row.sel_row = p.selected + static_cast<int64_t>(r) * K;
  copy_async(A.col_entry, row.sel_row, K);
  __pipeline_commit();
  row.lv = load_in_place(p.lease + r);
  row.hv = load_in_place(p.history + r), row.cv = load_in_place(p.capacity + r);
  row.out = p.index_table + static_cast<int64_t>(r) * K;
  row.located = p.inflight_slots + static_cast<int64_t>(r) * p.MI;
}

__device__ __forceinline__ bool is_hole(const ResolveParams& p, int32_t lease) {
  return lease < 0 || lease >= p.leases;
}

// The table filled again and the selection copied again (a direct insert changed both), once
// every copy in flight has landed.
__device__ __forceinline__ void restart_table(const ResolveParams& p, const Arrays& A,
                                              const Row& row) {
  __pipeline_wait_prior(0);
  fill_words(A.key, static_cast<int>(p.L.table_words), -1);
  copy_async(A.col_entry, row.sel_row, row.K);
  __pipeline_commit();
}

// Hole, suspended row, or a bad lease: touch no residency. Holes are not speculated on.
__device__ __forceinline__ void leave_hole(const ResolveParams& p, const Row& row) {
  const int tid = threadIdx.x;
  if (tid == 0) publish_if_last(p, reserve(p, 0), 0);
  __pipeline_wait_prior(0);
#pragma unroll 1
  for (int j = tid; j < row.K; j += kResolveThreads) row.out[j] = BAD;
#pragma unroll 1
  for (int i = tid; i < p.MI; i += kResolveThreads) row.located[i] = BAD;
}

// Takes the values read after the wait; false for a hole, which it has left. (opaque: in the
// redo path of load_rows their uses would otherwise be hoisted above the attempt loop, which
// would wait for the verifying loads before the first attempt's row loads are issued.)
__device__ __forceinline__ bool adopt_verified(const ResolveParams& p, Row& row) {
  row.l = opaque(row.lv);
  row.h = opaque(row.hv);
  row.c = opaque(row.cv);
  if (is_hole(p, row.l)) {
    leave_hole(p, row);
    return false;
  }
  row.range = range_of(p, row.h, row.c);
  return true;
}

// ---- load: the lease's rows, the row rules and (when the row's live range fits) the direct
// table, at most twice: with the early values, then (rarely) with the verified ones. Returns
// false for a hole (left), else whether the row takes the direct table in `use_direct`.
__device__ __forceinline__ bool load_rows(const ResolveParams& p, const Arrays& A, Row& row,
                                          bool& use_direct) {
  const int tid = threadIdx.x, S = row.S;
  // An early hole is decided by the whole CTA: the early values may differ between threads (a
  // lease published while they were read), and a thread that left as a hole would miss the
  // barriers the others reach. Any thread's early hole sends every thread to the verified values.
  if (__syncthreads_or(is_hole(p, row.l)) && !adopt_verified(p, row)) return false;
  KVCM2_PROF(3);
  const bool sel_aligned = (reinterpret_cast<uintptr_t>(row.sel_row) & 15) == 0;
#pragma unroll 1
  for (;;) {
    row.res_row = p.resident + static_cast<int64_t>(row.l) * S;
    row.rec_row = p.recency + static_cast<int64_t>(row.l) * S;
    copy_async(A.res, row.res_row, S);
    __pipeline_commit();
    // Recency goes through registers (to uint16); its first round of loads is issued before the
    // row rules, so their work hides the loads' latency.
#pragma unroll
    for (int i = 0; i < kIlpGlobal; ++i) {
      const int q = tid + i * kResolveThreads;
      row.qv[i] = q < S ? row.rec_row[q] : 0;
    }

    row.rules = UnitRules(row.range);
    row.a = row.range.first_inflight;
    // In-flight units a .. a + nF - 1; nF <= MI always (CFG-3 bound), clamped only for safety.
    const int64_t n_inflight = row.range.end_inflight - row.a;
    row.nF = static_cast<int>(n_inflight < p.MI ? n_inflight : p.MI);
    KVCM2_PROF_PART(0);

    fill_words(A.infl, row.nF, kNoSlot);
    // The direct unit table covers [unit0, end): every selectable unit, and the non-selectable
    // gaps between the sink units and the window (TIER-3) and between history and the in-flight
    // range. A row takes it when the range fits the table region and every selected ordinal >= 0
    // lies in it; else (long live ranges, bad ordinals) the hash.
    row.unit0 = row.rules.first_selectable();
    row.end = row.rules.settled > row.range.end_inflight ? row.rules.settled : row.range.end_inflight;
    const int32_t unit0 = row.unit0;
    const int64_t end = row.end;
    bool outside = end - unit0 > static_cast<int64_t>(p.L.table_words);
    KVCM2_PROF_PART(1);
    __pipeline_wait_prior(1);  // the selection has landed (the group before the rows' last)
    KVCM2_PROF_PART(2);
    // A row whose live range fits inserts its selection into the direct table right away (its
    // own copies, so no barrier first): col_entry becomes unit - unit0, -1 for padding; a selected
    // ordinal outside the range leaves the row to the hash.
    bool bad = false;
    if (!outside) {
      uint32_t* const word = A.word;
      for_own_columns(A.col_entry, row.K, sel_aligned, [&](int j, int32_t u) -> int32_t {
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
    const bool stale = row.l != row.lv || row.h != row.hv || row.c != row.cv;
    use_direct = !__syncthreads_or(outside || bad || stale);
    if (use_direct) break;
    if (!__syncthreads_or(stale)) {
      if (!outside) {  // a selected ordinal outside the range: the hash, on a clean table
        restart_table(p, A, row);
        __pipeline_wait_prior(0);
        __syncthreads();
      }
      break;
    }
    restart_table(p, A, row);  // a stale attempt: redone with the verified values
    __syncthreads();
    if (!adopt_verified(p, row)) return false;
  }
  return true;
}

// ---- hash: the table of the selected ordinals, with each ordinal's first column, while the
// lease's rows are still arriving. col_entry becomes each column's hash entry, -1 for padding.
__device__ __forceinline__ void build_hash(const Arrays& A, const Row& row) {
  const int bits = row.bits;
  const int mask = (1 << bits) - 1;
  for_chunks<1>(threadIdx.x, row.K, kResolveThreads, [&](const auto& j, const auto& ok) {
    constexpr int kN = sizeof(ok);
    int32_t u[kN], e[kN], prev[kN];
#pragma unroll
    for (int i = 0; i < kN; ++i) u[i] = ok[i] ? A.col_entry[j[i]] : -1;  // selected ordinals
#pragma unroll
    for (int i = 0; i < kN; ++i) {  // first insert attempts of the chunk, all in flight
      e[i] = hash_home(u[i], bits);
      prev[i] = (ok[i] && u[i] >= 0) ? atomicCAS(&A.key[e[i]], kEmptyKey, u[i]) : kEmptyKey;
    }
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      if (!ok[i]) continue;
      if (u[i] < 0) {
        A.col_entry[j[i]] = -1;  // padding
        continue;
      }
      while (prev[i] != kEmptyKey && prev[i] != u[i]) {  // collision: linear probing
        e[i] = (e[i] + 1) & mask;
        prev[i] = atomicCAS(&A.key[e[i]], kEmptyKey, u[i]);
      }
      // hslot is read only at inserted entries, and only after the next barrier: the insert
      // that took the entry initialises it (no fill of the whole table).
      if (prev[i] == kEmptyKey) A.hslot[e[i]] = kNoSlot;
      atomicMin(&A.first[e[i]], static_cast<uint32_t>(j[i]));
      A.col_entry[j[i]] = e[i];
    }
  });
}

// Recency, from registers and then the rest of the row, into shared memory; then the resident
// row has landed and the table is complete (barrier). recency must be a permutation of [0, S)
// (bad device data); an out-of-range entry is replaced so that nothing here can index out of
// bounds.
__device__ __forceinline__ void stage_recency(const ResolveParams& p, const Arrays& A,
                                              const Row& row) {
  const int tid = threadIdx.x, S = row.S;
  uint16_t* const rec = A.rec;
  auto stage_rec = [&](int q, int32_t v) {
    rec[q] = static_cast<uint16_t>(static_cast<uint32_t>(v) < static_cast<uint32_t>(S) ? v : q);
  };
#pragma unroll
  for (int i = 0; i < kIlpGlobal; ++i) {
    const int q = tid + i * kResolveThreads;
    if (q < S) stage_rec(q, row.qv[i]);
  }
  const int32_t* const rec_row = row.rec_row;
  const int from = tid + kIlpGlobal * kResolveThreads;
  for_chunks<kIlpGlobal>(from, S, kResolveThreads, [&](const auto& q, const auto& ok) {
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
}

// ---- slots: step 0 on each resident slot (a negative unit other than BAD is bad data: dropped
// too) and its victim kind (empty, or evictable until the columns phase flags it hit or pinned);
// which selected / in-flight units are resident, lowest slot first (slot_of). The lease's
// resident row is written where it changes (here and in place), not copied back whole. Returns
// this thread's empty slots.
template <bool kDirect>
__device__ __forceinline__ uint32_t scan_slots(const ResolveParams& p, const Arrays& A,
                                               const Row& row, const Table<kDirect>& table) {
  const int tid = threadIdx.x, S = row.S, nF = row.nF;
  const UnitRules& rules = row.rules;
  uint32_t my_empty = 0;
  // Step 0 and the victim kind of slot q holding u; true if u stays (is selectable: never BAD
  // or another negative, as live >= 0).
  auto keep_slot = [&](int q, int32_t u) {
    const bool sel = rules.selectable(u);
    if (!sel & (u != BAD)) {  // dropped (rare)
      A.res[q] = BAD;
      row.res_row[q] = BAD;
    }
    A.vk[q] = sel ? 2 : 1;
    my_empty += !sel;
    return sel;
  };
  if (kDirect) {
    // One slot per iteration with one branch around the table lookup (the rest predicated):
    // a selectable unit lies in the table's range, and its first column (the word's high
    // half) is final since the last barrier.
#pragma unroll 1
    for (int q = tid; q < S; q += kResolveThreads) {
      const int32_t u = A.res[q];
      if (keep_slot(q, u)) {
        uint32_t* const wp = A.word + (u - row.unit0);
        const uint32_t w = *wp;
        if ((w >> 16) != 0xffffu) atomicMin(wp, (w & 0xffff0000u) | static_cast<uint32_t>(q));
        const uint32_t f = static_cast<uint32_t>(u - rules.first_inflight);
        if (f < static_cast<uint32_t>(nF)) atomicMin(&A.infl[f], q);
      }
    }
  } else {
    const int bits = table.bits;
    const int mask = (1 << bits) - 1;
    for_chunks<1>(tid, S, kResolveThreads, [&](const auto& q, const auto& ok) {
      constexpr int kN = sizeof(ok);
      int32_t u[kN], e[kN], k0[kN];
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        u[i] = ok[i] ? A.res[q[i]] : BAD;
        if (!ok[i] || !keep_slot(q[i], u[i])) u[i] = BAD;
      }
#pragma unroll
      for (int i = 0; i < kN; ++i) {  // first probes of the chunk, all in flight
        e[i] = hash_home(u[i], bits);
        k0[i] = (ok[i] && u[i] >= 0) ? A.key[e[i]] : kEmptyKey;
      }
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        if (!ok[i] || u[i] < 0) continue;
        while (k0[i] != u[i] && k0[i] != kEmptyKey) {
          e[i] = (e[i] + 1) & mask;
          k0[i] = A.key[e[i]];
        }
        if (k0[i] == u[i]) atomicMin(&A.hslot[e[i]], q[i]);
        if (rules.inflight(u[i])) {
          const int f = u[i] - rules.first_inflight;
          if (f < nF) atomicMin(&A.infl[f], q[i]);
        }
      }
    });
  }
  __syncthreads();
  return my_empty;
}

// ---- columns (scan 1, part 1): the kind of each column (first occurrence of a distinct
// ordinal): 0 none/padding/duplicate, 1 invalid, 2 hit (resident, or in flight: admitted, never
// fetched for the selection), 3 miss. A resident hit's slot is no victim (step 2), nor is a
// pinned in-flight slot (step 1): both clear the slot's victim kind. In-flight units not resident
// are admissions. The column kinds are kept (ckind; each thread reads back only what it wrote)
// so the ranking pass does not repeat the dependent loads.
// Step 5 is done here for every column whose slot place cannot change: the index entry of a
// resident unit (its slot is no victim) and BAD for a unit that can never get one (padding, not
// selectable); a resident hit's slot takes its class (kHit) here too. The columns of selectable
// units without a slot yet (misses and admissions, duplicates included) are flagged kPending in
// ckind and finished after place. Returns this thread's counts for the victims phase's scan.
template <bool kDirect>
__device__ __forceinline__ Tally scan_columns(const ResolveParams& p, const Arrays& A,
                                              const Row& row, const Table<kDirect>& table,
                                              uint32_t my_empty) {
  const UnitRules& rules = row.rules;
  int32_t* const out = row.out;
  const int32_t lease_base = row.l * row.S;
  const bool out_aligned = (reinterpret_cast<uintptr_t>(out) & 15) == 0;
  Tally mine{0, 0, my_empty << 16};
  uint32_t hits_invalid = 0, misses = 0;
  int lo, hi;
  blocked_range<4>(row.K, lo, hi);
#pragma unroll 1
  for (int b = lo; b < hi; b += 4) {
    int32_t e[4], o[4];
    uint8_t k[4];
    load_chunk(A.col_entry, b, hi, e, -1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // kinds by selects, not branches; one predicated store
      uint32_t f = 0xffffu;
      int32_t u = -1, sl = kNoSlot;
      if (e[i] >= 0) table.entry_of(e[i], f, u, sl);
      const bool first = (e[i] >= 0) & (f == static_cast<uint32_t>(b + i));
      const bool sel = rules.selectable(u), resident = sl != kNoSlot;
      const uint8_t kind = !first ? 0 : !sel ? 1 : (resident | rules.inflight(u)) ? 2 : 3;
      if (first & sel & resident) {
        A.vk[sl] = 0;
        A.cls[sl] = kHit;
      }
      hits_invalid += kind == 2 ? 1u : kind == 1 ? 1u << 16 : 0u;
      misses += kind == 3;
      o[i] = index_entry(lease_base, sl);
      k[i] = kind | (sel & !resident ? kPending : 0);
    }
    store_chunk(A.ckind, b, hi, k);
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
  blocked_range<1>(row.nF, lo, hi);
#pragma unroll 1
  for (int i = lo; i < hi; ++i) {
    const int32_t sl = A.infl[i];
    if (sl != kNoSlot) {
      A.vk[sl] = 0;
      // A pinned slot whose unit is selected is its entry's lowest slot: a hit, classed by the
      // columns above (kHit wins; nothing here races with them).
      const int32_t u = static_cast<int32_t>(row.a + i);
      if (!(rules.selectable(u) && table.find(u) >= 0)) A.cls[sl] = kPinned;
    } else {
      mine.rank += 1ull << kAdmitLane;
      mine.fetch_empty += row.range.needs_fetch_on_admit(row.a + i);
    }
  }
  __syncthreads();
  return mine;
}

// Rounds >= 1 of a search for recency positions of victim kind `kind`: vlist[offset + rank] for
// the ranks below `want`; `found` counts them (round 0's included). The condition is uniform
// over the CTA; `rounds` alternates the warp-count buffers.
__device__ __forceinline__ void search_victims(const Arrays& A, int S, uint8_t kind,
                                               uint32_t& found, uint32_t want, uint32_t offset,
                                               int& rounds) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#pragma unroll 1
  for (int q = kResolveThreads + tid; found < want && q - tid < S; q += kResolveThreads) {
    const uint16_t sl = q < S ? A.rec[q] : 0;
    const bool is = q < S && A.vk[sl] == kind;
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
    if (is && rank < want) A.vlist[offset + rank] = sl;
    found += all;
  }
}

// ---- victims (scan 1, part 2), in taking order: empty slots, then evictable ones (neither hit
// nor pinned), each in recency order. Only the first nA + nM are taken (a few per step in steady
// state, and the least recently used slots are the untouched ones at the front of recency), so
// they are searched for from the front, one position per thread per round: round 0's ranks ride
// in this block scan; further rounds (rare: empty slots deep in recency, or many victims) rank by
// warp ballots. Empty positions are searched for only when some slot is empty (with bad data
// recency may name a slot twice, so their number is only known once counted), until they are
// enough or recency is exhausted; then evictable ones, after them. Then the miss and admission
// lists in rank order, the miss-list reservation and the counters.
__device__ __forceinline__ Placement find_victims(const ResolveParams& p, const Arrays& A,
                                                  const Row& row, Tally mine) {
  const int tid = threadIdx.x, S = row.S;
  uint16_t sl0 = 0;
  uint8_t k0 = 0;
  if (tid < S) {
    sl0 = A.rec[tid];
    k0 = A.vk[sl0];
  }
  mine.rank += k0 == 1 ? 1ull << kEmptyLane : k0 == 2 ? 1ull << kEvictLane : 0ull;
  Tally total;
  const unsigned long long before = block_scan(mine, total, s_tally);
  const int nM = static_cast<int>(lane16(total.rank, kMissLane));
  const int nA = static_cast<int>(lane16(total.rank, kAdmitLane));
  const uint32_t need = static_cast<uint32_t>(nA + nM);
  int rounds = 0;  // rounds searched after round 0
  uint32_t f1 = 0;  // empty positions found: all of them unless need of them were found
  if (total.fetch_empty >> 16) {
    f1 = lane16(total.rank, kEmptyLane);
    const uint32_t rank0 = lane16(before, kEmptyLane);
    if (k0 == 1 && rank0 < need) A.vlist[rank0] = sl0;
    search_victims(A, S, 1, f1, need, 0, rounds);
  }
  uint32_t f2 = 0;  // evictable positions found
  if (f1 < need) {
    f2 = lane16(total.rank, kEvictLane);
    const uint32_t rank0 = lane16(before, kEvictLane);
    if (k0 == 2 && rank0 < need - f1) A.vlist[f1 + rank0] = sl0;
    search_victims(A, S, 2, f2, need - f1, f1, rounds);
  }
  Placement pl;
  pl.nA = nA;
  pl.placed = static_cast<int>(min(need, f1 + f2));
  const int pA = min(nA, pl.placed);  // placed admissions
  const int pM = pl.placed - pA;      // placed misses
  // Admissions that need a fetch (partly written head units) are a prefix of the ascending
  // admissions, so the placed ones are the first fA.
  pl.fA = min(static_cast<int>(total.fetch_empty & 0xffffu), pA);
  {
    int lo, hi;
    uint32_t m = lane16(before, kMissLane);
    blocked_range<4>(row.K, lo, hi);
#pragma unroll 1
    for (int b = lo; b < hi; b += 4) {
      int32_t e[4];
      uint8_t k[4];
      load_chunk(A.col_entry, b, hi, e, -1);
      load_chunk(A.ckind, b, hi, k, uint8_t{0});
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if ((k[i] & 3) == 3) A.miss_entry[m++] = e[i];
    }
    uint32_t ad = lane16(before, kAdmitLane);
    blocked_range<1>(row.nF, lo, hi);
#pragma unroll 1
    for (int i = lo; i < hi; ++i)
      if (A.infl[i] == kNoSlot) A.admit[ad++] = i;
  }
  pl.n_fetch = pl.fA + pM;
  pl.reserved = 0;
  if (tid == 0) {
    pl.reserved = reserve(p, pl.n_fetch);  // consumed at the end, to hide the atomic's latency
    const unsigned long long hits = total.hits_invalid & 0xffffu, misses = pM;
    const unsigned long long invalid = (total.hits_invalid >> 16) +
                                       static_cast<unsigned>(nA - pA) +
                                       static_cast<unsigned>(nM - pM);
    if (hits) atomicAdd(p.counters + kHits, hits);
    if (misses) atomicAdd(p.counters + kMisses, misses);
    if (invalid) atomicAdd(p.counters + kInvalid, invalid);
  }
  __syncthreads();
  return pl;
}

// ---- place: admissions take victims first, then misses in first-occurrence order.
template <bool kDirect>
__device__ __forceinline__ void place(const Arrays& A, const Row& row, const Table<kDirect>& table,
                                      const Placement& pl) {
  const int nA = pl.nA, nF = row.nF;
#pragma unroll 1
  for (int k = threadIdx.x; k < pl.placed; k += kResolveThreads) {
    const int sl = A.vlist[k];
    const int32_t old = A.res[sl];
    // The CPU erases slot_of[old] when a slot is reused. A reused slot's unit can only be
    // selected if it was resident twice (bad data) and this is not its lowest slot: the erase
    // then hides the unit's surviving slot from the index table. Reproduce that: the surviving
    // slot loses the hit class the columns phase gave it, and every column's index entry is
    // redone in the index phase.
    if (old >= 0) {
      const int32_t e_old = table.find(old);
      if (e_old >= 0) {
        uint32_t f_old;
        int32_t u_old, sl_old;
        table.entry_of(e_old, f_old, u_old, sl_old);
        if (sl_old != kNoSlot)  // pinned if the unit has an in-flight record
          A.cls[sl_old] = static_cast<uint32_t>(old - row.rules.first_inflight) <
                                  static_cast<uint32_t>(nF) ? kPinned : kUntouched;
        table.set_slot(e_old, kNoSlot);
        s_erased = 1;
      }
    }
    int32_t u, e;
    if (k < nA) {
      u = static_cast<int32_t>(row.a + A.admit[k]);
      e = u >= 0 ? table.find(u) : -1;  // a selected in-flight unit lands here: a hit
      A.cls[sl] = e >= 0 ? kHit : kPinned;
      A.infl[A.admit[k]] = sl;  // its in-flight slot record
    } else {
      e = A.miss_entry[k - nA];
      u = table.unit(e);
      A.cls[sl] = kMissed;
    }
    if (e >= 0) table.set_slot(e, sl);
    A.res[sl] = u;
    row.res_row[sl] = u;
  }
  __syncthreads();
}

// OP-WRITE in the same launch (the outputs of write_indices_kernel, cuda/write_indices.cu, bit
// for bit, through the same inflight_slot rule): token s0 + j of row r goes to cell token index
// (l*S + slot)*U + t mod U, from the in-flight slot records `infl` (nF of them) and the resident
// row `res` as place left them (final: place ends in a barrier); BAD past capacity and where the
// unit has no slot. One pass of the table's I + U - 1 columns, after the index phase
// (resolve_kernel's kWrites instantiations only: the others' code is the resolve alone).
__device__ __noinline__ void write_entries(int32_t* table, int32_t* start, int width, int r,
                                           const RowRange range, int nF, int64_t l, int S,
                                           const int32_t* infl, const int32_t* res) {
  int32_t* const out = table + static_cast<int64_t>(r) * width;
  const int64_t U = range.tokens_per_unit;
#pragma unroll 1
  for (int j = threadIdx.x; j < width; j += kResolveThreads) {
    const int64_t t = range.inflight_start + j;
    int32_t v = BAD;
    if (t < range.capacity) {
      const int64_t slot = inflight_slot(range, t / U, infl, nF, res, S);
      if (slot != BAD) v = static_cast<int32_t>((l * S + slot) * U + t % U);
    }
    out[j] = v;
  }
  if (threadIdx.x == 0) start[r] = static_cast<int32_t>(range.inflight_start);
}

// A hole's write outputs (write_indices_kernel's): BAD throughout.
__device__ __noinline__ void write_hole(int32_t* table, int32_t* start, int width, int r) {
  int32_t* const out = table + static_cast<int64_t>(r) * width;
#pragma unroll 1
  for (int j = threadIdx.x; j < width; j += kResolveThreads) out[j] = BAD;
  if (threadIdx.x == 0) start[r] = BAD;
}

// ---- index: the in-flight slot records (final since place): the lowest slot that held the unit
// (pinned, so it still does), or the admission's slot; BAD for an admission that found no
// victim. Stored first, so their stores drain under the index and scan-2 phases instead of
// queueing at the end behind the recency row. Then the index table (step 5): the columns the
// columns phase left pending (a placed miss or admission, or none found), or every column after
// an erase. No barrier after it: scan 2 reads only what place wrote, and its first writes into
// the table region (newrec) follow its block scan's barrier, which every thread reaches after
// its lookups here.
template <bool kDirect>
__device__ __forceinline__ void write_index(const ResolveParams& p, const Arrays& A,
                                            const Row& row, const Table<kDirect>& table) {
  const int tid = threadIdx.x;
#pragma unroll 1
  for (int i = tid; i < p.MI; i += kResolveThreads)
    row.located[i] = (i < row.nF && A.infl[i] != kNoSlot) ? A.infl[i] : BAD;

  const int32_t lease_base = row.l * row.S;
  const bool redo_all = s_erased != 0;
  int lo, hi;
  blocked_range<4>(row.K, lo, hi);
#pragma unroll 1
  for (int b = lo; b < hi; b += 4) {
    uint8_t k[4];
    load_chunk(A.ckind, b, hi, k, uint8_t{0});
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (b + i >= hi || !(redo_all || (k[i] & kPending))) continue;
      const int32_t e = A.col_entry[b + i];
      uint32_t f;
      int32_t u, sl = kNoSlot;
      if (e >= 0) table.entry_of(e, f, u, sl);
      row.out[b + i] = index_entry(lease_base, sl);
    }
  }
}

// ---- scan 2: recency = untouched, misses, pinned, hits, each keeping its previous order, into
// newrec. Pass 1 counts each thread's positions per class in 8-bit lanes of a 32-bit word (a
// thread holds at most 128 positions: S <= 65535, checked on the host), widened to 16-bit lanes
// of a 64-bit word for the block scan (totals <= S: no carries). A thread whose share is one
// whole chunk (when S <= 8 x threads: every thread but the last one holding positions) keeps its
// slots and classes in registers for the ranking pass; other shares go through pclass.
__device__ __forceinline__ void partition_recency(const Arrays& A, int S) {
  int lo, hi;
  blocked_range<8>(S, lo, hi);
  const bool one_chunk = hi - lo == 8;
  uint16_t sl[8];
  uint8_t c[8];
  uint32_t mine8 = 0;
  if (one_chunk) {
    load_chunk(A.rec, lo, hi, sl, uint16_t{0});
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      c[i] = A.cls[sl[i]];
      mine8 += 1u << (8 * c[i]);
    }
  } else {
    mine8 = gather_by_recency<uint32_t>(A.rec, A.cls, A.pclass, lo, hi,
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
      A.newrec[(next >> shift) & 0xffffu] = sl[i];
      next += 1ull << shift;
    }
  };
  if (one_chunk) {
    place_chunk(8);
  } else {
#pragma unroll 1
    for (int b = lo; b < hi; b += 8) {
      load_chunk(A.rec, b, hi, sl, uint16_t{0});
      load_chunk(A.pclass, b, hi, c, uint8_t{0});
      place_chunk(hi - b);
    }
  }
}

// ---- write: this row's miss-list entries first (a few scattered stores), at the base reserved
// in the victims phase (s_miss_base), then the lease's recency row (16-byte stores when aligned;
// resident was written where it changed), last: its 16 KB of stores queue behind nothing the CTA
// still has to issue.
__device__ __forceinline__ void write_back(const ResolveParams& p, const Arrays& A,
                                           const Row& row, const Placement& pl) {
  const int tid = threadIdx.x, S = row.S;
  const int32_t base = s_miss_base;
#pragma unroll 1
  for (int k = tid; k < pl.placed; k += kResolveThreads) {
    int idx;
    if (k < pl.nA) {
      if (k >= pl.fA) continue;  // admitted unit wholly in flight: nothing to fetch
      idx = k;
    } else {
      idx = pl.fA + (k - pl.nA);
    }
    const int sl = A.vlist[k];
    int32_t* const entry = p.miss_list + static_cast<int64_t>(base + idx) * kMissFields;
    entry[kMissLease] = row.l;
    entry[kMissSlot] = sl;
    entry[kMissRow] = row.r;
    entry[kMissUnit] = A.res[sl];
  }
  KVCM2_PROF_PART(6);
  int32_t* const rec_row = row.rec_row;
  if ((reinterpret_cast<uintptr_t>(rec_row) & 15) == 0) {
#pragma unroll 1
    for (int b = 8 * tid; b < S; b += 8 * kResolveThreads) {
      uint16_t v[8];
      load_chunk(A.newrec, b, S, v, uint16_t{0});
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
    for (int q = tid; q < S; q += kResolveThreads) rec_row[q] = A.newrec[q];
  }
  KVCM2_PROF_PART(7);
}

// The phases after the table mode is chosen, compiled once per mode (and per kWrites: the write
// outputs too).
template <bool kDirect, bool kWrites>
__device__ __forceinline__ void resolve_row(const ResolveParams& p, const Arrays& A,
                                            const Row& row) {
  const Table<kDirect> table{A.word, A.first, A.key, A.hslot, row.unit0, row.end, row.bits};
  if (!kDirect) build_hash(A, row);
  KVCM2_PROF_PART(4);
  stage_recency(p, A, row);
  KVCM2_PROF(5);
  const uint32_t my_empty = scan_slots(p, A, row, table);
  KVCM2_PROF(6);
  const Tally mine = scan_columns(p, A, row, table, my_empty);
  KVCM2_PROF(7);
  const Placement pl = find_victims(p, A, row, mine);
  KVCM2_PROF(8);
  place(A, row, table, pl);
  KVCM2_PROF(9);
  write_index(p, A, row, table);
  if (kWrites)  // A.infl and A.res are final since place's barrier
    write_entries(p.write_table, p.write_start, p.write_width, row.r, row.range, row.nF, row.l,
                  row.S, A.infl, A.res);
  KVCM2_PROF(10);
  partition_recency(A, row.S);
  if (threadIdx.x == 0) {  // the atomic's latency overlapped place/index/scan 2
    s_miss_base = static_cast<int32_t>(static_cast<uint32_t>(pl.reserved));
    publish_if_last(p, pl.reserved, pl.n_fetch);
  }
  __syncthreads();
  KVCM2_PROF(11);
  write_back(p, A, row, pl);
  KVCM2_PROF_END();
}

// One CTA per row, 1 CTA per SM (K=2048, S=4096 takes ~158 KB of shared memory with the sparse
// hash). Measured on an H200, 2026-11-30 (P-RES: 64 rows, K=2048, S=4096, 1% misses): 7.8-8.1 us
// per graph-replayed launch (~13.5K cycles per CTA after the PDL wait). Nsight Compute: ~35K warp
// instructions per CTA, each warp issuing one every ~9 cycles, mostly waiting on the previous
// instruction's result (integer and shared-memory dependency chains), not on shared-memory
// bandwidth: the time follows the instructions per warp. docs/DEVELOPMENT.md says how to print
// the phase profile.
// kGlobalTable: the table region is this CTA's part of p.table_scratch (wide rows), else it is
// in shared memory. One kernel per memory space, so that every table access of the shared one
// compiles to shared-memory instructions (LDS/STS/ATOMS): a pointer that may point into either
// space is generic, and a generic access costs more than a shared one on this kernel's
// dependency chains.
// kWrites: the launch also writes OP-WRITE's outputs (p.write_table); a separate instantiation,
// so that a resolve without them compiles with no trace of them (6,600 SASS instructions against
// 6,608 before they existed, the parameter block aside).
template <bool kGlobalTable, bool kWrites>
__global__ __launch_bounds__(kResolveThreads, 1) void resolve_kernel(const ResolveParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  KVCM2_PROF_BEGIN();
  unsigned char* const table =
      kGlobalTable ? p.table_scratch + static_cast<size_t>(blockIdx.x) * p.L.table_bytes : smem;
  const Arrays A(smem, table, p.L);
  Row row;
  row.r = blockIdx.x;
  row.S = p.S, row.K = p.K, row.bits = p.hash_bits;
  preamble<kGlobalTable>(p, A, row);
  KVCM2_PROF(1);
  pdl_enter();
  if (kGlobalTable) {  // wide rows: the table region in global scratch
    fill_words(A.key, static_cast<int>(p.L.table_words), -1);
    __syncthreads();  // filled before any thread inserts into it
  }
  KVCM2_PROF(2);
  start_loads(p, A, row);
  bool use_direct;
  if (!load_rows(p, A, row, use_direct)) {  // a hole: left
    if (kWrites) write_hole(p.write_table, p.write_start, p.write_width, row.r);
    return;
  }
  KVCM2_PROF(4);
  if (use_direct)
    resolve_row<true, kWrites>(p, A, row);
  else
    resolve_row<false, kWrites>(p, A, row);
}

}  // namespace

ResolveKernel resolve_kernel_of(bool global_table, bool writes) {
  if (global_table) return writes ? resolve_kernel<true, true> : resolve_kernel<true, false>;
  return writes ? resolve_kernel<false, true> : resolve_kernel<false, false>;
}

}  // namespace torch_kvcm2
