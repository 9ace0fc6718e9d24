// CUDA part of resolve_groups (csrc/resolve_groups.cpp, which checks and registers it): every
// group's resolve launch (resolve_kernel, as the per-group op launches it), back to back, then
// every group's fetch in one launch per fetch kernel (launch_fetch_groups; part by part for large
// steps), whose CTAs do what they do in the group's own launch: the results are resolve_step's
// per group, bit for bit.
// The resolves are not one launch: a kernel of every group's rows (grid rows x groups) faulted
// (docs/DESIGN.md, "Known limits").
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <vector>

#include "../groups.h"
#include "steps.cuh"

namespace torch_kvcm2 {

// From this many rows (the step's widest group) the fetch parts are launched one by one, as the
// per-group op launches them, instead of one launch for every group's parts. P-STEP-1 on an H100
// (2026-12-06), the one launch against per-group resolves and fetches: 1.31x and 1.11x faster at
// 1 and 8 rows, even at 32 (0.99x), slower from 64 (0.88x, 0.82x at 128); with the parts apart
// from 32 rows: 0.98x at 32 and 64, 1.00x at 128.
constexpr int64_t kFetchApartRows = 32;

void run_groups_cuda(const GroupLists& a, const std::vector<StepGroup>& groups) {
  const c10::cuda::CUDAGuard guard(a.history.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  std::vector<ResolvePlan> plans;
  std::vector<FetchGroupArgs> fetches;
  plans.reserve(groups.size());
  for (const StepGroup& s : groups) {
    const size_t g = s.g;
    plans.push_back(plan_resolve(a.resident[g], a.recency[g], a.index_table[g], a.miss_list[g],
                                 a.miss_count[g], a.counters[g], a.inflight_slots[g],
                                 a.selected[g], a.history, a.capacity, a.lease,
                                 s.tokens_per_unit, a.tokens_per_page, s.max_inflight_tokens,
                                 s.window, s.scratch, a.write_table[g], a.write_start[g],
                                 s.sinks));
    if (s.buffers > 0)
      fetches.push_back({a.cells.slice(s.first_buffer, s.buffers), s.host_pools, s.page_tables,
                         s.positions, &a.miss_list[g], &a.miss_count[g], a.resident[g].size(1),
                         s.tokens_per_unit});
  }
  const std::shared_ptr<const FetchPlan> fetch = plan_fetch_groups(fetches);  // its checks first
  for (const ResolvePlan& plan : plans) launch_resolve(plan, stream);
  int64_t rows = 0;
  for (const ResolvePlan& plan : plans) rows = std::max(rows, plan.rows);
  launch_fetch_groups(*fetch, stream, rows >= kFetchApartRows);
}

}  // namespace torch_kvcm2
