// pdl_enabled (see pdl.cuh): per device, compute capability >= 9.0 and KVCM2_PDL != "0".
#include "pdl.cuh"

#include <cstdlib>
#include <cstring>
#include <mutex>

namespace torch_kvcm2 {

bool pdl_enabled(int device) {
  constexpr int kMaxDevices = 64;
  static std::mutex mutex;
  static signed char state[kMaxDevices] = {};  // 0 unknown, 1 on, -1 off
  static const bool wanted = [] {
    const char* v = std::getenv("KVCM2_PDL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  if (!wanted || device < 0 || device >= kMaxDevices) return false;
  const std::lock_guard<std::mutex> lock(mutex);
  if (state[device] == 0) {
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    state[device] = major >= 9 ? 1 : -1;
  }
  return state[device] > 0;
}

}  // namespace torch_kvcm2
