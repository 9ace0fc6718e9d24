// CUDA kernel of locate_inflight. It reproduces cpu/locate_inflight.cpp bit for bit: one CTA per
// row scans the lease's S slots once; the lowest slot holding a unit wins (atomicMin), as on the
// CPU.
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

__global__ void locate_inflight_kernel(int32_t* __restrict__ out,
                                       const int32_t* __restrict__ resident,
                                       const int32_t* __restrict__ history,
                                       const int32_t* __restrict__ capacity,
                                       const int32_t* __restrict__ lease, int64_t miu,
                                       int64_t leases, int64_t S, int64_t U, int64_t I) {
  pdl_enter();
  const int64_t r = blockIdx.x;
  int32_t* row_out = out + r * miu;
  const int64_t l = lease[r];
  const bool seated = l >= 0 && l < leases;
  for (int64_t k = threadIdx.x; k < miu; k += blockDim.x) row_out[k] = seated ? INT32_MAX : BAD;
  if (!seated) return;  // uniform per block
  __syncthreads();
  const RowRange range(history[r], capacity[r], U, U, I, 0, 0);
  const int32_t* res = resident + l * S;
  for (int64_t s = threadIdx.x; s < S && range.has_inflight(); s += blockDim.x) {
    const int64_t u = res[s];
    const int64_t k = u - range.first_inflight_unit();
    if (u != BAD && range.inflight(u) && k < miu) atomicMin(row_out + k, static_cast<int32_t>(s));
  }
  __syncthreads();
  for (int64_t k = threadIdx.x; k < miu; k += blockDim.x)
    if (row_out[k] == INT32_MAX) row_out[k] = BAD;
}

void locate_inflight_cuda(const at::Tensor& inflight_slots, const at::Tensor& resident,
                          const at::Tensor& history, const at::Tensor& capacity,
                          const at::Tensor& lease, int64_t tokens_per_unit,
                          int64_t max_inflight_tokens) {
  check_locate_inflight(inflight_slots, resident, history, capacity, lease, tokens_per_unit,
                        max_inflight_tokens);
  const int64_t rows = inflight_slots.size(0);
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(inflight_slots.device());
  launch_kernel(locate_inflight_kernel, dim3(static_cast<unsigned>(rows)), dim3(256), 0,
                c10::cuda::getCurrentCUDAStream(), inflight_slots.data_ptr<int32_t>(),
                resident.data_ptr<int32_t>(), history.data_ptr<int32_t>(),
                capacity.data_ptr<int32_t>(), lease.data_ptr<int32_t>(), inflight_slots.size(1),
                resident.size(0), resident.size(1), tokens_per_unit, max_inflight_tokens);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CUDA, m) { m.impl("locate_inflight", &locate_inflight_cuda); }

}  // namespace torch_kvcm2
