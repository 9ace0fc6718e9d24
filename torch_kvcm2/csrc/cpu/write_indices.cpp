// CPU kernel of OP-WRITE: where each in-flight token of a row goes in the cells. Reads residency
// only, through the row's in-flight slot records.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>

#include "../checks.h"
#include "../rules.h"
#include "locate_inflight.h"

namespace torch_kvcm2 {
namespace {

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
  const int32_t* res = resident.data_ptr<int32_t>();
  const int32_t* slots = inflight_slots.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t l = own[r];
    if (l < 0 || l >= leases) {
      std::fill(dst + r * width, dst + (r + 1) * width, BAD);
      start[r] = BAD;
      continue;
    }
    // tokens_per_page does not enter the in-flight range: pass U so first_live_unit stays 0.
    const RowRange range(hist[r], cap[r], U, U, max_inflight_tokens, 0, 0);
    start[r] = write_row(res + l * S, S, l, range, slots + r * miu, miu, dst + r * width, width);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CPU, m) { m.impl("write_indices", &write_indices_cpu); }

}  // namespace torch_kvcm2
