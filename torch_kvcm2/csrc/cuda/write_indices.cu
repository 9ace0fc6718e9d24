// CUDA kernel of OP-WRITE. It reproduces cpu/write_indices.cpp bit for bit: one CTA per row, one
// thread per in-flight column.
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

__global__ void write_indices_kernel(int32_t* __restrict__ out, int32_t* __restrict__ start,
                                     const int32_t* __restrict__ resident,
                                     const int32_t* __restrict__ inflight_slots,
                                     const int32_t* __restrict__ history,
                                     const int32_t* __restrict__ capacity,
                                     const int32_t* __restrict__ lease, int64_t width,
                                     int64_t leases, int64_t S, int64_t miu, int64_t U, int64_t I) {
  pdl_enter();
  const int64_t r = blockIdx.x;
  int32_t* row_out = out + r * width;
  const int64_t l = lease[r];
  if (l < 0 || l >= leases) {
    for (int64_t j = threadIdx.x; j < width; j += blockDim.x) row_out[j] = BAD;
    if (threadIdx.x == 0) start[r] = BAD;
    return;
  }
  const RowRange range(history[r], capacity[r], U, U, I, 0, 0);
  if (threadIdx.x == 0) start[r] = static_cast<int32_t>(range.inflight_start);
  for (int64_t j = threadIdx.x; j < width; j += blockDim.x) {
    const int64_t t = range.inflight_start + j;
    int32_t v = BAD;
    if (t < range.capacity) {
      const int64_t slot = inflight_slot(range, t / U, inflight_slots + r * miu, miu,
                                         resident + l * S, S);
      if (slot != BAD) v = static_cast<int32_t>((l * S + slot) * U + t % U);
    }
    row_out[j] = v;
  }
}

void write_indices_cuda(const at::Tensor& out, const at::Tensor& inflight_start,
                        const at::Tensor& resident, const at::Tensor& inflight_slots,
                        const at::Tensor& history, const at::Tensor& capacity,
                        const at::Tensor& lease, int64_t tokens_per_unit,
                        int64_t max_inflight_tokens) {
  check_write_indices(out, inflight_start, resident, inflight_slots, history, capacity, lease,
                      tokens_per_unit, max_inflight_tokens);
  const int64_t rows = out.size(0);
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const int threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, out.size(1))));
  launch_kernel(write_indices_kernel, dim3(static_cast<unsigned>(rows)), dim3(threads), 0,
                c10::cuda::getCurrentCUDAStream(), out.data_ptr<int32_t>(),
                inflight_start.data_ptr<int32_t>(), resident.data_ptr<int32_t>(),
                inflight_slots.data_ptr<int32_t>(), history.data_ptr<int32_t>(),
                capacity.data_ptr<int32_t>(), lease.data_ptr<int32_t>(), out.size(1),
                resident.size(0), resident.size(1), inflight_slots.size(1), tokens_per_unit,
                max_inflight_tokens);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CUDA, m) { m.impl("write_indices", &write_indices_cuda); }

}  // namespace torch_kvcm2
