// CUDA kernel of resolve_gpu_history (RSD-1). It reproduces cpu/gpu_history.cpp bit for bit:
// one CTA per row; a row's distinct selected ordinals are found with an open-addressing set in
// shared memory (at least twice as many words as columns), whose first inserter of an ordinal
// counts it, so the counters do not depend on the order the threads run in.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "../checks.h"
#include "../rules.h"
#include "launch.cuh"

namespace torch_kvcm2 {
namespace {

__global__ void resolve_gpu_history_kernel(
    int32_t* __restrict__ out, int32_t* __restrict__ write, int32_t* __restrict__ start,
    unsigned long long* __restrict__ counters, const int32_t* __restrict__ selected,
    const int32_t* __restrict__ flag, const int32_t* __restrict__ table,
    const int32_t* __restrict__ history, const int32_t* __restrict__ capacity,
    const int32_t* __restrict__ lease, int64_t K, int64_t W, int64_t pages, int64_t cell_entries,
    int64_t gpu_slots, int64_t U, int64_t P, int64_t I, int64_t window, int64_t sinks,
    int set_bits) {
  extern __shared__ int32_t seen[];  // 1 << set_bits words: BAD or an ordinal
  __shared__ int counts[2];          // this row's distinct hits and invalid ordinals
  const int set_size = 1 << set_bits;
  for (int i = threadIdx.x; i < set_size; i += blockDim.x) seen[i] = BAD;
  if (threadIdx.x < 2) counts[threadIdx.x] = 0;
  pdl_enter();
  const int64_t r = blockIdx.x;
  if (flag[r] == 0 || lease[r] < 0) return;  // resolve's row (or a hole): left as it is
  __syncthreads();
  const RowRange range(history[r], capacity[r], U, P, I, window, sinks);
  const int32_t* pages_row = table + r * pages;
  const int64_t E = P / U;
  const uint32_t mask = static_cast<uint32_t>(set_size - 1);
  for (int64_t j = threadIdx.x; j < K; j += blockDim.x) {
    const int32_t u = selected[r * K + j];
    int64_t entry = BAD;
    if (u >= 0) {
      if (range.selectable(u))
        entry = gpu_history_entry(pages_row, pages, u, E, cell_entries, gpu_slots);
      // multiplicative hash, the high bits; linear probing (the set is at most half full)
      uint32_t h = (static_cast<uint32_t>(u) * 2654435761u) >> (32 - set_bits);
      while (true) {
        const int32_t was = atomicCAS(&seen[h], BAD, u);
        if (was == BAD) {
          atomicAdd(&counts[entry != BAD ? 0 : 1], 1);
          break;
        }
        if (was == u) break;
        h = (h + 1) & mask;
      }
    }
    out[r * K + j] = static_cast<int32_t>(entry);
  }
  if (threadIdx.x == 0) start[r] = static_cast<int32_t>(range.inflight_start);
  for (int64_t j = threadIdx.x; j < W; j += blockDim.x) {
    const int64_t t = range.inflight_start + j;
    int64_t v = BAD;
    if (t < range.capacity) {
      const int64_t entry = gpu_history_entry(pages_row, pages, t / U, E, cell_entries, gpu_slots);
      if (entry != BAD) v = entry * U + t % U;
    }
    write[r * W + j] = static_cast<int32_t>(v);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (counts[0]) atomicAdd(counters + kHits, static_cast<unsigned long long>(counts[0]));
    if (counts[1]) atomicAdd(counters + kInvalid, static_cast<unsigned long long>(counts[1]));
  }
}

void resolve_gpu_history_cuda(const at::Tensor& index_table, const at::Tensor& write_table,
                              const at::Tensor& write_start, const at::Tensor& counters,
                              const at::Tensor& selected, const at::Tensor& gpu_rows,
                              const at::Tensor& gpu_pages, const at::Tensor& history,
                              const at::Tensor& capacity, const at::Tensor& lease,
                              int64_t cell_entries, int64_t gpu_slots, int64_t tokens_per_unit,
                              int64_t tokens_per_page, int64_t max_inflight_tokens, int64_t window,
                              int64_t sinks) {
  check_resolve_gpu_history(index_table, write_table, write_start, counters, selected, gpu_rows,
                            gpu_pages, history, capacity, lease, cell_entries, gpu_slots,
                            tokens_per_unit, tokens_per_page, max_inflight_tokens, window, sinks);
  const int64_t rows = selected.size(0);
  if (rows == 0) return;
  const int64_t K = selected.numel() / rows;
  int set_bits = 6;  // at least 64 words, at least twice the columns
  while ((int64_t{1} << set_bits) < 2 * K) ++set_bits;
  const size_t smem = sizeof(int32_t) << set_bits;
  const c10::cuda::CUDAGuard guard(selected.device());
  const int device = selected.get_device();
  const auto kernel = resolve_gpu_history_kernel;
  TORCH_CHECK(static_cast<int64_t>(smem) + static_smem(kernel_id(kernel), device) <=
                  device_info(device).smem_optin,
              "resolve_gpu_history: ", K, " columns per row need a ", smem,
              "-byte set, more shared memory than one block may use");
  allow_dynamic_smem(kernel_id(kernel), device, smem);
  const int64_t columns = std::max(K, write_table.size(1));
  const int threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, columns)));
  launch_kernel(kernel, dim3(static_cast<unsigned>(rows)), dim3(threads), smem,
                c10::cuda::getCurrentCUDAStream(), index_table.data_ptr<int32_t>(),
                write_table.data_ptr<int32_t>(), write_start.data_ptr<int32_t>(),
                reinterpret_cast<unsigned long long*>(counters.data_ptr<int64_t>()),
                selected.data_ptr<int32_t>(), gpu_rows.data_ptr<int32_t>(),
                gpu_pages.data_ptr<int32_t>(), history.data_ptr<int32_t>(),
                capacity.data_ptr<int32_t>(), lease.data_ptr<int32_t>(), K, write_table.size(1),
                gpu_pages.size(1), cell_entries, gpu_slots, tokens_per_unit, tokens_per_page,
                max_inflight_tokens, window, sinks, set_bits);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CUDA, m) {
  m.impl("resolve_gpu_history", &resolve_gpu_history_cuda);
}

}  // namespace torch_kvcm2
