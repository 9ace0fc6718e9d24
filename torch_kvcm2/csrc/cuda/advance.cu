// CUDA kernel of HOST-3's length advance (Batch.advance); it reproduces cpu/advance.cpp bit for
// bit (advance_row of kvcm2.h per seated row; the counters are integer sums).
//
// One thread per row, one CTA per kAdvanceThreads rows; each CTA adds its refused and short
// counts to the counters with one 64-bit atomic each.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "../kvcm2.h"
#include "launch.cuh"

namespace torch_kvcm2 {
namespace {

constexpr int kAdvanceThreads = 256;

struct AdvanceParams {
  int32_t* lengths;
  unsigned long long* counters;
  const int32_t* accepted;
  int64_t rows;
};

__global__ __launch_bounds__(kAdvanceThreads) void advance_kernel(
    const __grid_constant__ AdvanceParams p) {
  pdl_enter();
  __shared__ unsigned s_refused, s_short;
  if (threadIdx.x == 0) s_refused = 0, s_short = 0;
  __syncthreads();
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kAdvanceThreads + threadIdx.x;
  const int64_t rows = p.rows;
  if (r < rows && p.lengths[kLease * rows + r] >= 0) {
    int32_t h = p.lengths[kHistory * rows + r], c = p.lengths[kCapacity * rows + r];
    const int outcome = advance_row(h, c, p.lengths[kWritten * rows + r],
                                    p.lengths[kAllocated * rows + r], p.accepted[r]);
    if (outcome == 1) {
      atomicAdd(&s_refused, 1u);
    } else {
      p.lengths[kHistory * rows + r] = h;
      p.lengths[kCapacity * rows + r] = c;
      if (outcome == 2) atomicAdd(&s_short, 1u);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (s_refused) atomicAdd(&p.counters[0], static_cast<unsigned long long>(s_refused));
    if (s_short) atomicAdd(&p.counters[1], static_cast<unsigned long long>(s_short));
  }
}

void advance_cuda(const at::Tensor& lengths, const at::Tensor& counters,
                  const at::Tensor& accepted) {
  check_advance(lengths, counters, accepted);
  const int64_t rows = lengths.size(1);
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(lengths.device());
  AdvanceParams p{};
  p.lengths = lengths.data_ptr<int32_t>();
  // int64 counters as unsigned 64-bit words: two's complement sums are equal
  p.counters = reinterpret_cast<unsigned long long*>(counters.data_ptr<int64_t>());
  p.accepted = accepted.data_ptr<int32_t>();
  p.rows = rows;
  const unsigned grid = static_cast<unsigned>((rows + kAdvanceThreads - 1) / kAdvanceThreads);
  launch_kernel(advance_kernel, dim3(grid), dim3(kAdvanceThreads), 0,
                c10::cuda::getCurrentCUDAStream(), p);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CUDA, m) { m.impl("advance", &advance_cuda); }

}  // namespace torch_kvcm2
