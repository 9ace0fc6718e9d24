// CPU kernel of locate_inflight: each row's in-flight slot records (cpu/locate_inflight.h),
// recomputed from residency alone, for callers that change lengths or residency between
// resolves. write_indices and flush read the records.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>

#include "../checks.h"
#include "../rules.h"
#include "locate_inflight.h"

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
                         tokens_per_unit, tokens_per_unit, max_inflight_tokens, 0, 0);
    record_inflight(res + l * S, S, range, row_out, miu);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CPU, m) { m.impl("locate_inflight", &locate_inflight_cpu); }

}  // namespace torch_kvcm2
