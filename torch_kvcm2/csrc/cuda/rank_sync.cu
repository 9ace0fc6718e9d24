// CUDA kernels of the ranks' step ordering (docs/TP.md). The header is the device-mapped view of
// the shared rank header (host memory registered by every rank): rank_signal stores this rank's
// new generation after a system-scope fence, rank_wait spins (bounded by the GPU's global timer)
// until every rank's counter reaches the current generation. Both read and advance the generation
// in a device tensor, so a captured graph's replays step through generations by themselves.
//
// A wait that gives up cannot raise inside a kernel (or a graph replay): it writes the failure
// record into the header (host memory, readable by the host of every rank) and traps. The trap
// loses this process's CUDA context, as any device fault does: the group has to be rebuilt.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "../rank_sync.h"

namespace torch_kvcm2 {
namespace {

using namespace rank_header;

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ long long load_volatile(const int64_t* p) {
  return *reinterpret_cast<const volatile long long*>(p);
}

__device__ __forceinline__ void store_volatile(int64_t* p, long long v) {
  *reinterpret_cast<volatile long long*>(p) = v;
}

__global__ void rank_signal_kernel(int64_t* header, int64_t* gen, int64_t rank) {
  const long long next = static_cast<long long>(*gen) + 1;
  *gen = next;
  // The previous kernels of the stream (the flush) completed before this one started; the fence
  // orders their writes, as seen from the system, before the counter's store.
  __threadfence_system();
  store_volatile(header + kCounters + rank, next);
  __threadfence_system();
}

// One thread per rank of the group.
__global__ void rank_wait_kernel(int64_t* header, const int64_t* gen, int64_t rank, int64_t world,
                                 uint64_t timeout_ns) {
  const int64_t r = threadIdx.x;
  const long long target = *gen;
  bool failed = false;
  if (r < world) {
    const uint64_t start = global_ns();
    unsigned sleep_ns = 32;
    for (;;) {
      const long long seen = load_volatile(header + kCounters + r);
      if (seen >= target) break;
      const bool left = load_volatile(header + kLeft + r) != 0;
      if (left || global_ns() - start >= timeout_ns) {
        store_volatile(header + kFailWaiter, rank);
        store_volatile(header + kFailMissing, r);
        store_volatile(header + kFailGeneration, target);
        store_volatile(header + kFailReason, left ? kReasonLeft : kReasonTimeout);
        store_volatile(header + kFailSeen, seen);
        __threadfence_system();
        store_volatile(header + kFailed, 1);
        __threadfence_system();
        failed = true;
        break;
      }
      __nanosleep(sleep_ns);
      if (sleep_ns < 4096) sleep_ns *= 2;
    }
  }
  if (failed) __trap();
  __threadfence_system();  // later kernels read what the other ranks wrote
}

void check_cuda(const char* op, const at::Tensor& header) {
  TORCH_CHECK(header.is_cuda(), op, ": CUDA kernel needs CUDA tensors (the header's device view)");
}

void rank_signal_cuda(const at::Tensor& header, const at::Tensor& gen, at::TensorList pools,
                      int64_t rank, int64_t world) {
  (void)pools;
  check_rank_args("rank_signal", header, gen, rank, world);
  check_cuda("rank_signal", header);
  const c10::cuda::CUDAGuard guard(header.device());
  rank_signal_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      header.data_ptr<int64_t>(), gen.data_ptr<int64_t>(), rank);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void rank_wait_cuda(const at::Tensor& header, at::TensorList pools, const at::Tensor& gen,
                    int64_t rank, int64_t world, int64_t timeout_us) {
  (void)pools;
  check_rank_args("rank_wait", header, gen, rank, world);
  check_cuda("rank_wait", header);
  TORCH_CHECK(timeout_us > 0, "rank_wait: timeout_us must be positive, got ", timeout_us);
  const c10::cuda::CUDAGuard guard(header.device());
  rank_wait_kernel<<<1, static_cast<unsigned>(kMaxWorld), 0, c10::cuda::getCurrentCUDAStream()>>>(
      header.data_ptr<int64_t>(), gen.data_ptr<int64_t>(), rank, world,
      static_cast<uint64_t>(timeout_us) * 1000);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CUDA, m) {
  m.impl("rank_signal", &rank_signal_cuda);
  m.impl("rank_wait", &rank_wait_cuda);
}

}  // namespace torch_kvcm2
