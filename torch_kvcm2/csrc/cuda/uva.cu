// Setup-only op uva_view: the CUDA tensor that aliases a CPU tensor's memory through its
// device-mapped (UVA) address, so kernels such as fetch can load host pages with SM loads.
// Registered for the CPU dispatch key (its input is a CPU tensor) but lives in this CUDA-only file.
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/library.h>

#include <cuda_runtime_api.h>

#include <mutex>
#include <unordered_map>

namespace torch_kvcm2 {
namespace {

// Host ranges this op registered, with the number of live views of each: a second view of the
// same storage must not be left dangling when the first one dies.
std::mutex g_mutex;
std::unordered_map<void*, int64_t> g_registered;

bool is_pinned(void* ptr) {
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // older runtimes report plain host memory as an error
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

at::Tensor uva_view(const at::Tensor& host) {
  TORCH_CHECK(host.device().is_cpu(), "uva_view: expected a CPU tensor, got one on ",
              host.device());
  TORCH_CHECK(host.is_contiguous(), "uva_view: the tensor must be contiguous");
  const c10::Storage& storage = host.storage();
  void* const base = storage.mutable_data();
  const size_t nbytes = storage.nbytes();
  TORCH_CHECK(base != nullptr && nbytes > 0, "uva_view: the tensor's storage is empty");
  const c10::DeviceIndex device = c10::cuda::current_device();

  bool owned = false;  // this op registered the range (or holds a reference to its registration)
  {
    const std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_registered.find(base);
    if (it != g_registered.end()) {
      ++it->second;
      owned = true;
    } else if (!is_pinned(base)) {
      // Mapped: a device address exists; Portable: every context (device) may use it.
      C10_CUDA_CHECK(
          cudaHostRegister(base, nbytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
      g_registered.emplace(base, 1);
      owned = true;
    }
  }
  auto release = [base, owned]() {
    if (!owned) return;
    const std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_registered.find(base);
    if (it != g_registered.end() && --it->second == 0) {
      g_registered.erase(it);
      (void)cudaHostUnregister(base);  // a deleter must not throw
      (void)cudaGetLastError();
    }
  };

  void* device_base = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&device_base, base, 0);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    release();
    TORCH_CHECK(false, "uva_view: cudaHostGetDevicePointer failed: ", cudaGetErrorString(err),
                " (pinned memory that is not device-mapped?)");
  }
  const int64_t offset = static_cast<char*>(host.data_ptr()) - static_cast<char*>(base);
  void* const data = static_cast<char*>(device_base) + offset;
  const at::Device cuda(at::kCUDA, device);
  try {
    // The deleter keeps the host tensor (its storage) alive for as long as the view lives.
    return at::from_blob(
        data, host.sizes(), host.strides(),
        [keep = host, release](void*) mutable {
          release();
          keep.reset();
        },
        host.options().device(cuda), cuda);
  } catch (...) {
    release();
    throw;
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CPU, m) {
  m.impl("uva_view", &uva_view);
}

}  // namespace torch_kvcm2
