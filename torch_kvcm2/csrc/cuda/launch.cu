// The device-fact cache and the development knobs of launch.cuh.
#include "launch.cuh"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <stdexcept>
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

// ---- recorded launches ----

namespace {
thread_local std::vector<RecordedLaunches::Entry>* t_recording = nullptr;
thread_local bool t_unrecordable = false;
}  // namespace

std::vector<RecordedLaunches::Entry>*& active_recording() { return t_recording; }
bool recording_launches() { return t_recording != nullptr; }
void mark_unrecordable() { t_unrecordable = true; }

RecordedLaunches::~RecordedLaunches() = default;

namespace {

// A tensor like `like`, `offset` bytes into an allocation of its own (so no other tensor starts
// or ends at its address).
at::Tensor private_like(const at::Tensor& like, int64_t offset) {
  const int64_t n = like.numel(), skip = offset / like.element_size();
  TORCH_INTERNAL_ASSERT(skip * like.element_size() == offset);
  return at::empty({n + skip}, like.options()).narrow(0, skip, n).view(like.sizes());
}

// Why a recording was dropped (the calls then take the ops each time).
void dropped(const char* why) {
  TORCH_WARN_ONCE("torch_kvcm2: the kernel launches of a step's calls could not be recorded (",
                  why, "); those calls go through the ops");
}

// The launches `calls(variable)` makes, kept; nullptr after device work that is not one, or
// when a call refuses its arguments (the op raises the same error when called).
std::unique_ptr<std::vector<RecordedLaunches::Entry>> keep_launches(
    const std::function<void(const at::Tensor&)>& calls, const at::Tensor& variable) {
  if (t_recording != nullptr) throw std::logic_error("RecordedLaunches::record: already recording");
  auto kept = std::make_unique<std::vector<RecordedLaunches::Entry>>();
  t_recording = kept.get();
  t_unrecordable = false;
  try {
    calls(variable);
  } catch (const c10::CUDAError&) {
    t_recording = nullptr;
    throw;
  } catch (const c10::Error&) {
    t_recording = nullptr;
    return nullptr;
  } catch (...) {
    t_recording = nullptr;
    throw;
  }
  t_recording = nullptr;
  if (t_unrecordable) {
    dropped("device work other than a kernel launch of the library's");
    return nullptr;
  }
  return kept;
}

// The offsets of the 8-byte-aligned words of `e`'s parameters that hold `address`.
std::vector<size_t> words_holding(const RecordedLaunches::Entry& e, const void* address) {
  std::vector<size_t> found;
  for (size_t off = 0; off + sizeof(void*) <= e.params.size(); off += alignof(void*)) {
    const void* word;
    std::memcpy(&word, e.params.data() + off, sizeof word);
    if (word == address) found.push_back(off);
  }
  return found;
}

bool same_launch(const RecordedLaunches::Entry& e, const RecordedLaunches::Entry& f) {
  return e.kernel == f.kernel && e.grid.x == f.grid.x && e.grid.y == f.grid.y &&
         e.grid.z == f.grid.z && e.block.x == f.block.x && e.block.y == f.block.y &&
         e.block.z == f.block.z && e.smem == f.smem && e.pdl == f.pdl && e.device == f.device &&
         e.params.size() == f.params.size();
}

}  // namespace

std::shared_ptr<RecordedLaunches> RecordedLaunches::record(
    const std::function<void(const at::Tensor&)>& calls, const at::Tensor& like) {
  // Recorded twice, with variables whose addresses differ in more than their last 4 bits (16
  // and 48 bytes into their allocations): the launches must be the same and their parameters
  // differ exactly in the words that hold the variable's address, so no parameter is derived
  // from the address in another way or chosen by it (the alignment to 16 bytes `matches` asks
  // for excepted).
  const at::Tensor variable = private_like(like, 16), other = private_like(like, 48);
  auto first = keep_launches(calls, variable);
  if (!first) return nullptr;
  auto second = keep_launches(calls, other);
  if (!second) return nullptr;
  if (first->size() != second->size()) {
    dropped("a different number of launches for another address");
    return nullptr;
  }
  auto kept = std::make_shared<RecordedLaunches>();
  const void* const address = variable.data_ptr();
  for (size_t i = 0; i < first->size(); ++i) {
    Entry& e = (*first)[i];
    const Entry& f = (*second)[i];
    if (!same_launch(e, f) || e.device != (*first)[0].device) {  // one device: one guard
      dropped("a different launch for another address");
      return nullptr;
    }
    e.relocations = words_holding(e, address);
    Entry patched = f;
    for (const size_t off : e.relocations) {
      const void* word;
      std::memcpy(&word, f.params.data() + off, sizeof word);
      if (word != other.data_ptr()) {
        dropped("a parameter that depends on the address otherwise");
        return nullptr;
      }
      std::memcpy(patched.params.data() + off, &address, sizeof address);
    }
    if (patched.params != e.params) {
      dropped("a parameter that depends on the address otherwise");
      return nullptr;
    }
    kept->device_ = e.device;
  }
  kept->entries_ = std::move(*first);
  kept->dtype_ = like.scalar_type();
  kept->where_ = like.device();
  kept->sizes_ = like.sizes().vec();
  return kept;
}

bool RecordedLaunches::matches(const at::Tensor& variable) const {
  // The same metadata, and 16-byte alignment (docs/DESIGN.md: recorded launches).
  return variable.defined() && variable.scalar_type() == dtype_ && variable.device() == where_ &&
         variable.sizes() == at::IntArrayRef(sizes_) && variable.is_contiguous() &&
         reinterpret_cast<uintptr_t>(variable.data_ptr()) % 16 == 0;
}

void RecordedLaunches::launch(const at::Tensor& variable) {
  TORCH_CHECK(matches(variable), "recorded launches: the variable must be a contiguous ",
              dtype_, " tensor of shape ", at::IntArrayRef(sizes_), " on ", where_,
              ", 16-byte aligned");
  launch_at(variable.data_ptr());
}

bool RecordedLaunches::launch_at(void* address) {
  if (reinterpret_cast<uintptr_t>(address) % 16 != 0) return false;
  if (entries_.empty()) return true;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_));
  cudaLaunchAttribute attribute;
  for (Entry& e : entries_) {
    for (const size_t off : e.relocations) std::memcpy(e.params.data() + off, &address, sizeof address);
    const cudaLaunchConfig_t config = launch_config(e.grid, e.block, e.smem, stream, e.pdl, attribute);
    void* args[] = {e.params.data()};
    C10_CUDA_CHECK(cudaLaunchKernelExC(&config, e.kernel, args));
  }
  return true;
}

bool readback(int device, const void* src, void* dst, size_t bytes, void* event) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status != cudaStreamCaptureStatusNone) return false;
  C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
  C10_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), stream));
  return true;
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
