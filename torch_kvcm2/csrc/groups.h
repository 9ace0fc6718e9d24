// resolve_groups' arguments, checked and split into selection groups (resolve_groups.cpp), for
// its CPU and CUDA wrappers.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace torch_kvcm2 {

// Fields per group in resolve_groups' group_params, and per buffer in its buffer_params.
constexpr int64_t kGroupFields = 6;
constexpr int64_t kBufferFields = 3;

// One group of a resolve_groups call: index g into the per-group lists, its fields, and its
// buffers: the run [first_buffer, first_buffer + buffers) of cells, with each one's host pool,
// position and page table (fetch's per-buffer arguments).
struct StepGroup {
  size_t g;
  int64_t tokens_per_unit, max_inflight_tokens, window, sinks;
  std::optional<at::Tensor> scratch;
  size_t first_buffer, buffers;
  std::vector<at::Tensor> host_pools, page_tables;
  std::vector<int64_t> positions;
};

// resolve_groups' arguments, in schema order (csrc/ops.cpp).
struct GroupLists {
  const at::TensorList &resident, &recency, &index_table, &miss_list, &miss_count, &counters,
      &inflight_slots, &write_table, &write_start, &cells, &scratch, &selected;
  const at::Tensor &history, &capacity, &lease;
  const at::TensorList &host_pools, &page_tables;
  int64_t tokens_per_page;
  at::IntArrayRef group_params, buffer_params;
};

// Every check of resolve_step for every group (so a bad argument changes nothing), the lists'
// lengths, the group and buffer fields, and that no two groups share a tensor they mutate.
std::vector<StepGroup> check_resolve_groups(const GroupLists& a);

// The CUDA launches of checked groups (cuda/resolve_groups.cu).
void run_groups_cuda(const GroupLists& a, const std::vector<StepGroup>& groups);

}  // namespace torch_kvcm2
