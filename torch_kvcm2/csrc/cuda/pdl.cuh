// Programmatic dependent launch (PDL, compute capability >= 9.0) for the library's kernels.
//
// Each kernel is launched allowed to overlap the previous kernel of its stream. Before its first
// global-memory access it waits for that kernel (griddepcontrol.wait: the previous grid has
// completed and its memory operations are visible), then lets the next kernel of the stream
// launch (griddepcontrol.launch_dependents), whose CTAs run their preamble (shared-memory
// initialisation) and wait in turn. So the launch gap between two library kernels overlaps the
// first one's tail, inside CUDA graphs too (captured as programmatic edges). A kernel that is not
// the library's (no trigger) is waited for as usual. KVCM2_PDL=0 launches without the attribute
// (development A/B; the device code is the same).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime.h>

#include <utility>

namespace torch_kvcm2 {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The kernel's preamble is done: wait for the previous kernel, then let the next one launch.
__device__ __forceinline__ void pdl_enter() {
  pdl_wait();
  pdl_launch_dependents();
}

// Whether launches on `device` use PDL: compute capability >= 9.0 and KVCM2_PDL not "0" (read
// once per process). Defined in pdl.cu.
bool pdl_enabled(int device);

// kernel<<<grid, block, smem, stream>>>(args...), with the PDL attribute when pdl_enabled.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  if (pdl_enabled(c10::cuda::current_device())) {
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace torch_kvcm2
