// CUDA wrapper of resolve_groups (csrc/resolve_groups.cpp): every group's resolve in one launch
// of resolve_groups_kernel (CTA (row, group)), then every group's fetch in one launch per fetch
// kernel (launch_fetch_groups). Each CTA does exactly what it does in the group's own launch, so
// the results are resolve_step's per group, bit for bit.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "../checks.h"
#include "../groups.h"
#include "steps.cuh"

namespace torch_kvcm2 {
namespace {

void resolve_groups_cuda(const at::TensorList& resident, const at::TensorList& recency,
                         const at::TensorList& index_table, const at::TensorList& miss_list,
                         const at::TensorList& miss_count, const at::TensorList& counters,
                         const at::TensorList& inflight_slots, const at::TensorList& write_table,
                         const at::TensorList& write_start, const at::TensorList& cells,
                         const at::TensorList& scratch, const at::TensorList& selected,
                         const at::Tensor& history, const at::Tensor& capacity,
                         const at::Tensor& lease, const at::TensorList& host_pools,
                         const at::TensorList& page_tables, int64_t tokens_per_page,
                         at::IntArrayRef group_params, at::IntArrayRef buffer_params) {
  const std::vector<StepGroup> groups = check_resolve_groups(
      resident, recency, index_table, miss_list, miss_count, counters, inflight_slots,
      write_table, write_start, cells, scratch, selected, history, capacity, lease, host_pools,
      page_tables, tokens_per_page, group_params, buffer_params);
  const c10::cuda::CUDAGuard guard(history.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  std::vector<ResolvePlan> plans;
  std::vector<FetchGroupArgs> fetches;
  plans.reserve(groups.size());
  for (const StepGroup& s : groups) {
    const size_t g = s.g;
    plans.push_back(plan_resolve(resident[g], recency[g], index_table[g], miss_list[g],
                                 miss_count[g], counters[g], inflight_slots[g], selected[g],
                                 history, capacity, lease, s.tokens_per_unit, tokens_per_page,
                                 s.max_inflight_tokens, s.window, s.scratch, write_table[g],
                                 write_start[g], s.sinks));
    if (s.buffers > 0)
      fetches.push_back({cells.slice(s.first_buffer, s.buffers), s.host_pools, s.page_tables,
                         s.positions, &miss_list[g], &miss_count[g], resident[g].size(1),
                         s.tokens_per_unit});
  }
  const std::shared_ptr<const FetchPlan> fetch = plan_fetch_groups(fetches);  // its checks first
  launch_resolve_groups(plans, stream);
  launch_fetch_groups(*fetch, stream);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CUDA, m) { m.impl("resolve_groups", &resolve_groups_cuda); }

}  // namespace torch_kvcm2
