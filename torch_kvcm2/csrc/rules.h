// The rules that host and device code both apply, written once: the BAD sentinel, the layout
// constants of the miss list, counters and lengths tensor, the length rules of REQUIREMENTS §2
// and §7-8 (in-flight start, host-direct end, flush watermark, length advance) and where a
// unit's bytes live. Plain C++ with no ATen, usable by every CPU kernel, every CUDA kernel and
// the parity test's module functions (rules_py.cpp; tests/test_rules.py checks them against
// torch_kvcm2/lengths.py and memory.py).
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define KVCM2_HD __host__ __device__ __forceinline__
#else
#define KVCM2_HD inline
#endif

namespace torch_kvcm2 {

// "no page / no entry". Never scaled, never folded to 0.
constexpr int32_t BAD = -1;

// A miss-list entry is int32[4]: (lease, slot, row, unit ordinal). The row lets fetch look the
// host page up in the page table of each buffer's own pool group (a selection group's buffers may
// live in several sparse pool groups), so one list serves every buffer of every layer of the group.
constexpr int kMissFields = 4;
// flush_watermark: most distinct (tokens_per_unit, max_inflight_tokens) pairs of a config.
constexpr int kMaxWatermarkShapes = 16;
enum MissField { kMissLease = 0, kMissSlot = 1, kMissRow = 2, kMissUnit = 3 };

// A selection group's miss count is int32[4]: [0] the entries of the last resolve (what fetch
// reads); [2:4] the CUDA resolve's reservation word (CTAs done << 32 | entries reserved, one
// 64-bit atomic per CTA), which the launch's last CTA resets to 0, so it is 0 between resolves
// and no memset node precedes each resolve; [1] is padding. Batch allocates it zeroed.
constexpr int kMissCountWords = 4;
constexpr int kMissReservation = 2;  // int32 offset of the 8-byte-aligned reservation word

// Cumulative device counters of a selection group: int64[3].
enum Counter { kHits = 0, kMisses = 1, kInvalid = 2, kNumCounters = 3 };

// Recency classes of OP-RESOLVE step 4: recency becomes untouched, misses, pinned, hits, each
// class keeping its members' previous relative order (a stable partition).
enum SlotClass : uint8_t { kUntouched = 0, kMissed = 1, kPinned = 2, kHit = 3, kNumClasses = 4 };

// Rows of a batch's lengths tensor int32[6, rows] (Batch, memory.py's HISTORY ... ALLOCATED).
enum LengthRow {
  kHistory = 0, kCapacity = 1, kLease = 2, kWritten = 3, kDeclared = 4, kAllocated = 5,
  kLengthRows = 6
};

KVCM2_HD int64_t floor_div(int64_t a, int64_t b) {
  if (b > 0 && (b & (b - 1)) == 0) {  // a power of two (tokens per unit or page, typically):
    // an arithmetic shift floors, where a 64-bit division is a subroutine call on the GPU
#ifdef __CUDA_ARCH__
    return a >> (__ffsll(b) - 1);
#else
    return a >> __builtin_ctzll(static_cast<unsigned long long>(b));
#endif
  }
  const int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

KVCM2_HD int64_t ceil_div(int64_t a, int64_t b) { return -floor_div(-a, b); }

// Most units that can overlap an in-flight range of I tokens (CFG-3's ceil(I/U) + 1).
KVCM2_HD int64_t max_inflight_units(int64_t max_inflight_tokens, int64_t tokens_per_unit) {
  return ceil_div(max_inflight_tokens, tokens_per_unit) + 1;
}

// ---- the length rules ----
// Lengths are device data, so a kernel may read bad ones. Every rule below reads a row's
// history h and capacity c through clamp_lengths: a negative history as 0 and a capacity below
// the history as the history (h = max(h, 0), c = max(c, h)), so no negative unit is ever in
// flight or selectable and no range runs backwards. Valid lengths, 0 <= h <= c, are unchanged.
struct Lengths {
  int64_t history, capacity;
};

KVCM2_HD Lengths clamp_lengths(int64_t h, int64_t c) {
  const int64_t history = h > 0 ? h : 0;
  return {history, c > history ? c : history};
}

// The in-flight start of one shape (U tokens per unit, at most I in-flight tokens):
// s0 = max(h, floor((c - I) / U) * U) of the clamped lengths. [h, s0) is written straight to
// host pages, [s0, c) into cells (torch_kvcm2/lengths.py's inflight_start).
KVCM2_HD int64_t inflight_start(int64_t h, int64_t c, int64_t U, int64_t I) {
  const Lengths l = clamp_lengths(h, c);
  const int64_t s = floor_div(l.capacity - I, U) * U;
  return s > l.history ? s : l.history;
}

// The largest in-flight start over the (U, I) pairs of shapes (the clamped h when there are
// none): every host-direct token of every selection group lies below it.
KVCM2_HD int64_t host_direct_end(int64_t h, int64_t c, const int64_t* shapes, int64_t pairs) {
  int64_t end = clamp_lengths(h, c).history;
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t s = inflight_start(h, c, shapes[2 * i], shapes[2 * i + 1]);
    end = s > end ? s : end;
  }
  return end;
}

// One past the last token a flush to `target` writes back: min(target, c) of the clamped
// capacity `capacity`.
KVCM2_HD int64_t flush_end(int64_t target, int64_t capacity) {
  return target < capacity ? target : capacity;
}

// The pages a windowed life cycle keeps (REQ-3, TIER-3): the first ceil(sinks / P) pages (the
// sink pages) forever, and every page p with (p + 1) * P > h - window; pages between them are
// released. first_live_page is the first page of the window's part (0 without a window);
// torch_kvcm2/lengths.py's sink_pages / first_live_page are the Python side.
KVCM2_HD int64_t sink_pages(int64_t sinks, int64_t P) { return sinks > 0 ? ceil_div(sinks, P) : 0; }

KVCM2_HD int64_t first_live_page(int64_t h, int64_t P, int64_t window) {
  return (window > 0 && h - window > 0) ? floor_div(h - window, P) : 0;
}

// What one row's published lengths make of its units (REQUIREMENTS §2, OP-RESOLVE).
struct RowRange {
  int64_t history;         // h
  int64_t capacity;        // c
  int64_t inflight_start;  // s0: inflight_start(h, c, U, I)
  int64_t tokens_per_unit; // U
  // Units in [sink_units, first_live_unit) sit on pages released by the window (REQ-3); units
  // below sink_units are on the sink pages, kept (TIER-3).
  int64_t sink_units, first_live_unit;
  // In-flight units [first_inflight, end_inflight): floor(s0/U) .. ceil(c/U), empty when s0 = c.
  // Kept as fields: kernels test thousands of units per row against them.
  int64_t first_inflight, end_inflight;

  RowRange() = default;
  // The lengths as clamp_lengths reads them. window 0: full attention (sinks then 0).
  KVCM2_HD RowRange(int64_t h, int64_t c, int64_t U, int64_t P, int64_t I, int64_t window,
                    int64_t sinks)
      : tokens_per_unit(U) {
    const Lengths l = clamp_lengths(h, c);
    history = l.history;
    capacity = l.capacity;
    inflight_start = torch_kvcm2::inflight_start(l.history, l.capacity, U, I);
    // A page p >= the sink pages is released once it lies wholly before h - window:
    // (p + 1) * P <= h - window.
    first_live_unit = first_live_page(history, P, window) * (P / U);
    sink_units = window > 0 ? sink_pages(sinks, P) * (P / U) : 0;
    first_inflight = floor_div(inflight_start, U);
    end_inflight = inflight_start < capacity ? ceil_div(capacity, U) : first_inflight;
  }

  KVCM2_HD bool has_inflight() const { return inflight_start < capacity; }
  KVCM2_HD int64_t first_inflight_unit() const { return first_inflight; }
  // One past the last in-flight unit; equal to first_inflight_unit() when nothing is in flight.
  KVCM2_HD int64_t end_inflight_unit() const { return end_inflight; }
  KVCM2_HD bool inflight(int64_t u) const { return u >= first_inflight && u < end_inflight; }
  // Wholly history, or overlapping the in-flight range, and on a live page.
  KVCM2_HD bool selectable(int64_t u) const {
    if (u < 0 || (u >= sink_units && u < first_live_unit)) return false;
    return (u + 1) * tokens_per_unit <= history || inflight(u);
  }
  // A partly written head unit must be fetched so its history part is present.
  KVCM2_HD bool needs_fetch_on_admit(int64_t u) const { return u * tokens_per_unit < history; }
};

// The slot holding in-flight unit u of a row, or BAD. locate_inflight records it after each
// resolve (slots_row: the row's miu records); the resident row confirms it, so a stale record
// (a resize without a resolve since) yields BAD.
KVCM2_HD int64_t inflight_slot(const RowRange& range, int64_t u, const int32_t* slots_row,
                               int64_t miu, const int32_t* resident_row, int64_t S) {
  const int64_t k = u - range.first_inflight_unit();
  if (k < 0 || k >= miu) return BAD;
  const int64_t slot = slots_row[k];
  return (slot >= 0 && slot < S && resident_row[slot] == u) ? slot : BAD;
}

// HOST-3's length advance of one seated row (Batch.advance): refused, and left unchanged, when
// `accepted` is negative, exceeds the in-flight width c - h, or would move history past the
// flushed watermark `written` (SAFE-2); else history += accepted and capacity = history + width,
// cut at the allocated tokens (the row is then "short"). Returns 0 moved, 1 refused, 2 short.
KVCM2_HD int advance_row(int32_t& h, int32_t& c, int32_t written, int32_t allocated,
                         int32_t accepted) {
  const int64_t width = static_cast<int64_t>(c) - h;
  const int64_t new_h = static_cast<int64_t>(h) + accepted;
  if (accepted < 0 || accepted > width || new_h > written) return 1;
  const int64_t wanted = new_h + width;
  const int64_t new_c = wanted < allocated ? wanted : allocated;
  h = static_cast<int32_t>(new_h);
  c = static_cast<int32_t>(new_c);
  return new_c < wanted ? 2 : 0;
}

// The written watermark after a flush to `target` (lengths h, c, clamped): see flush_watermark
// in ops.cpp.
KVCM2_HD int64_t flushed_watermark(int64_t h, int64_t c, int64_t written, int64_t declared,
                                   int64_t target, const int64_t* shapes, int64_t pairs) {
  const int64_t known = written > declared ? written : declared;
  if (known < host_direct_end(h, c, shapes, pairs)) return written;
  const int64_t reach = flush_end(target, clamp_lengths(h, c).capacity);
  return reach > written ? reach : written;
}

// ---- where a unit's bytes live: the addressing fetch (host page -> cell) and flush (cell -> host
// page) share, on both backends. A buffer's page is `chunks` chunks of P tokens of token_bytes
// each (chunk_bytes = P * token_bytes apart); a unit is U consecutive tokens of every chunk
// (unit_bytes = U * token_bytes per chunk), E = P / U units per page. Both functions return the
// address of the unit's start in chunk 0 plus `offset` bytes (a token's distance into the unit,
// k * chunk_bytes for chunk k, a vector's distance).

// Cell entry `entry` = lease * S + slot is unit entry % E of cell page entry / E of the buffer's
// cells.
template <typename Byte, typename Int>
KVCM2_HD Byte* cell_address(Byte* cells, int64_t entry, Int E, int64_t page_bytes,
                            int64_t unit_bytes, int64_t offset) {
  return cells + (entry / E) * page_bytes + (entry % E) * unit_bytes + offset;
}

// Unit `unit` of a row is unit unit % E of its host page, the page in host slot `host_slot` of
// the buffer's host pages (HostPages::data, checks.h). Unit is int32_t where the unit and E fit (a 32-bit
// remainder on the GPU), else int64_t.
template <typename Byte, typename Unit>
KVCM2_HD Byte* host_address(Byte* host, int64_t host_slot, int64_t slot_stride, Unit unit, Unit E,
                            int64_t unit_bytes, int64_t offset) {
  return host + host_slot * slot_stride + static_cast<int64_t>(unit % E) * unit_bytes + offset;
}

// OP-FETCH's source of miss entry (lease, slot, row, unit) in one buffer: the host slot of the
// unit's page in the page table (int32[table_rows, table_pages] of the buffer's pool group), or -1
// when any field or the page table's entry is out of range (bad device data is skipped, never
// followed). num_entries = cell pages * E; E fits int32 (check_fetch), so the page of a unit is a
// 32-bit division.
KVCM2_HD int64_t fetch_host_slot(int32_t lease, int32_t slot, int32_t row, int32_t unit,
                                 int64_t slots, int64_t num_entries, const int32_t* table,
                                 int64_t table_rows, int64_t table_pages, int32_t E,
                                 int64_t host_slots) {
  const int64_t entry = static_cast<int64_t>(lease) * slots + slot;
  if (lease < 0 || slot < 0 || slot >= slots || entry >= num_entries || row < 0 ||
      row >= table_rows || unit < 0 || unit / E >= table_pages)
    return -1;
  const int64_t h = table[row * table_pages + unit / E];
  return h < host_slots ? h : -1;
}

// OP-FLUSH's destination: the host slot of page `page` of row `row` in a page table
// int32[rows, pages], or -1 when the page lies past the table or its entry is no host slot (BAD,
// or >= host_slots: bad device data).
KVCM2_HD int64_t table_host_slot(const int32_t* table, int64_t row, int64_t pages, int64_t page,
                                 int64_t host_slots) {
  if (page >= pages) return -1;
  const int64_t h = table[row * pages + page];
  return (h >= 0 && h < host_slots) ? h : -1;
}

// RSD-1: the index-space entry of unit u of a row whose history is on GPU pages: with the row's
// GPU page slots per page ordinal `pages_row` (`pages` of them), E units per page, the cells'
// `cell_entries` entries first and `gpu_slots` GPU pages after them, cell_entries + p*E + u mod E
// for the unit's page p; BAD when u is negative or its page has no GPU slot (past the table, a
// negative id or one >= gpu_slots: bad device data reads as "no page", never out of bounds).
KVCM2_HD int64_t gpu_history_entry(const int32_t* pages_row, int64_t pages, int64_t u, int64_t E,
                                   int64_t cell_entries, int64_t gpu_slots) {
  if (u < 0) return BAD;
  const int64_t page = floor_div(u, E);
  if (page >= pages) return BAD;
  const int64_t p = pages_row[page];
  if (p < 0 || p >= gpu_slots) return BAD;
  return cell_entries + p * E + (u - page * E);
}

}  // namespace torch_kvcm2
