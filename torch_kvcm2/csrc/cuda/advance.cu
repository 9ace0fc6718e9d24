// CUDA kernels of the per-row bookkeeping ops; they reproduce cpu/advance.cpp bit for bit.
//
// advance (HOST-3, Batch.advance): advance_row of rules.h, one thread per row, one CTA per
// kAdvanceThreads rows; each CTA adds its refused and short counts to the counters with one 64-bit
// atomic each (integer sums: the order does not matter).
// clear_leases (Batch.publish): one CTA per (lease, selection group), writing the lease's row of
// resident and recency.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "../checks.h"
#include "../rules.h"
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

constexpr int kClearThreads = 256;
constexpr int kMaxClearGroups = 512;  // 512 x 32 B of parameters, within CUDA 12's 32 KB limit

struct ClearGroup {
  int32_t* resident;
  int32_t* recency;
  int64_t rows, slots;
};

struct ClearParams {
  const int64_t* leases;
  int64_t groups;
  ClearGroup group[kMaxClearGroups];
};

__global__ __launch_bounds__(kClearThreads) void clear_leases_kernel(
    const __grid_constant__ ClearParams p) {
  pdl_enter();
  const ClearGroup& g = p.group[blockIdx.y];
  const int64_t l = p.leases[blockIdx.x];
  if (l < 0 || l >= g.rows) return;
  for (int64_t s = threadIdx.x; s < g.slots; s += kClearThreads) {
    g.resident[l * g.slots + s] = BAD;
    g.recency[l * g.slots + s] = static_cast<int32_t>(s);
  }
}

void clear_leases_cuda(const at::TensorList& resident, const at::TensorList& recency,
                       const at::Tensor& leases) {
  check_clear_leases(resident, recency, leases);
  TORCH_CHECK(static_cast<int64_t>(resident.size()) <= kMaxClearGroups, "clear_leases: at most ",
              kMaxClearGroups, " selection groups, got ", resident.size());
  const int64_t n = leases.size(0);
  if (n == 0 || resident.empty()) return;
  TORCH_CHECK(n <= 0x7fffffff, "clear_leases: too many leases (", n, ")");
  const c10::cuda::CUDAGuard guard(leases.device());
  ClearParams p{};
  p.leases = leases.data_ptr<int64_t>();
  p.groups = static_cast<int64_t>(resident.size());
  for (size_t g = 0; g < resident.size(); ++g) {
    p.group[g] = ClearGroup{resident[g].data_ptr<int32_t>(), recency[g].data_ptr<int32_t>(),
                            resident[g].size(0), resident[g].size(1)};
  }
  launch_kernel(clear_leases_kernel, dim3(static_cast<unsigned>(n), static_cast<unsigned>(p.groups)),
                dim3(kClearThreads), 0, c10::cuda::getCurrentCUDAStream(), p);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CUDA, m) {
  m.impl("advance", &advance_cuda);
  m.impl("clear_leases", &clear_leases_cuda);
}

}  // namespace torch_kvcm2
