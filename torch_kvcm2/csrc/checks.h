// The argument checks every backend's wrapper runs before touching memory (metadata only, never
// values: checks.cpp), shared by the CPU and CUDA wrappers, and the ATen-using helpers of the
// host wrappers. The rules themselves are in rules.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace torch_kvcm2 {

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
                   int64_t tokens_per_page, int64_t max_inflight_tokens, int64_t window,
                   int64_t sinks);

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

// resolve_gpu_history (RSD-1): the resolve outputs of one selection group and the rows' GPU
// history pages. Returns the entries of the index space: cell_entries + gpu_slots * E.
int64_t check_resolve_gpu_history(const at::Tensor& index_table, const at::Tensor& write_table,
                                  const at::Tensor& write_start, const at::Tensor& counters,
                                  const at::Tensor& selected, const at::Tensor& gpu_rows,
                                  const at::Tensor& gpu_pages, const at::Tensor& history,
                                  const at::Tensor& capacity, const at::Tensor& lease,
                                  int64_t cell_entries, int64_t gpu_slots,
                                  int64_t tokens_per_unit, int64_t tokens_per_page,
                                  int64_t max_inflight_tokens, int64_t window, int64_t sinks);

// flush_gpu_history (RSD-1): unit_params three ints per buffer (cell_pages, tokens_per_unit,
// max_inflight_tokens); spaces[b] has at least cell_pages pages.
void check_flush_gpu_history(const at::Tensor& host_pool, at::IntArrayRef positions,
                             const at::TensorList& spaces, const at::Tensor& gpu_rows,
                             const at::Tensor& gpu_pages, const at::Tensor& page_table,
                             const at::Tensor& new_history, const at::Tensor& history,
                             const at::Tensor& capacity, const at::Tensor& lease,
                             at::IntArrayRef unit_params);

}  // namespace torch_kvcm2
