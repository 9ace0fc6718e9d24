// CUDA kernels of OP-INDEX. Bit-identical to cpu/index.cpp: the same results (divisions in 32
// bits where the operands fit, the rest in int64), BAD for anything that does not resolve, BAD
// (never a wrapped value) above INT32_MAX.
//
// Grid: x over column groups of kCols columns (kThreads * kCols per CTA), y over rows (looping when
// there are more rows than gridDim.y allows). Each thread produces kCols consecutive columns and
// stores them with one 16-byte store when the row layout allows, so a warp writes 512 contiguous
// bytes.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "../checks.h"
#include "../rules.h"
#include "launch.cuh"

namespace torch_kvcm2 {
namespace {

constexpr int kThreads = 256;
constexpr int kCols = 4;             // columns per thread: one int4
constexpr int64_t kMaxGridY = 65535;  // hardware limit of gridDim.y

__device__ __forceinline__ int32_t checked_index(int64_t v) {
  return v <= INT32_MAX ? static_cast<int32_t>(v) : BAD;
}

// kVec: the row width is a multiple of kCols and every pointer is 16-byte aligned, so each
// thread's kCols columns are one aligned int4.
// q = n / d, m = n % d for 0 <= n <= INT32_MAX and d >= 1: one 32-bit division when d fits in
// 32 bits (an int64 division is a long software routine, and with one CTA of 8 warps per SM
// nothing hides its instructions).
__device__ __forceinline__ void divmod_small(int64_t n, int64_t d, int64_t& q, int64_t& m) {
  if (d > INT32_MAX) {
    q = 0, m = n;
    return;
  }
  const uint32_t q32 = static_cast<uint32_t>(n) / static_cast<uint32_t>(d);
  q = q32;
  m = n - static_cast<int64_t>(q32) * d;
}

// ceil(max(c, 0) / d) for an int32 c and d >= 1.
__device__ __forceinline__ int64_t ceil_div_small(int32_t c, int64_t d) {
  if (c <= 0) return 0;
  int64_t q, m;
  divmod_small(c - 1, d, q, m);
  return q + 1;
}

template <bool kVec>
__device__ __forceinline__ void store_cols(int32_t* row, int64_t j0, int64_t width,
                                           const int32_t (&v)[kCols]) {
  if (kVec) {
    *reinterpret_cast<int4*>(row + j0) = make_int4(v[0], v[1], v[2], v[3]);
  } else {
#pragma unroll
    for (int i = 0; i < kCols; ++i)
      if (j0 + i < width) row[j0 + i] = v[i];
  }
}

// A thread's kCols consecutive columns span at most kCols pages: one division gives the first
// column's page and offset, the others step from it. kUnitPages (one unit per page, page-table
// rows of whole 16-byte chunks): column j is page j, and a thread's kCols pages are one int4
// load. The page-table loads do not wait for the row's capacity (both are in flight together);
// the capacity rule applies afterwards.
template <bool kVec, bool kUnitPages>
__global__ __launch_bounds__(kThreads) void convert_page_indices_kernel(
    int32_t* __restrict__ out, const int32_t* __restrict__ table, const int32_t* __restrict__ cap,
    int64_t rows, int64_t width, int64_t pages, int64_t scale, int64_t pos, int64_t units_per_page,
    int64_t tokens_per_unit) {
  pdl_enter();
  const int64_t j0 = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kCols;
  if (j0 >= width) return;
  int64_t page[kCols], off[kCols];
  if (kUnitPages) {
#pragma unroll
    for (int i = 0; i < kCols; ++i) page[i] = j0 + i, off[i] = 0;
  } else {
    if (j0 <= INT32_MAX) {
      divmod_small(j0, units_per_page, page[0], off[0]);
    } else {
      page[0] = j0 / units_per_page;
      off[0] = j0 - page[0] * units_per_page;
    }
#pragma unroll
    for (int i = 1; i < kCols; ++i) {
      const bool next = off[i - 1] + 1 == units_per_page;
      page[i] = page[i - 1] + next;
      off[i] = next ? 0 : off[i - 1] + 1;
    }
  }
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const int32_t c = cap[r];
    int32_t slot[kCols];
    if (kUnitPages) {  // pages % kCols == 0: the chunk is wholly inside the row or past it
      const int4 t4 = j0 < pages ? __ldg(reinterpret_cast<const int4*>(table + r * pages + j0))
                                 : make_int4(-1, -1, -1, -1);
      slot[0] = t4.x, slot[1] = t4.y, slot[2] = t4.z, slot[3] = t4.w;
    } else {
#pragma unroll
      for (int i = 0; i < kCols; ++i)
        slot[i] = j0 + i < width && page[i] < pages ? table[r * pages + page[i]] : -1;
    }
    const int64_t units = ceil_div_small(c, tokens_per_unit);
    int32_t v[kCols];
#pragma unroll
    for (int i = 0; i < kCols; ++i) {
      v[i] = BAD;
      if (j0 + i < units && slot[i] >= 0)
        v[i] = checked_index((static_cast<int64_t>(slot[i]) * scale + pos) * units_per_page + off[i]);
    }
    store_cols<kVec>(out + r * width, j0, width, v);
  }
}

template <bool kVec>
__global__ __launch_bounds__(kThreads) void convert_token_indices_kernel(
    int32_t* __restrict__ out, const int32_t* __restrict__ selected,
    const int32_t* __restrict__ table, const int32_t* __restrict__ cap, int64_t rows,
    int64_t width, int64_t pages, int64_t scale, int64_t pos, int64_t tokens_per_page) {
  pdl_enter();
  const int64_t j0 = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kCols;
  if (j0 >= width) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const int64_t c = cap[r];
    int32_t t_in[kCols];
    if (kVec) {
      const int4 t4 = __ldg(reinterpret_cast<const int4*>(selected + r * width + j0));
      t_in[0] = t4.x, t_in[1] = t4.y, t_in[2] = t4.z, t_in[3] = t4.w;
    } else {
#pragma unroll
      for (int i = 0; i < kCols; ++i)
        t_in[i] = j0 + i < width ? __ldg(selected + r * width + j0 + i) : -1;
    }
    int32_t v[kCols];
#pragma unroll
    for (int i = 0; i < kCols; ++i) {
      const int64_t t = t_in[i];
      v[i] = BAD;
      if (t < 0) continue;
      int64_t p, o;
      divmod_small(t, tokens_per_page, p, o);
      if (p < pages) {  // the table load does not wait for the capacity
        const int64_t slot = table[r * pages + p];
        if (slot >= 0 && t < c) v[i] = checked_index((slot * scale + pos) * tokens_per_page + o);
      }
    }
    store_cols<kVec>(out + r * width, j0, width, v);
  }
}

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

dim3 index_grid(int64_t rows, int64_t width) {
  const int64_t per_cta = static_cast<int64_t>(kThreads) * kCols;
  return dim3(static_cast<unsigned>((width + per_cta - 1) / per_cta),
              static_cast<unsigned>(std::min(rows, kMaxGridY)));
}

void convert_page_indices_cuda(const at::Tensor& out, const at::Tensor& page_table,
                               const at::Tensor& capacity, int64_t scale, int64_t pos,
                               int64_t units_per_page, int64_t tokens_per_unit) {
  check_convert_page_indices(out, page_table, capacity, scale, pos, units_per_page,
                             tokens_per_unit);
  const int64_t rows = out.size(0), width = out.size(1), pages = page_table.size(1);
  if (rows == 0 || width == 0) return;
  TORCH_CHECK((width + kThreads * kCols - 1) / (kThreads * kCols) <= INT32_MAX,
              "convert_page_indices: out is too wide");
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid = index_grid(rows, width);
  const bool vec = width % kCols == 0 && aligned16(out);
  const bool unit_pages = units_per_page == 1 && pages % kCols == 0 && aligned16(page_table);
  auto kernel = vec ? (unit_pages ? convert_page_indices_kernel<true, true>
                                  : convert_page_indices_kernel<true, false>)
                    : (unit_pages ? convert_page_indices_kernel<false, true>
                                  : convert_page_indices_kernel<false, false>);
  launch_kernel(kernel, grid, dim3(kThreads), 0, stream, out.data_ptr<int32_t>(),
                page_table.data_ptr<int32_t>(), capacity.data_ptr<int32_t>(), rows, width, pages,
                scale, pos, units_per_page, tokens_per_unit);
}

void convert_token_indices_cuda(const at::Tensor& out, const at::Tensor& selected,
                                const at::Tensor& page_table, const at::Tensor& capacity,
                                int64_t scale, int64_t pos, int64_t tokens_per_page) {
  check_convert_token_indices(out, selected, page_table, capacity, scale, pos, tokens_per_page);
  const int64_t rows = selected.size(0), width = selected.size(1), pages = page_table.size(1);
  if (rows == 0 || width == 0) return;
  TORCH_CHECK((width + kThreads * kCols - 1) / (kThreads * kCols) <= INT32_MAX,
              "convert_token_indices: out is too wide");
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid = index_grid(rows, width);
  const bool vec = width % kCols == 0 && aligned16(out) && aligned16(selected);
  auto kernel = vec ? convert_token_indices_kernel<true> : convert_token_indices_kernel<false>;
  launch_kernel(kernel, grid, dim3(kThreads), 0, stream, out.data_ptr<int32_t>(),
                selected.data_ptr<int32_t>(), page_table.data_ptr<int32_t>(),
                capacity.data_ptr<int32_t>(), rows, width, pages, scale, pos, tokens_per_page);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CUDA, m) {
  m.impl("convert_page_indices", &convert_page_indices_cuda);
  m.impl("convert_token_indices", &convert_token_indices_cuda);
}

}  // namespace torch_kvcm2
