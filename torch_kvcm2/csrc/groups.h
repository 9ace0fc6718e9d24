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

// Every check of resolve_step for every group (so a bad argument changes nothing), the lists'
// lengths, the group fields, and that no two groups share a tensor they mutate.
std::vector<StepGroup> check_resolve_groups(
    const at::TensorList& resident, const at::TensorList& recency,
    const at::TensorList& index_table, const at::TensorList& miss_list,
    const at::TensorList& miss_count, const at::TensorList& counters,
    const at::TensorList& inflight_slots, const at::TensorList& write_table,
    const at::TensorList& write_start, const at::TensorList& cells,
    const at::TensorList& scratch, const at::TensorList& selected, const at::Tensor& history,
    const at::Tensor& capacity, const at::Tensor& lease, const at::TensorList& host_pools,
    const at::TensorList& page_tables, int64_t tokens_per_page, at::IntArrayRef group_params,
    at::IntArrayRef buffer_params);

}  // namespace torch_kvcm2
