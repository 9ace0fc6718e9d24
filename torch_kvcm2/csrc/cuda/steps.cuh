// The host side of a step's launches split into plan and launch, so that one op call can plan
// (and check) every selection group's resolve and fetch before it launches any: every group's
// resolve, side by side on side streams, then every group's fetch in one launch, part by part
// for large steps (resolve_groups: resolve_groups.cu). The per-group ops plan and launch one
// group the same way.
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "resolve.cuh"

namespace torch_kvcm2 {

// One group's resolve launch: its parameters, kernel instantiation and shared memory.
struct ResolvePlan {
  ResolveParams p;
  bool global_table = false;
  bool writes = false;
  size_t smem = 0;
  int64_t rows = 0;
  int32_t* count = nullptr;  // zeroed by the launch when there are no rows
};

// resolve's arguments, checked by the caller (check_resolve, check_resolve_write), with the
// current device set to theirs.
ResolvePlan plan_resolve(const at::Tensor& resident, const at::Tensor& recency,
                         const at::Tensor& index_table, const at::Tensor& miss_list,
                         const at::Tensor& miss_count, const at::Tensor& counters,
                         const at::Tensor& inflight_slots, const at::Tensor& selected,
                         const at::Tensor& history, const at::Tensor& capacity,
                         const at::Tensor& lease, int64_t tokens_per_unit,
                         int64_t tokens_per_page, int64_t max_inflight_tokens, int64_t window,
                         const std::optional<at::Tensor>& scratch,
                         const std::optional<at::Tensor>& write_table,
                         const std::optional<at::Tensor>& write_start, int64_t sinks);
void launch_resolve(const ResolvePlan& plan, cudaStream_t stream);

// One group's fetch: fetch's arguments (checked by the caller: check_fetch).
struct FetchGroupArgs {
  at::TensorList cells, host_pools, page_tables;
  at::IntArrayRef positions;
  const at::Tensor* miss_list;
  const at::Tensor* miss_count;
  int64_t slots, tokens_per_unit;
};
// Every group's fetch as launch parts, each a group's buffers in sets of up to 8 (fetch.cu);
// planned, with its checks, before anything of the step is launched.
struct FetchPlan;
std::shared_ptr<const FetchPlan> plan_fetch_groups(const std::vector<FetchGroupArgs>& groups);
// The plan in one launch per kernel (the vector sweep, one warp per miss) and per
// kMaxFetchGroups parts.
// `apart`: one launch per part instead (as the per-group op launches them), for large steps.
void launch_fetch_groups(const FetchPlan& plan, cudaStream_t stream, bool apart);

}  // namespace torch_kvcm2
