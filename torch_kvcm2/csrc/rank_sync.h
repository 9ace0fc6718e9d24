// The rank header of a tensor-parallel host group (docs/TP.md, TP-3/TP-4): one page of int64
// words at the end of the group's shared-memory file, mapped by every rank (and, on CUDA,
// registered and device-mapped). rank_signal / rank_wait (cpu/rank_sync.cpp, cuda/rank_sync.cu)
// and torch_kvcm2/tp.py share this layout.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace torch_kvcm2 {
namespace rank_header {

constexpr int64_t kWords = 512;        // one 4 KiB page
constexpr int64_t kMaxWorld = 64;
constexpr int64_t kMagic = 0;          // written by the creating rank
constexpr int64_t kWorld = 1;
// The failure record: the waiter that gave up writes these, then kFailed = 1 last.
constexpr int64_t kFailed = 2;
constexpr int64_t kFailWaiter = 3;     // the rank that gave up waiting
constexpr int64_t kFailMissing = 4;    // the rank it waited for
constexpr int64_t kFailGeneration = 5; // the generation it waited for
constexpr int64_t kFailReason = 6;     // kReasonTimeout or kReasonLeft
constexpr int64_t kFailSeen = 7;       // the missing rank's counter when the waiter gave up
constexpr int64_t kCounters = 16;      // + rank: the last generation the rank signalled
constexpr int64_t kLeft = 16 + kMaxWorld;  // + rank: nonzero once the rank left the group

constexpr int64_t kReasonTimeout = 1;
constexpr int64_t kReasonLeft = 2;

// The argument rules both backends check before touching memory.
inline void check_rank_args(const char* op, const at::Tensor& header, const at::Tensor& gen,
                            int64_t rank, int64_t world) {
  TORCH_CHECK(header.scalar_type() == at::kLong && header.is_contiguous() &&
                  header.dim() == 1 && header.numel() == kWords,
              op, ": header must be a contiguous int64[", kWords, "] tensor, got ",
              header.scalar_type(), header.sizes());
  TORCH_CHECK(gen.scalar_type() == at::kLong && gen.numel() == 1,
              op, ": gen must be an int64[1] tensor, got ", gen.scalar_type(), gen.sizes());
  TORCH_CHECK(gen.device() == header.device(), op, ": gen (", gen.device(),
              ") and header (", header.device(), ") must be on one device");
  TORCH_CHECK(world >= 1 && world <= kMaxWorld, op, ": world must be in [1, ", kMaxWorld,
              "], got ", world);
  TORCH_CHECK(rank >= 0 && rank < world, op, ": rank must be in [0, world=", world, "), got ",
              rank);
}

}  // namespace rank_header
}  // namespace torch_kvcm2
