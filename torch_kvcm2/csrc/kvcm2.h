// Shared definitions of torch_kvcm2's native code: the BAD sentinel, the residency rules of
// REQUIREMENTS §7-8 as host/device inline functions (so the CPU and CUDA kernels cannot drift apart),
// and the argument checks every backend's wrapper runs before touching memory.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

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

// What one row's published lengths make of its units (REQUIREMENTS §2, OP-RESOLVE).
struct RowRange {
  int64_t history;         // h
  int64_t capacity;        // c
  int64_t inflight_start;  // s0 = max(h, floor((c - I) / U) * U)
  int64_t tokens_per_unit; // U
  int64_t first_live_unit; // units below it sit on pages released by the window (REQ-3)
  // In-flight units [first_inflight, end_inflight): floor(s0/U) .. ceil(c/U), empty when s0 = c.
  // Kept as fields: kernels test thousands of units per row against them.
  int64_t first_inflight, end_inflight;

  RowRange() = default;
  // Lengths are device data: a negative history or a capacity below it (bad data) is read as
  // h = max(h, 0), c = max(c, h), so no negative unit is ever in flight or selectable.
  KVCM2_HD RowRange(int64_t h, int64_t c, int64_t U, int64_t P, int64_t I, int64_t window)
      : history(h > 0 ? h : 0), tokens_per_unit(U) {
    h = history;
    capacity = c > h ? c : h;
    c = capacity;
    const int64_t s = floor_div(c - I, U) * U;
    inflight_start = s > h ? s : h;
    // A page p is released once it lies wholly before h - window: (p + 1) * P <= h - window.
    first_live_unit = (window > 0 && h - window > 0) ? floor_div(h - window, P) * (P / U) : 0;
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
    if (u < 0 || u < first_live_unit) return false;
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
// the buffer's host pages (HostPages::data). Unit is int32_t where the unit and E fit (a 32-bit
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

// A sparse buffer's host pages inside its pool group's memory. Ops take the group's whole pool,
// uint8 [num_slots, scale, page_bytes] (its device-mapped view on CUDA), and the buffer's
// position in a slot, never a per-buffer view: views of one pool passed side by side alias, and
// torch.compile would route their mutation through a synthetic base (which cudagraph trees then
// refuse as a mutated input). Slot s's page of the buffer starts at data + s * slot_stride.
struct HostPages {
  uint8_t* data;
  int64_t slot_stride;
  int64_t slots;
};

inline HostPages host_pages_of(const at::Tensor& pool, int64_t pos) {
  return {static_cast<uint8_t*>(pool.data_ptr()) + pos * pool.stride(1), pool.stride(0),
          pool.size(0)};
}

// ---- argument checks, shared by the CPU and CUDA wrappers (metadata only, never values) ----

void check_convert_page_indices(const at::Tensor& out, const at::Tensor& page_table,
                                const at::Tensor& capacity, int64_t scale, int64_t pos,
                                int64_t units_per_page, int64_t tokens_per_unit);

void check_convert_token_indices(const at::Tensor& out, const at::Tensor& selected,
                                 const at::Tensor& page_table, const at::Tensor& capacity,
                                 int64_t scale, int64_t pos, int64_t tokens_per_page);

void check_resolve(const at::Tensor& resident, const at::Tensor& recency,
                   const at::Tensor& index_table, const at::Tensor& miss_list,
                   const at::Tensor& miss_count, const at::Tensor& counters,
                   const at::Tensor& inflight_slots, const at::Tensor& selected, const at::Tensor& history,
                   const at::Tensor& capacity, const at::Tensor& lease, int64_t tokens_per_unit,
                   int64_t tokens_per_page, int64_t max_inflight_tokens, int64_t window);

// cells[b]: [num_cells, chunks, P, bytes_per_token / chunks] uint8, contiguous.
// host_pools[b], positions[b]: the buffer's pool group and position in a slot (HostPages),
//   host_pools[b] uint8 [num_slots, scale, chunks * P * bytes_per_token / chunks].
// page_tables[b]: int32 [rows, max_pages_per_row] of the buffer's pool group.
void check_fetch(const at::TensorList& cells, const at::TensorList& host_pools,
                 at::IntArrayRef positions, const at::TensorList& page_tables,
                 const at::Tensor& miss_list, const at::Tensor& miss_count, int64_t slots,
                 int64_t tokens_per_unit);

// A flush covers one pool group, host_pool (mutated). Per buffer: its position in a slot, the
// resident table of its selection group (int32[num_leases, S]), its cells, and
// (slots, tokens_per_unit, max_inflight_tokens) in unit_params[3*b .. 3*b+2].
void check_flush(const at::Tensor& host_pool, at::IntArrayRef positions,
                 const at::TensorList& cells, const at::TensorList& resident, const at::TensorList& inflight_slots,
                 const at::Tensor& page_table, const at::Tensor& new_history,
                 const at::Tensor& history, const at::Tensor& capacity, const at::Tensor& lease,
                 at::IntArrayRef unit_params);

// The flush watermark's per-row tensors, int32[rows] on one device; shapes = (U, I) pairs.
void check_flush_watermark(const at::Tensor& written, const at::Tensor& declared,
                           const at::Tensor& new_history, const at::Tensor& history,
                           const at::Tensor& capacity, const at::Tensor& lease,
                           at::IntArrayRef shapes);

// The in-flight start s0 = max(h, floor((c - I) / U) * U), maximised over the (U, I) pairs of
// shapes (h when there are none): every host-direct token lies below it.
KVCM2_HD int64_t host_direct_end(int64_t h, int64_t c, const int64_t* shapes, int64_t pairs) {
  int64_t end = h;
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t s = floor_div(c - shapes[2 * i + 1], shapes[2 * i]) * shapes[2 * i];
    end = s > end ? s : end;
  }
  return end;
}

// Rows of a batch's lengths tensor int32[6, rows] (Batch, memory.py's HISTORY ... ALLOCATED).
enum LengthRow {
  kHistory = 0, kCapacity = 1, kLease = 2, kWritten = 3, kDeclared = 4, kAllocated = 5,
  kLengthRows = 6
};

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

// The written watermark after a flush to `target` (lengths h, c): see flush_watermark in ops.cpp.
KVCM2_HD int64_t flushed_watermark(int64_t h, int64_t c, int64_t written, int64_t declared,
                                   int64_t target, const int64_t* shapes, int64_t pairs) {
  const int64_t known = written > declared ? written : declared;
  if (known < host_direct_end(h, c, shapes, pairs)) return written;
  const int64_t reach = target < c ? target : c;
  return reach > written ? reach : written;
}

void check_advance(const at::Tensor& lengths, const at::Tensor& counters,
                   const at::Tensor& accepted);

void check_clear_leases(const at::TensorList& resident, const at::TensorList& recency,
                        const at::Tensor& leases);

void check_locate_inflight(const at::Tensor& inflight_slots, const at::Tensor& resident,
                           const at::Tensor& history, const at::Tensor& capacity,
                           const at::Tensor& lease, int64_t tokens_per_unit,
                           int64_t max_inflight_tokens);

// op, out_name, start_name: how errors name the op and its two outputs (resolve's write
// outputs are checked by the same rules).
void check_write_indices(const at::Tensor& out, const at::Tensor& inflight_start,
                         const at::Tensor& resident, const at::Tensor& inflight_slots,
                         const at::Tensor& history, const at::Tensor& capacity,
                         const at::Tensor& lease, int64_t tokens_per_unit,
                         int64_t max_inflight_tokens, const char* op = "write_indices",
                         const char* out_name = "out", const char* start_name = "inflight_start");

// resolve's optional write outputs (OP-WRITE in the same call): both or neither; when given,
// write_indices' rules for them and one row per selected row. True when given.
bool check_resolve_write(const std::optional<at::Tensor>& write_table,
                         const std::optional<at::Tensor>& write_start, const at::Tensor& selected,
                         const at::Tensor& resident, const at::Tensor& inflight_slots,
                         const at::Tensor& history, const at::Tensor& capacity,
                         const at::Tensor& lease, int64_t tokens_per_unit,
                         int64_t max_inflight_tokens);


}  // namespace torch_kvcm2
