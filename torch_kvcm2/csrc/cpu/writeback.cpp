// CPU kernels of OP-WRITE and OP-FLUSH: where new tokens go in the cells, and their write-back
// to host pages once they become history. Both read residency only.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "../kvcm2.h"
#include "inflight.h"

namespace torch_kvcm2 {
namespace {

void locate_inflight_cpu(const at::Tensor& inflight_slots, const at::Tensor& resident,
                         const at::Tensor& history, const at::Tensor& capacity,
                         const at::Tensor& lease, int64_t tokens_per_unit,
                         int64_t max_inflight_tokens) {
  check_locate_inflight(inflight_slots, resident, history, capacity, lease, tokens_per_unit,
                        max_inflight_tokens);
  const int64_t rows = inflight_slots.size(0), miu = inflight_slots.size(1);
  const int64_t leases = resident.size(0), S = resident.size(1);
  int32_t* out = inflight_slots.data_ptr<int32_t>();
  const int32_t* res = resident.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    int32_t* row_out = out + r * miu;
    std::fill(row_out, row_out + miu, BAD);
    const int64_t l = lease.data_ptr<int32_t>()[r];
    if (l < 0 || l >= leases) continue;
    const RowRange range(history.data_ptr<int32_t>()[r], capacity.data_ptr<int32_t>()[r],
                         tokens_per_unit, tokens_per_unit, max_inflight_tokens, 0);
    record_inflight(res + l * S, S, range, row_out, miu);
  }
}

void write_indices_cpu(const at::Tensor& out, const at::Tensor& inflight_start,
                       const at::Tensor& resident, const at::Tensor& inflight_slots,
                       const at::Tensor& history, const at::Tensor& capacity,
                       const at::Tensor& lease, int64_t tokens_per_unit,
                       int64_t max_inflight_tokens) {
  check_write_indices(out, inflight_start, resident, inflight_slots, history, capacity, lease,
                      tokens_per_unit, max_inflight_tokens);
  const int64_t rows = out.size(0), width = out.size(1);
  const int64_t leases = resident.size(0), S = resident.size(1), miu = inflight_slots.size(1);
  const int32_t* hist = history.data_ptr<int32_t>();
  const int32_t* cap = capacity.data_ptr<int32_t>();
  const int32_t* own = lease.data_ptr<int32_t>();
  int32_t* dst = out.data_ptr<int32_t>();
  int32_t* start = inflight_start.data_ptr<int32_t>();
  const int64_t U = tokens_per_unit;
  for (int64_t r = 0; r < rows; ++r) {
    int32_t* row_out = dst + r * width;
    std::fill(row_out, row_out + width, BAD);
    const int64_t l = own[r];
    if (l < 0 || l >= leases) {
      start[r] = BAD;
      continue;
    }
    // tokens_per_page does not enter the in-flight range: pass U so first_live_unit stays 0.
    const RowRange range(hist[r], cap[r], U, U, max_inflight_tokens, 0);
    start[r] = static_cast<int32_t>(range.inflight_start);
    for (int64_t j = 0; j < width && range.inflight_start + j < range.capacity; ++j) {
      const int64_t t = range.inflight_start + j;
      const int64_t slot = inflight_slot(range, t / U, inflight_slots.data_ptr<int32_t>() + r * miu,
                                         miu, resident.data_ptr<int32_t>() + l * S, S);
      if (slot != BAD) row_out[j] = static_cast<int32_t>((l * S + slot) * U + t % U);
    }
  }
}

void flush_cpu(const at::Tensor& host_pool, at::IntArrayRef positions, const at::TensorList& cells,
               const at::TensorList& resident, const at::TensorList& inflight_slots,
               const at::Tensor& page_table, const at::Tensor& new_history,
               const at::Tensor& history, const at::Tensor& capacity, const at::Tensor& lease,
               at::IntArrayRef unit_params) {
  check_flush(host_pool, positions, cells, resident, inflight_slots, page_table, new_history,
              history, capacity, lease, unit_params);
  const int64_t rows = page_table.size(0), pages = page_table.size(1);
  const int32_t* table = page_table.data_ptr<int32_t>();
  const int32_t* target = new_history.data_ptr<int32_t>();
  const int32_t* hist = history.data_ptr<int32_t>();
  const int32_t* cap = capacity.data_ptr<int32_t>();
  const int32_t* own = lease.data_ptr<int32_t>();
  for (size_t b = 0; b < cells.size(); ++b) {
    const at::Tensor& cell = cells[b];
    const HostPages host = host_pages_of(host_pool, positions[b]);
    const int64_t S = unit_params[3 * b], U = unit_params[3 * b + 1], I = unit_params[3 * b + 2];
    const int64_t chunks = cell.size(1), P = cell.size(2), token_bytes = cell.size(3);
    const int64_t chunk_bytes = P * token_bytes, page_bytes = chunks * chunk_bytes;
    if (page_bytes == 0) continue;
    const int64_t E = P / U, leases = resident[b].size(0), miu = inflight_slots[b].size(1);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t l = own[r];
      if (l < 0 || l >= leases) continue;
      const RowRange range(hist[r], cap[r], U, P, I, 0);
      const int64_t lo = range.inflight_start;
      const int64_t hi = std::min<int64_t>(target[r], range.capacity);
      for (int64_t u = floor_div(lo, U); lo < hi && u * U < hi; ++u) {
        const int64_t slot = inflight_slot(range, u, inflight_slots[b].data_ptr<int32_t>() + r * miu,
                                           miu, resident[b].data_ptr<int32_t>() + l * S, S);
        const int64_t page = u / E;
        if (slot == BAD || page >= pages) continue;
        const int64_t host_slot = table[r * pages + page];
        if (host_slot < 0 || host_slot >= host.slots) continue;
        // Only the unit's tokens inside [lo, hi): its other tokens are history or unwritten.
        const int64_t first = std::max(lo, u * U), last = std::min(hi, (u + 1) * U);
        const int64_t entry = l * S + slot;
        const uint8_t* src = cell.data_ptr<uint8_t>() + (entry / E) * page_bytes +
                             ((entry % E) * U + first - u * U) * token_bytes;
        uint8_t* dst = host.data + host_slot * host.slot_stride + (first % P) * token_bytes;
        for (int64_t k = 0; k < chunks; ++k)
          std::memcpy(dst + k * chunk_bytes, src + k * chunk_bytes, (last - first) * token_bytes);
      }
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CPU, m) {
  m.impl("locate_inflight", &locate_inflight_cpu);
  m.impl("write_indices", &write_indices_cpu);
  m.impl("flush", &flush_cpu);
}

}  // namespace torch_kvcm2
