// CPU kernel of OP-FLUSH: the write-back of in-flight tokens from their cells to their host pages
// once they become history. Reads residency only, through the rows' in-flight slot records.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "../checks.h"
#include "../rules.h"

namespace torch_kvcm2 {
namespace {

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
    const int64_t E = P / U, unit_bytes = U * token_bytes;
    const int64_t leases = resident[b].size(0), miu = inflight_slots[b].size(1);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t l = own[r];
      if (l < 0 || l >= leases) continue;
      const RowRange range(hist[r], cap[r], U, P, I, 0, 0);
      const int64_t lo = range.inflight_start;
      const int64_t hi = flush_end(target[r], range.capacity);
      for (int64_t u = range.first_inflight_unit(); lo < hi && u * U < hi; ++u) {
        const int64_t slot = inflight_slot(range, u, inflight_slots[b].data_ptr<int32_t>() + r * miu,
                                           miu, resident[b].data_ptr<int32_t>() + l * S, S);
        if (slot == BAD) continue;
        const int64_t host_slot = table_host_slot(table, r, pages, u / E, host.slots);
        if (host_slot < 0) continue;
        // Only the unit's tokens inside [lo, hi): its other tokens are history or unwritten.
        const int64_t first = std::max(lo, u * U), last = std::min(hi, (u + 1) * U);
        const int64_t offset = (first - u * U) * token_bytes;
        const uint8_t* src = cell_address<const uint8_t>(cell.data_ptr<uint8_t>(), l * S + slot,
                                                          E, page_bytes, unit_bytes, offset);
        uint8_t* dst =
            host_address(host.data, host_slot, host.slot_stride, u, E, unit_bytes, offset);
        for (int64_t k = 0; k < chunks; ++k)
          std::memcpy(dst + k * chunk_bytes, src + k * chunk_bytes, (last - first) * token_bytes);
      }
    }
  }
}

void flush_watermark_cpu(const at::Tensor& written, const at::Tensor& declared,
                         const at::Tensor& new_history, const at::Tensor& history,
                         const at::Tensor& capacity, const at::Tensor& lease,
                         at::IntArrayRef shapes) {
  check_flush_watermark(written, declared, new_history, history, capacity, lease, shapes);
  int32_t* out = written.data_ptr<int32_t>();
  const int32_t* decl = declared.data_ptr<int32_t>();
  const int32_t* target = new_history.data_ptr<int32_t>();
  const int32_t* hist = history.data_ptr<int32_t>();
  const int32_t* cap = capacity.data_ptr<int32_t>();
  const int32_t* own = lease.data_ptr<int32_t>();
  const int64_t pairs = static_cast<int64_t>(shapes.size()) / 2;
  for (int64_t r = 0; r < written.size(0); ++r) {
    if (own[r] < 0) continue;
    out[r] = static_cast<int32_t>(
        flushed_watermark(hist[r], cap[r], out[r], decl[r], target[r], shapes.data(), pairs));
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CPU, m) {
  m.impl("flush", &flush_cpu);
  m.impl("flush_watermark", &flush_watermark_cpu);
}

}  // namespace torch_kvcm2
