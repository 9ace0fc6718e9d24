// The device-fact cache and the development knobs of launch.cuh.
#include "launch.cuh"

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>
#include <vector>
#ifdef KVCM2_DEV
#include <cstdlib>
#include <cstring>
#endif

namespace torch_kvcm2 {
namespace {

constexpr int kMaxDevices = 64;
constexpr size_t kDefaultDynamicSmem = 48 * 1024;  // allowed without cudaFuncSetAttribute

struct KernelFacts {
  const void* kernel;
  int static_smem = -1;                    // -1: not queried yet
  int threads = 0;                         // blocks_per_sm's shape
  size_t dynamic_smem = 0;
  int blocks = -1;                         // -1: not queried yet
  size_t allowed = kDefaultDynamicSmem;    // dynamic shared memory allowed so far
};

struct DeviceSlot {
  std::atomic<bool> ready{false};
  DeviceInfo info;
  std::vector<KernelFacts> kernels;  // guarded by g_mutex
};

std::mutex g_mutex;
DeviceSlot g_devices[kMaxDevices];

DeviceSlot& slot_of(int device) {
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "torch_kvcm2: device index ", device,
              " out of range [0, ", kMaxDevices, ")");
  return g_devices[device];
}

// Call with g_mutex held.
KernelFacts& facts_of(int device, const void* kernel) {
  std::vector<KernelFacts>& all = slot_of(device).kernels;
  for (KernelFacts& k : all)
    if (k.kernel == kernel) return k;
  all.push_back(KernelFacts{kernel});
  return all.back();
}

#ifdef KVCM2_DEV
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? std::atoi(v) : fallback;
}

Tuning read_tuning() {
  Tuning t;
  const char* pdl = std::getenv("KVCM2_PDL");
  t.pdl = pdl == nullptr || std::strcmp(pdl, "0") != 0;
  const int ilp = env_int("KVCM2_FETCH_ILP", t.fetch_ilp);
  t.fetch_ilp = (ilp == 1 || ilp == 4 || ilp == 8) ? ilp : 2;
  const int blocks = env_int("KVCM2_FETCH_BLOCKS_PER_SM", 0);
  t.fetch_blocks_per_sm = std::getenv("KVCM2_FETCH_BLOCKS_PER_SM") ? (blocks > 1 ? blocks : 1) : 0;
  const int tma = env_int("KVCM2_FETCH_TMA", 0);
  t.fetch_tma = tma == 1 ? 1 : tma == 2 ? -1 : 0;
  const int stage = env_int("KVCM2_FETCH_TMA_STAGE", t.fetch_tma_stage);
  t.fetch_tma_stage = (stage < 16 ? 16 : stage > 32768 ? 32768 : stage) / 16 * 16;
  const int warp = env_int("KVCM2_FETCH_WARP", -1);
  t.fetch_warp = (warp >= 0 && warp <= 2) ? warp : -1;
  const int misses = env_int("KVCM2_FETCH_WARP_MISSES", t.fetch_warp_misses);
  t.fetch_warp_misses = (misses == 1 || misses == 2 || misses == 8) ? misses : 4;
  t.fetch_lines = env_int("KVCM2_FETCH_LINES", 0) != 0;
  t.resolve_force_stale = env_int("KVCM2_RESOLVE_FORCE_STALE", 0) != 0;
  return t;
}
#endif

}  // namespace

#ifdef KVCM2_DEV
const Tuning& tuning() {
  static const Tuning t = read_tuning();
  return t;
}
#endif

const DeviceInfo& device_info(int device) {
  DeviceSlot& slot = slot_of(device);
  if (!slot.ready.load(std::memory_order_acquire)) {
    const std::lock_guard<std::mutex> lock(g_mutex);
    if (!slot.ready.load(std::memory_order_relaxed)) {
      DeviceInfo& info = slot.info;
      C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device));
      C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.smem_optin,
                                            cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
      C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor,
                                            device));
      info.pdl = info.cc_major >= 9 && tuning().pdl;
      slot.ready.store(true, std::memory_order_release);
    }
  }
  return slot.info;
}

// The queries and cudaFuncSetAttribute act on the current device: the wrappers' CUDAGuard has made
// `device` current.
int static_smem(const void* kernel, int device) {
  const std::lock_guard<std::mutex> lock(g_mutex);
  KernelFacts& k = facts_of(device, kernel);
  if (k.static_smem < 0) {
    cudaFuncAttributes attr{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    k.static_smem = static_cast<int>(attr.sharedSizeBytes);
  }
  return k.static_smem;
}

int blocks_per_sm(const void* kernel, int device, int threads, size_t dynamic_smem) {
  const std::lock_guard<std::mutex> lock(g_mutex);
  KernelFacts& k = facts_of(device, kernel);
  if (k.blocks < 0 || k.threads != threads || k.dynamic_smem != dynamic_smem) {
    int blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads,
                                                                 dynamic_smem));
    k.blocks = blocks, k.threads = threads, k.dynamic_smem = dynamic_smem;
  }
  return k.blocks;
}

void allow_dynamic_smem(const void* kernel, int device, size_t bytes) {
  const std::lock_guard<std::mutex> lock(g_mutex);
  KernelFacts& k = facts_of(device, kernel);
  if (bytes > k.allowed) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
    k.allowed = bytes;
  }
}

}  // namespace torch_kvcm2
