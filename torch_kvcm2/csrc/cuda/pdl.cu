// pdl_enabled (see pdl.cuh): per device, compute capability >= 9.0 and KVCM2_PDL != "0".
#include "pdl.cuh"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace torch_kvcm2 {

// Called on every launch: no lock. The first callers for a device may each query its compute
// capability; they store the same answer.
bool pdl_enabled(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<signed char> state[kMaxDevices] = {};  // 0 unknown, 1 on, -1 off
  static const bool wanted = [] {
    const char* v = std::getenv("KVCM2_PDL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  if (!wanted || device < 0 || device >= kMaxDevices) return false;
  signed char s = state[device].load(std::memory_order_relaxed);
  if (s == 0) {
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    s = major >= 9 ? 1 : -1;
    state[device].store(s, std::memory_order_relaxed);
  }
  return s > 0;
}

}  // namespace torch_kvcm2
