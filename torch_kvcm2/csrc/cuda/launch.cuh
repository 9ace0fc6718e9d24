// What every CUDA kernel of the library shares at launch: programmatic dependent launch (PDL),
// the one cache of device facts, the vector width of a copy, and the development knobs.
//
// PDL (compute capability >= 9.0): each kernel is launched allowed to overlap the previous kernel
// of its stream. Before its first global-memory access it waits for that kernel
// (griddepcontrol.wait: the previous grid has completed and its memory operations are visible),
// then lets the next kernel of the stream launch (griddepcontrol.launch_dependents), whose CTAs
// run their preamble (shared-memory initialisation) and wait in turn. So the launch gap between
// two library kernels overlaps the first one's tail, inside CUDA graphs too (captured as
// programmatic edges). A kernel that is not the library's (no trigger) is waited for as usual.
//
// ---- Development switch --------------------------------------------------------------------
// A production build reads no environment variable and prints nothing: every choice below is a
// constant (Tuning's defaults, measured on an H200; docs/DEVELOPMENT.md has the method). A
// development build, `TORCH_KVCM2_DEV=1 pip install -e . --no-build-isolation` (setup.py defines
// KVCM2_DEV), reads these environment variables once per process:
//   KVCM2_PDL=0                  launch without the PDL attribute (the device code is the same)
//   KVCM2_FETCH_ILP=1|2|4|8      WARP=0: vector loads in flight per fetch thread (default 2)
//   KVCM2_FETCH_BLOCKS_PER_SM=N  fetch CTAs per SM of the fixed grid (default: every one that fits)
//   KVCM2_FETCH_TMA=0|1|2        0: no bulk copies (default); 1: bulk copies (TMA) for every
//                                16-byte aligned launch; 2: bulk copies for pieces >= 32 KiB
//   KVCM2_FETCH_TMA_STAGE=BYTES  bytes per bulk-copy stage (default 8192)
//   KVCM2_FETCH_WARP=0|1|2       0: the vector-item sweep; 1: one warp per missed unit, each CTA
//                                taking a contiguous chunk of the miss list (default, the
//                                production kernel); 2: as 1, the chunk's misses taken in
//                                host-address order (sorted in the CTA)
//   KVCM2_FETCH_WARP_MISSES=N    misses a warp copies together, 1|2|4|8 (default 4; WARP=1|2)
//   KVCM2_FETCH_LINES=1          WARP=1|2: read the whole 128-byte lines under each piece (the
//                                bytes outside it are not stored)
//   KVCM2_RESOLVE_FORCE_STALE=1  tests only: the resolve kernel alters the lease, history and
//                                capacity it reads before the PDL wait, so every row redoes its
//                                first attempt with the values read after the wait
// and takes two build-time choices: TORCH_KVCM2_DEV=profile (KVCM2_DEV_PROFILE) adds the resolve
// kernel's phase timer, which prints the phase cycles of CTA 0 after every launch
// (cuda/resolve.cuh), and TORCH_KVCM2_RESOLVE_THREADS=N (KVCM2_RESOLVE_THREADS) builds resolve
// with N threads per CTA.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <utility>


namespace torch_kvcm2 {

// The tunable choices of the kernels' host wrappers (see the development switch above).
struct Tuning {
  bool pdl = true;
  int fetch_ilp = 2;
  int fetch_blocks_per_sm = 0;  // 0: every CTA that fits
  int fetch_tma = 0;            // 0: never bulk copies; 1: always; -1: pieces >= 32 KiB
  int fetch_tma_stage = 8192;
  int fetch_warp = -1;  // -1: by piece size (fetch.cu); 0: vector-item sweep; 1: warp per miss;
                        // 2: warp per miss, sorted
  int fetch_warp_misses = 4;  // misses one warp copies together (fetch_warp != 0)
  bool fetch_lines = false;   // fetch_warp != 0: whole 128-byte line reads
  bool resolve_force_stale = false;
};

#ifdef KVCM2_DEV
// The environment's values, read once per process (launch.cu).
const Tuning& tuning();
#else
constexpr Tuning tuning() { return Tuning{}; }
#endif

// Facts of one device, queried once (host calls only, no synchronisation: capture-safe).
struct DeviceInfo {
  int sms = 0;         // multiprocessors
  int smem_optin = 0;  // most shared memory one block may use (static + dynamic), opt-in
  int cc_major = 0;    // compute capability, major
  bool pdl = false;    // launches carry the PDL attribute: cc >= 9.0 and tuning().pdl
};

// The device's facts, queried on its first use; lock-free afterwards (called on every launch).
const DeviceInfo& device_info(int device);

// Facts and settings of one kernel on one device, kept with the device's facts (launch.cu):
// its static shared memory, its resident blocks per SM at `threads` threads and `dynamic_smem`
// bytes (queried once per kernel, device and shape), and its dynamic shared-memory limit, raised
// to `bytes` when that exceeds the default 48 KiB and what was allowed before.
int static_smem(const void* kernel, int device);
int blocks_per_sm(const void* kernel, int device, int threads, size_t dynamic_smem);
void allow_dynamic_smem(const void* kernel, int device, size_t bytes);

template <typename... Params>
const void* kernel_id(void (*kernel)(Params...)) {
  return reinterpret_cast<const void*>(kernel);
}

// The widest vector, 16, 8, 4, 2 or 1 bytes, that divides every value: the sizes, strides and
// base addresses a copy kernel forms its offsets from.
inline int vector_bytes(std::initializer_list<uint64_t> values) {
  uint64_t bits = 0;
  for (const uint64_t v : values) bits |= v;
  int vec = 16;
  while (vec > 1 && (bits & static_cast<uint64_t>(vec - 1)) != 0) vec >>= 1;
  return vec;
}

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

// `words` 4-byte words of `src` (a kernel parameter: one part's entry of a __grid_constant__
// array) into shared memory at `dst`, by the CTA's threads (then __syncthreads). The fetch
// kernels of several launch parts (fetch.cu) read each part's parameters there, at fixed
// shared-memory addresses, rather than indexing the parameter array on every item.
__device__ __forceinline__ void stage_words(void* dst, const void* src, int words) {
  for (int i = threadIdx.x; i < words; i += blockDim.x)
    static_cast<uint32_t*>(dst)[i] = static_cast<const uint32_t*>(src)[i];
}

// The kernel's preamble is done: wait for the previous kernel, then let the next one launch.
__device__ __forceinline__ void pdl_enter() {
  pdl_wait();
  pdl_launch_dependents();
}

// A launch's configuration, with the PDL attribute (kept in `attribute`) when `pdl`.
inline cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                        bool pdl, cudaLaunchAttribute& attribute) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  if (pdl) {
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  return config;
}

// kernel<<<grid, block, smem, stream>>>(args...) on the current device, with the PDL attribute
// when device_info says so.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, Args&&... args) {
  const int device = c10::cuda::current_device();
  const bool pdl = device_info(device).pdl;
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = launch_config(grid, block, smem, stream, pdl, attribute);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace torch_kvcm2
