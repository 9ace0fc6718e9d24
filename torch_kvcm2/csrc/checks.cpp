// Argument checks shared by the CPU and CUDA wrappers. They read metadata only (dtype, device,
// shape, layout, integer arguments), never tensor values, so they are safe during stream capture.
#include "checks.h"
#include "rules.h"

#include <c10/util/Exception.h>

namespace torch_kvcm2 {
namespace {

void check_int32_2d(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt, op, ": ", name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// A selection or its index table: int32 [rows, K] (one query token) or [rows, T', K] (T' query
// tokens, MTP-2), contiguous, so that row r's T'*K columns are one run in (token, column) order.
void check_int32_selection(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt, op, ": ", name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 || t.dim() == 3, op, ": ", name,
              " must be 2-D [rows, K] or 3-D [rows, query tokens, K], got ", t.dim(), "-D");
  TORCH_CHECK(t.dim() == 2 || t.size(1) >= 1, op, ": ", name,
              " must have at least one query token, got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_int32_1d(const at::Tensor& t, int64_t n, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt, op, ": ", name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, op, ": ", name, " must have shape [", n, "], got ",
              t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op, const char* name) {
  TORCH_CHECK(a.device() == b.device(), op, ": ", name, " is on ", b.device(), " but expected ",
              a.device());
}

// The published per-row tables every per-step op reads: int32[rows], on `like`'s device.
void check_lengths(const at::Tensor& like, int64_t rows, const at::Tensor& history,
                   const at::Tensor& capacity, const at::Tensor& lease, const char* op) {
  check_int32_1d(history, rows, op, "history");
  check_int32_1d(capacity, rows, op, "capacity");
  check_int32_1d(lease, rows, op, "lease");
  for (const at::Tensor* t : {&history, &capacity, &lease}) {
    check_same_device(like, *t, op, "history, capacity and lease");
  }
}

// One buffer's cells, uint8 [n, chunks, P, bytes/chunks] contiguous, and its host pages: pool
// uint8 [num_slots, scale, page_bytes] contiguous within a page, with page_bytes the cells' page
// size (any when that is zero) and 0 <= pos < scale; both on `like`'s device.
void check_cells_and_host(const at::Tensor& cell, const at::Tensor& pool, int64_t pos,
                          const at::Tensor& like, size_t b, const char* op) {
  TORCH_CHECK(cell.scalar_type() == at::kByte && pool.scalar_type() == at::kByte, op,
              ": buffer ", b, ": cells and host pools must be uint8");
  TORCH_CHECK(cell.dim() == 4, op, ": buffer ", b,
              ": cells must be 4-D [n, chunks, tokens_per_page, bytes]");
  TORCH_CHECK(pool.dim() == 3, op, ": buffer ", b,
              ": host pool must be 3-D [num_slots, scale, page_bytes]");
  TORCH_CHECK(cell.is_contiguous(), op, ": buffer ", b, ": cells must be contiguous");
  const int64_t page_bytes = cell.size(1) * cell.size(2) * cell.size(3);
  TORCH_CHECK(pos >= 0 && pos < pool.size(1), op, ": buffer ", b, ": position ", pos,
              " outside the pool's ", pool.size(1), " pages per slot");
  TORCH_CHECK(page_bytes == 0 || (pool.size(2) == page_bytes && pool.stride(2) == 1), op,
              ": buffer ", b, ": cells pages of ", page_bytes, " bytes differ from host pool ",
              pool.sizes(), " (pages must be contiguous)");
  check_same_device(like, cell, op, "cells");
  check_same_device(like, pool, op, "host pools");
}

// The per-row in-flight slot records: int32[rows, ceil(I/U) + 1].
void check_inflight_slots(const at::Tensor& inflight_slots, int64_t rows, int64_t tokens_per_unit,
                          int64_t max_inflight_tokens, const char* op) {
  TORCH_CHECK(tokens_per_unit > 0 && max_inflight_tokens > 0, op,
              ": tokens_per_unit and max_inflight_tokens must be positive");
  check_int32_2d(inflight_slots, op, "inflight_slots");
  const int64_t units = max_inflight_units(max_inflight_tokens, tokens_per_unit);
  TORCH_CHECK(inflight_slots.size(0) == rows && inflight_slots.size(1) == units, op,
              ": inflight_slots must have shape [", rows, ", ", units, "], got ",
              inflight_slots.sizes());
}

// A selection group's row shape: U divides P, I positive, a window non-negative, sinks only
// with a window (resolve and resolve_gpu_history read rows by it).
void check_row_shape(int64_t tokens_per_unit, int64_t tokens_per_page, int64_t max_inflight_tokens,
                     int64_t window, int64_t sinks, const char* op) {
  TORCH_CHECK(tokens_per_unit > 0 && tokens_per_page > 0 && tokens_per_page % tokens_per_unit == 0,
              op, ": tokens_per_unit must be positive and divide tokens_per_page");
  TORCH_CHECK(max_inflight_tokens > 0 && window >= 0, op,
              ": max_inflight_tokens must be positive and window non-negative (0 = none)");
  TORCH_CHECK(sinks >= 0 && (sinks == 0 || window > 0), op,
              ": sinks must be non-negative, and 0 without a window (window 0)");
}

}  // namespace

void check_convert_page_indices(const at::Tensor& out, const at::Tensor& page_table,
                                const at::Tensor& capacity, int64_t scale, int64_t pos,
                                int64_t units_per_page, int64_t tokens_per_unit) {
  const char* op = "convert_page_indices";
  check_int32_2d(out, op, "out");
  check_int32_2d(page_table, op, "page_table");
  check_int32_1d(capacity, page_table.size(0), op, "capacity");
  check_same_device(out, page_table, op, "page_table");
  check_same_device(out, capacity, op, "capacity");
  TORCH_CHECK(scale > 0 && pos >= 0 && pos < scale, op, ": need 0 <= pos < scale, got pos=", pos,
              " scale=", scale);
  TORCH_CHECK(units_per_page > 0 && tokens_per_unit > 0, op,
              ": units_per_page and tokens_per_unit must be positive");
  TORCH_CHECK(out.size(0) == page_table.size(0), op, ": out has ", out.size(0),
              " rows but page_table has ", page_table.size(0));
  TORCH_CHECK(out.size(1) >= page_table.size(1) * units_per_page, op, ": out is too narrow: ",
              out.size(1), " columns for ", page_table.size(1), " pages of ", units_per_page,
              " units");
}

void check_convert_token_indices(const at::Tensor& out, const at::Tensor& selected,
                                 const at::Tensor& page_table, const at::Tensor& capacity,
                                 int64_t scale, int64_t pos, int64_t tokens_per_page) {
  const char* op = "convert_token_indices";
  check_int32_2d(out, op, "out");
  check_int32_2d(selected, op, "selected");
  check_int32_2d(page_table, op, "page_table");
  check_int32_1d(capacity, page_table.size(0), op, "capacity");
  check_same_device(out, selected, op, "selected");
  check_same_device(out, page_table, op, "page_table");
  check_same_device(out, capacity, op, "capacity");
  TORCH_CHECK(scale > 0 && pos >= 0 && pos < scale, op, ": need 0 <= pos < scale, got pos=", pos,
              " scale=", scale);
  TORCH_CHECK(tokens_per_page > 0, op, ": tokens_per_page must be positive");
  TORCH_CHECK(out.sizes() == selected.sizes(), op, ": out has shape ", out.sizes(),
              " but selected has ", selected.sizes());
  TORCH_CHECK(selected.size(0) <= page_table.size(0), op, ": selected has ", selected.size(0),
              " rows but page_table only ", page_table.size(0));
}

void check_resolve(const at::Tensor& resident, const at::Tensor& recency,
                   const at::Tensor& index_table, const at::Tensor& miss_list,
                   const at::Tensor& miss_count, const at::Tensor& counters,
                   const at::Tensor& inflight_slots, const at::Tensor& selected,
                   const at::Tensor& history, const at::Tensor& capacity, const at::Tensor& lease,
                   int64_t tokens_per_unit, int64_t tokens_per_page, int64_t max_inflight_tokens,
                   int64_t window, int64_t sinks) {
  const char* op = "resolve";
  check_int32_2d(resident, op, "resident");
  check_int32_2d(recency, op, "recency");
  check_int32_selection(index_table, op, "index_table");
  check_int32_2d(miss_list, op, "miss_list");
  check_int32_selection(selected, op, "selected");
  const int64_t rows = selected.size(0);
  check_int32_1d(miss_count, kMissCountWords, op, "miss_count");
  check_lengths(resident, rows, history, capacity, lease, op);
  TORCH_CHECK(counters.scalar_type() == at::kLong && counters.dim() == 1 &&
                  counters.size(0) == kNumCounters && counters.is_contiguous(),
              op, ": counters must be a contiguous int64 tensor of shape [", kNumCounters, "]");
  for (const at::Tensor* t : {&recency, &index_table, &miss_list, &miss_count, &counters,
                              &inflight_slots, &selected}) {
    check_same_device(resident, *t, op, "every tensor");
  }
  check_inflight_slots(inflight_slots, rows, tokens_per_unit, max_inflight_tokens, op);
  TORCH_CHECK(recency.sizes() == resident.sizes(), op, ": recency has shape ", recency.sizes(),
              " but resident has ", resident.sizes());
  TORCH_CHECK(index_table.sizes() == selected.sizes(), op, ": index_table has shape ",
              index_table.sizes(), " but selected has ", selected.sizes());
  check_row_shape(tokens_per_unit, tokens_per_page, max_inflight_tokens, window, sinks, op);
  const int64_t slots = resident.size(1);
  const int64_t units_per_page = tokens_per_page / tokens_per_unit;
  TORCH_CHECK(slots > 0 && slots % units_per_page == 0, op, ": slots (", slots,
              ") must be a positive multiple of units per page (", units_per_page, ")");
  TORCH_CHECK(slots <= 65535, op, ": at most 65535 slots per lease, got ", slots);
  // A row's columns over all its query tokens: the union is resolved as one selection (MTP-3).
  const int64_t width = selected.dim() == 3 ? selected.size(1) * selected.size(2) : selected.size(1);
  TORCH_CHECK(width <= 65535, op, ": at most 65535 selected columns per row (query tokens x K), "
              "got ", width);
  const int64_t per_row = width + max_inflight_units(max_inflight_tokens, tokens_per_unit);
  TORCH_CHECK(miss_list.size(1) == kMissFields && miss_list.size(0) >= rows * per_row, op,
              ": miss_list must have shape [>= ", rows * per_row, ", ", kMissFields, "], got ",
              miss_list.sizes());
  TORCH_CHECK(resident.size(0) * slots <= INT32_MAX, op, ": too many entries for int32");
}

void check_fetch(const at::TensorList& cells, const at::TensorList& host_pools,
                 at::IntArrayRef positions, const at::TensorList& page_tables,
                 const at::Tensor& miss_list, const at::Tensor& miss_count, int64_t slots,
                 int64_t tokens_per_unit) {
  const char* op = "fetch";
  check_int32_2d(miss_list, op, "miss_list");
  TORCH_CHECK(miss_list.size(1) == kMissFields, op, ": miss_list must have ", kMissFields,
              " columns, got ", miss_list.size(1));
  check_int32_1d(miss_count, kMissCountWords, op, "miss_count");
  check_same_device(miss_list, miss_count, op, "miss_count");
  TORCH_CHECK(cells.size() == host_pools.size() && cells.size() == positions.size() &&
                  cells.size() == page_tables.size(),
              op, ": cells, host_pools, positions and page_tables must have one entry per buffer, "
              "got ", cells.size(), ", ", host_pools.size(), ", ", positions.size(), ", ",
              page_tables.size());
  TORCH_CHECK(slots > 0 && tokens_per_unit > 0, op, ": slots and tokens_per_unit must be positive");
  for (size_t b = 0; b < cells.size(); ++b) {
    const at::Tensor& cell = cells[b];
    check_cells_and_host(cell, host_pools[b], positions[b], miss_list, b, op);
    check_same_device(miss_list, page_tables[b], op, "page_tables");
    check_int32_2d(page_tables[b], op, "page_tables[b]");
    const int64_t tokens_per_page = cell.size(2);
    TORCH_CHECK(tokens_per_page % tokens_per_unit == 0, op, ": buffer ", b,
                ": tokens_per_unit must divide tokens_per_page");
    TORCH_CHECK(slots % (tokens_per_page / tokens_per_unit) == 0, op,
                ": slots must be a multiple of units per page");
    TORCH_CHECK(tokens_per_page / tokens_per_unit <= INT32_MAX, op, ": buffer ", b,
                ": too many units per page");
  }
}

void check_flush_watermark(const at::Tensor& written, const at::Tensor& declared,
                           const at::Tensor& new_history, const at::Tensor& history,
                           const at::Tensor& capacity, const at::Tensor& lease,
                           at::IntArrayRef shapes) {
  const char* op = "flush_watermark";
  TORCH_CHECK(written.dim() == 1, op, ": written must be int32[rows], got ", written.sizes());
  const int64_t rows = written.size(0);
  check_int32_1d(written, rows, op, "written");
  check_int32_1d(declared, rows, op, "declared");
  check_int32_1d(new_history, rows, op, "new_history");
  check_same_device(written, declared, op, "declared");
  check_same_device(written, new_history, op, "new_history");
  check_lengths(written, rows, history, capacity, lease, op);
  TORCH_CHECK(shapes.size() % 2 == 0 && shapes.size() <= 2 * kMaxWatermarkShapes, op,
              ": shapes must be (tokens_per_unit, max_inflight_tokens) pairs, at most ",
              kMaxWatermarkShapes, ", got ", shapes.size(), " ints");
  for (size_t i = 0; i < shapes.size(); i += 2) {
    TORCH_CHECK(shapes[i] > 0 && shapes[i + 1] >= 0 && shapes[i] <= INT32_MAX &&
                    shapes[i + 1] <= INT32_MAX,
                op, ": shape ", i / 2, " needs tokens_per_unit > 0 and max_inflight_tokens >= 0, "
                "got (", shapes[i], ", ", shapes[i + 1], ")");
  }
}

void check_advance(const at::Tensor& lengths, const at::Tensor& counters,
                   const at::Tensor& accepted) {
  const char* op = "advance";
  TORCH_CHECK(lengths.scalar_type() == at::kInt && lengths.dim() == 2 &&
                  lengths.size(0) == kLengthRows && lengths.is_contiguous(),
              op, ": lengths must be contiguous int32[", static_cast<int>(kLengthRows),
              ", rows], got ", lengths.scalar_type(), " ", lengths.sizes());
  check_int32_1d(accepted, lengths.size(1), op, "accepted");
  TORCH_CHECK(counters.scalar_type() == at::kLong && counters.dim() == 1 &&
                  counters.size(0) == 2 && counters.is_contiguous(),
              op, ": counters must be contiguous int64[2], got ", counters.scalar_type(), " ",
              counters.sizes());
  check_same_device(lengths, accepted, op, "accepted");
  check_same_device(lengths, counters, op, "counters");
}

void check_clear_leases(const at::TensorList& resident, const at::TensorList& recency,
                        const at::Tensor& leases) {
  const char* op = "clear_leases";
  TORCH_CHECK(resident.size() == recency.size(), op,
              ": resident and recency need one tensor per selection group, got ", resident.size(),
              " and ", recency.size());
  TORCH_CHECK(leases.scalar_type() == at::kLong && leases.dim() == 1 && leases.is_contiguous(),
              op, ": leases must be contiguous int64[n], got ", leases.scalar_type(), " ",
              leases.sizes());
  for (size_t g = 0; g < resident.size(); ++g) {
    check_int32_2d(resident[g], op, "resident[g]");
    check_int32_2d(recency[g], op, "recency[g]");
    TORCH_CHECK(resident[g].sizes() == recency[g].sizes(), op, ": group ", g,
                ": resident and recency differ in shape: ", resident[g].sizes(), " and ",
                recency[g].sizes());
    check_same_device(leases, resident[g], op, "resident");
    check_same_device(leases, recency[g], op, "recency");
  }
}

void check_locate_inflight(const at::Tensor& inflight_slots, const at::Tensor& resident,
                           const at::Tensor& history, const at::Tensor& capacity,
                           const at::Tensor& lease, int64_t tokens_per_unit,
                           int64_t max_inflight_tokens) {
  const char* op = "locate_inflight";
  check_int32_2d(inflight_slots, op, "inflight_slots");
  check_int32_2d(resident, op, "resident");
  const int64_t rows = inflight_slots.size(0);
  check_lengths(inflight_slots, rows, history, capacity, lease, op);
  check_same_device(inflight_slots, resident, op, "resident");
  check_inflight_slots(inflight_slots, rows, tokens_per_unit, max_inflight_tokens, op);
}

void check_write_indices(const at::Tensor& out, const at::Tensor& inflight_start,
                         const at::Tensor& resident, const at::Tensor& inflight_slots,
                         const at::Tensor& history, const at::Tensor& capacity,
                         const at::Tensor& lease, int64_t tokens_per_unit,
                         int64_t max_inflight_tokens, const char* op, const char* out_name,
                         const char* start_name) {
  check_int32_2d(out, op, out_name);
  check_int32_2d(resident, op, "resident");
  const int64_t rows = out.size(0);
  check_int32_1d(inflight_start, rows, op, start_name);
  check_lengths(out, rows, history, capacity, lease, op);
  for (const at::Tensor* t : {&inflight_start, &resident, &inflight_slots}) {
    check_same_device(out, *t, op, "every tensor");
  }
  check_inflight_slots(inflight_slots, rows, tokens_per_unit, max_inflight_tokens, op);
  TORCH_CHECK(out.size(1) >= max_inflight_tokens + tokens_per_unit - 1, op, ": ", out_name,
              " is too narrow: ",
              out.size(1), " columns, an in-flight range can hold ",
              max_inflight_tokens + tokens_per_unit - 1, " tokens");
}

void check_flush(const at::Tensor& host_pool, at::IntArrayRef positions,
                 const at::TensorList& cells, const at::TensorList& resident,
                 const at::TensorList& inflight_slots, const at::Tensor& page_table,
                 const at::Tensor& new_history, const at::Tensor& history,
                 const at::Tensor& capacity, const at::Tensor& lease, at::IntArrayRef unit_params) {
  const char* op = "flush";
  check_int32_2d(page_table, op, "page_table");
  const int64_t rows = page_table.size(0);
  check_int32_1d(new_history, rows, op, "new_history");
  check_same_device(page_table, new_history, op, "new_history");
  check_lengths(page_table, rows, history, capacity, lease, op);
  check_same_device(page_table, host_pool, op, "host_pool");
  const size_t n = cells.size();
  TORCH_CHECK(positions.size() == n && resident.size() == n && inflight_slots.size() == n &&
                  unit_params.size() == 3 * n,
              op, ": positions, cells, resident, inflight_slots need one entry per buffer and "
              "unit_params three ints per buffer");
  for (size_t b = 0; b < n; ++b) {
    const at::Tensor& cell = cells[b];
    check_cells_and_host(cell, host_pool, positions[b], page_table, b, op);
    check_int32_2d(resident[b], op, "resident[b]");
    check_same_device(page_table, resident[b], op, "resident");
    check_same_device(page_table, inflight_slots[b], op, "inflight_slots");
    const int64_t slots = unit_params[3 * b], unit = unit_params[3 * b + 1],
                  inflight = unit_params[3 * b + 2];
    TORCH_CHECK(slots == resident[b].size(1) && unit > 0 && inflight > 0 &&
                    cell.size(2) % unit == 0 && slots % (cell.size(2) / unit) == 0,
                op, ": buffer ", b, ": bad unit_params (slots ", slots, ", tokens_per_unit ", unit,
                ", max_inflight_tokens ", inflight, ")");
    TORCH_CHECK(cell.size(2) / unit <= INT32_MAX, op, ": buffer ", b, ": too many units per page");
    check_inflight_slots(inflight_slots[b], rows, unit, inflight, op);
    TORCH_CHECK(cell.size(0) * (cell.size(2) / unit) >= resident[b].size(0) * slots, op,
                ": buffer ", b, ": fewer cells than leases x slots");
  }
}

bool check_resolve_write(const std::optional<at::Tensor>& write_table,
                         const std::optional<at::Tensor>& write_start, const at::Tensor& selected,
                         const at::Tensor& resident, const at::Tensor& inflight_slots,
                         const at::Tensor& history, const at::Tensor& capacity,
                         const at::Tensor& lease, int64_t tokens_per_unit,
                         int64_t max_inflight_tokens) {
  const bool table = write_table.has_value() && write_table->defined();
  const bool start = write_start.has_value() && write_start->defined();
  TORCH_CHECK(table == start, "resolve: pass both write_table and write_start, or neither");
  if (!table) return false;
  TORCH_CHECK(write_table->dim() >= 1 && write_table->size(0) == selected.size(0),
              "resolve: write_table must have one row per selected row (", selected.size(0),
              "), got shape ", write_table->sizes());
  check_write_indices(*write_table, *write_start, resident, inflight_slots, history, capacity,
                      lease, tokens_per_unit, max_inflight_tokens, "resolve", "write_table",
                      "write_start");
  return true;
}

int64_t check_resolve_gpu_history(const at::Tensor& index_table, const at::Tensor& write_table,
                                  const at::Tensor& write_start, const at::Tensor& counters,
                                  const at::Tensor& selected, const at::Tensor& gpu_rows,
                                  const at::Tensor& gpu_pages, const at::Tensor& history,
                                  const at::Tensor& capacity, const at::Tensor& lease,
                                  int64_t cell_entries, int64_t gpu_slots,
                                  int64_t tokens_per_unit, int64_t tokens_per_page,
                                  int64_t max_inflight_tokens, int64_t window, int64_t sinks) {
  const char* op = "resolve_gpu_history";
  check_int32_selection(index_table, op, "index_table");
  check_int32_selection(selected, op, "selected");
  TORCH_CHECK(index_table.sizes() == selected.sizes(), op, ": index_table has shape ",
              index_table.sizes(), " but selected has ", selected.sizes());
  const int64_t rows = selected.size(0);
  check_int32_2d(write_table, op, "write_table");
  check_int32_1d(write_start, rows, op, "write_start");
  check_int32_1d(gpu_rows, rows, op, "gpu_rows");
  check_int32_2d(gpu_pages, op, "gpu_pages");
  TORCH_CHECK(write_table.size(0) == rows && gpu_pages.size(0) == rows, op,
              ": write_table and gpu_pages need one row per selected row (", rows, "), got ",
              write_table.sizes(), " and ", gpu_pages.sizes());
  check_lengths(selected, rows, history, capacity, lease, op);
  TORCH_CHECK(counters.scalar_type() == at::kLong && counters.dim() == 1 &&
                  counters.size(0) == kNumCounters && counters.is_contiguous(),
              op, ": counters must be a contiguous int64 tensor of shape [", kNumCounters, "]");
  for (const at::Tensor* t : {&index_table, &write_table, &write_start, &counters, &gpu_rows,
                              &gpu_pages}) {
    check_same_device(selected, *t, op, "every tensor");
  }
  check_row_shape(tokens_per_unit, tokens_per_page, max_inflight_tokens, window, sinks, op);
  TORCH_CHECK(write_table.size(1) >= max_inflight_tokens + tokens_per_unit - 1, op,
              ": write_table is too narrow: ", write_table.size(1),
              " columns, an in-flight range can hold ", max_inflight_tokens + tokens_per_unit - 1,
              " tokens");
  const int64_t E = tokens_per_page / tokens_per_unit;
  TORCH_CHECK(cell_entries >= 0 && gpu_slots >= 0, op,
              ": cell_entries and gpu_slots must be non-negative");
  const int64_t entries = cell_entries + gpu_slots * E;
  // a token index (entry * U + offset) is int32, as every index the attention kernel reads
  TORCH_CHECK(entries * tokens_per_unit <= INT32_MAX, op, ": ", entries,
              " entries of ", tokens_per_unit, " tokens exceed the int32 token indices");
  const int64_t width = selected.dim() == 3 ? selected.size(1) * selected.size(2) : selected.size(1);
  TORCH_CHECK(width <= 65535, op, ": at most 65535 selected columns per row (query tokens x K), "
              "got ", width);
  return entries;
}

void check_flush_gpu_history(const at::Tensor& host_pool, at::IntArrayRef positions,
                             const at::TensorList& spaces, const at::Tensor& gpu_rows,
                             const at::Tensor& gpu_pages, const at::Tensor& page_table,
                             const at::Tensor& new_history, const at::Tensor& history,
                             const at::Tensor& capacity, const at::Tensor& lease,
                             at::IntArrayRef unit_params) {
  const char* op = "flush_gpu_history";
  check_int32_2d(page_table, op, "page_table");
  const int64_t rows = page_table.size(0);
  check_int32_1d(new_history, rows, op, "new_history");
  check_int32_1d(gpu_rows, rows, op, "gpu_rows");
  check_int32_2d(gpu_pages, op, "gpu_pages");
  TORCH_CHECK(gpu_pages.size(0) == rows, op, ": gpu_pages needs one row per page_table row (",
              rows, "), got ", gpu_pages.sizes());
  check_lengths(page_table, rows, history, capacity, lease, op);
  for (const at::Tensor* t : {&new_history, &gpu_rows, &gpu_pages, &host_pool}) {
    check_same_device(page_table, *t, op, "every tensor");
  }
  const size_t n = spaces.size();
  TORCH_CHECK(positions.size() == n && unit_params.size() == 3 * n, op,
              ": positions and spaces need one entry per buffer and unit_params three ints per "
              "buffer");
  for (size_t b = 0; b < n; ++b) {
    const at::Tensor& space = spaces[b];
    check_cells_and_host(space, host_pool, positions[b], page_table, b, op);
    const int64_t cell_pages = unit_params[3 * b], unit = unit_params[3 * b + 1],
                  inflight = unit_params[3 * b + 2];
    TORCH_CHECK(cell_pages >= 0 && cell_pages <= space.size(0) && unit > 0 && inflight > 0 &&
                    space.size(2) % unit == 0,
                op, ": buffer ", b, ": bad unit_params (cell_pages ", cell_pages,
                ", tokens_per_unit ", unit, ", max_inflight_tokens ", inflight, ") for ",
                space.size(0), " pages of ", space.size(2), " tokens");
  }
}

}  // namespace torch_kvcm2
