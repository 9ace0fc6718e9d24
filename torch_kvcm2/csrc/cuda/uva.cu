// Setup-only ops on host memory, in this CUDA-only file:
// - uva_view: the CUDA tensor that aliases a CPU tensor's memory through its device-mapped (UVA)
//   address, so kernels such as fetch can load host pages with SM loads. register=true registers
//   the tensor's storage when it is not pinned yet; register=false registers nothing and aliases
//   the host address itself (a host region whose ranges host_register registers as they commit;
//   valid where registered memory's device pointer equals its host pointer). Registered for the
//   CPU dispatch key (its input is a CPU tensor).
// - host_register: cudaHostRegister (Mapped | Portable) or cudaHostUnregister of one host range,
//   for the host region's chunked commit. No tensor arguments: registered as
//   CompositeExplicitAutograd. Runs without the GIL, so commits register on several threads.
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cuda_runtime_api.h>

#include <cstdint>
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

// A view aliasing the host address itself: nothing is registered here; the caller registers the
// ranges kernels reach (host_register) before they reach them.
at::Tensor alias_host_pointer(const at::Tensor& host, c10::DeviceIndex device) {
  int same_pointer = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(
      &same_pointer, cudaDevAttrCanUseHostPointerForRegisteredMem, device));
  TORCH_CHECK(same_pointer == 1, "uva_view(register=False): CUDA device ", int(device),
              " cannot use the host pointer of registered memory "
              "(cudaDevAttrCanUseHostPointerForRegisteredMem is 0), so one view cannot cover a "
              "host region registered in chunks");
  const at::Device cuda(at::kCUDA, device);
  // The deleter keeps the host tensor (its storage, hence the mapping) alive with the view.
  return at::from_blob(
      host.data_ptr(), host.sizes(), host.strides(), [keep = host](void*) mutable { keep.reset(); },
      host.options().device(cuda), cuda);
}

at::Tensor uva_view(const at::Tensor& host, bool register_memory) {
  TORCH_CHECK(host.device().is_cpu(), "uva_view: expected a CPU tensor, got one on ",
              host.device());
  TORCH_CHECK(host.is_contiguous(), "uva_view: the tensor must be contiguous");
  const c10::Storage& storage = host.storage();
  void* const base = storage.mutable_data();
  const size_t nbytes = storage.nbytes();
  TORCH_CHECK(base != nullptr && nbytes > 0, "uva_view: the tensor's storage is empty");
  const c10::DeviceIndex device = c10::cuda::current_device();
  if (!register_memory) return alias_host_pointer(host, device);

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

void host_register(int64_t address, int64_t nbytes, int64_t device, bool register_memory) {
  TORCH_CHECK(address != 0 && nbytes > 0, "host_register: an empty range (address ", address,
              ", ", nbytes, " bytes)");
  TORCH_CHECK(device >= 0 && device < c10::cuda::device_count(), "host_register: no CUDA device ",
              device);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* const ptr = reinterpret_cast<void*>(static_cast<uintptr_t>(address));
  const cudaError_t err =
      register_memory
          ? cudaHostRegister(ptr, static_cast<size_t>(nbytes),
                             cudaHostRegisterMapped | cudaHostRegisterPortable)
          : cudaHostUnregister(ptr);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // a non-sticky error: clear it so later calls do not see it
    const char* const what = register_memory ? "cudaHostRegister" : "cudaHostUnregister";
    TORCH_CHECK(false, "host_register: ", what, " of ", nbytes, " bytes at address ", address,
                " failed: ", cudaGetErrorString(err));
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CPU, m) {
  m.impl("uva_view", &uva_view);
}

TORCH_LIBRARY_IMPL(torch_kvcm2, CompositeExplicitAutograd, m) {
  m.impl("host_register", &host_register);
}

}  // namespace torch_kvcm2
