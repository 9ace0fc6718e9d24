// CPU kernel of OP-FETCH: every listed missed unit of each buffer, host page -> cell, chunk by
// chunk. The executable semantics the CUDA kernel (cuda/fetch.cu) reproduces.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "../checks.h"
#include "../rules.h"

namespace torch_kvcm2 {
namespace {

void fetch_cpu(const at::TensorList& cells, const at::TensorList& host_pools,
               at::IntArrayRef positions, const at::TensorList& page_tables,
               const at::Tensor& miss_list, const at::Tensor& miss_count, int64_t slots,
               int64_t tokens_per_unit) {
  check_fetch(cells, host_pools, positions, page_tables, miss_list, miss_count, slots,
              tokens_per_unit);
  const int64_t n = std::min<int64_t>(std::max(miss_count.data_ptr<int32_t>()[0], 0),
                                      miss_list.size(0));
  const int32_t* misses = miss_list.data_ptr<int32_t>();
  for (size_t b = 0; b < cells.size(); ++b) {
    const at::Tensor& cell = cells[b];
    const int64_t chunks = cell.size(1), P = cell.size(2), token_bytes = cell.size(3);
    const int64_t chunk_bytes = P * token_bytes;
    const int64_t page_bytes = chunks * chunk_bytes;
    const int64_t unit_bytes = tokens_per_unit * token_bytes;  // one unit's bytes in one chunk
    if (page_bytes == 0) continue;                              // zero-size buffer (CFG-6)
    const int32_t E = static_cast<int32_t>(P / tokens_per_unit);  // fits (check_fetch)
    const int64_t num_entries = cell.size(0) * E;
    const at::Tensor& table = page_tables[b];
    uint8_t* cell_data = cell.data_ptr<uint8_t>();
    const HostPages host = host_pages_of(host_pools[b], positions[b]);
    for (int64_t m = 0; m < n; ++m) {
      const int32_t* e = misses + m * kMissFields;
      const int64_t host_slot =
          fetch_host_slot(e[kMissLease], e[kMissSlot], e[kMissRow], e[kMissUnit], slots,
                          num_entries, table.data_ptr<int32_t>(), table.size(0), table.size(1),
                          E, host.slots);
      if (host_slot < 0) continue;  // bad device data: skipped, never written out of bounds
      const int64_t entry = static_cast<int64_t>(e[kMissLease]) * slots + e[kMissSlot];
      uint8_t* dst = cell_address(cell_data, entry, E, page_bytes, unit_bytes, 0);
      const uint8_t* src = host_address<const uint8_t>(host.data, host_slot, host.slot_stride,
                                                       e[kMissUnit], E, unit_bytes, 0);
      for (int64_t k = 0; k < chunks; ++k)
        std::memcpy(dst + k * chunk_bytes, src + k * chunk_bytes, unit_bytes);
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CPU, m) { m.impl("fetch", &fetch_cpu); }

}  // namespace torch_kvcm2
