// CPU kernels of the ranks' step ordering (docs/TP.md): rank_signal publishes "this rank's flush
// of generation g is complete" in the shared rank header, rank_wait blocks until every rank of the
// group has published the current generation. The header is shared memory mapped by every rank's
// process, so plain acquire/release atomics order the processes; no collective runs in a step.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <chrono>
#include <thread>

#include "../rank_sync.h"

namespace torch_kvcm2 {
namespace {

using namespace rank_header;

void record_failure(int64_t* h, int64_t waiter, int64_t missing, int64_t generation,
                    int64_t reason, int64_t seen) {
  __atomic_store_n(h + kFailWaiter, waiter, __ATOMIC_RELAXED);
  __atomic_store_n(h + kFailMissing, missing, __ATOMIC_RELAXED);
  __atomic_store_n(h + kFailGeneration, generation, __ATOMIC_RELAXED);
  __atomic_store_n(h + kFailReason, reason, __ATOMIC_RELAXED);
  __atomic_store_n(h + kFailSeen, seen, __ATOMIC_RELAXED);
  __atomic_store_n(h + kFailed, int64_t{1}, __ATOMIC_RELEASE);
}

void rank_signal_cpu(const at::Tensor& header, const at::Tensor& gen, at::TensorList pools,
                     int64_t rank, int64_t world) {
  (void)pools;  // ordering only: the flush that wrote them ran before this call
  check_rank_args("rank_signal", header, gen, rank, world);
  TORCH_CHECK(header.device().is_cpu() && gen.device().is_cpu(),
              "rank_signal: CPU kernel needs CPU tensors");
  int64_t* h = header.data_ptr<int64_t>();
  int64_t* g = gen.data_ptr<int64_t>();
  const int64_t next = *g + 1;
  *g = next;
  // Release: every write of this process before the store (the flush) is visible to a rank that
  // acquires the counter.
  __atomic_store_n(h + kCounters + rank, next, __ATOMIC_RELEASE);
}

void rank_wait_cpu(const at::Tensor& header, at::TensorList pools, const at::Tensor& gen,
                   int64_t rank, int64_t world, int64_t timeout_us) {
  (void)pools;
  check_rank_args("rank_wait", header, gen, rank, world);
  TORCH_CHECK(header.device().is_cpu() && gen.device().is_cpu(),
              "rank_wait: CPU kernel needs CPU tensors");
  TORCH_CHECK(timeout_us > 0, "rank_wait: timeout_us must be positive, got ", timeout_us);
  int64_t* h = header.data_ptr<int64_t>();
  const int64_t target = *gen.data_ptr<int64_t>();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(timeout_us);
  for (int64_t r = 0; r < world; ++r) {
    for (int64_t spin = 0;; ++spin) {
      const int64_t seen = __atomic_load_n(h + kCounters + r, __ATOMIC_ACQUIRE);
      if (seen >= target) break;
      if (__atomic_load_n(h + kLeft + r, __ATOMIC_ACQUIRE) != 0) {
        record_failure(h, rank, r, target, kReasonLeft, seen);
        TORCH_CHECK(false, "rank_wait: rank ", r, " left the host group after generation ",
                    seen, "; rank ", rank, " waits for generation ", target,
                    ", which can never complete: the group must be rebuilt");
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        record_failure(h, rank, r, target, kReasonTimeout, seen);
        TORCH_CHECK(false, "rank_wait: rank ", r, " did not signal generation ", target,
                    " within ", timeout_us / 1e6, " s (its last generation: ", seen, "); rank ",
                    rank, " gives up: the rank died or stalled, the group must be rebuilt");
      }
      if (spin < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(spin < 1024 ? 10 : 100));
      }
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CPU, m) {
  m.impl("rank_signal", &rank_signal_cpu);
  m.impl("rank_wait", &rank_wait_cpu);
}

}  // namespace torch_kvcm2
