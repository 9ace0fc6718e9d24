// CUDA kernels of OP-WRITE and OP-FLUSH. They reproduce cpu/writeback.cpp bit for bit.
//
// write_indices: one CTA per row, one thread per in-flight column.
// flush: one launch per sparse pool group. A fixed grid of warps sweeps (buffer, row, in-flight
// unit) items; each warp copies its unit's tokens in [s0, min(new_history, c)) from the cell to
// the host page through the device-mapped view, chunk by chunk, with the widest vectors every
// buffer of the launch allows. Stores to host memory are posted PCIe writes, so many warps in
// flight keep the link busy.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "../kvcm2.h"
#include "pdl.cuh"

namespace torch_kvcm2 {
namespace {

// ------------------------------------------------------------------------------------------------
// locate_inflight: one CTA per row scans the lease's S slots once; the lowest slot holding a unit
// wins (atomicMin), as on the CPU.

__global__ void locate_inflight_kernel(int32_t* __restrict__ out,
                                       const int32_t* __restrict__ resident,
                                       const int32_t* __restrict__ history,
                                       const int32_t* __restrict__ capacity,
                                       const int32_t* __restrict__ lease, int64_t miu,
                                       int64_t leases, int64_t S, int64_t U, int64_t I) {
  pdl_enter();
  const int64_t r = blockIdx.x;
  int32_t* row_out = out + r * miu;
  const int64_t l = lease[r];
  const bool seated = l >= 0 && l < leases;
  for (int64_t k = threadIdx.x; k < miu; k += blockDim.x) row_out[k] = seated ? INT32_MAX : BAD;
  if (!seated) return;  // uniform per block
  __syncthreads();
  const RowRange range(history[r], capacity[r], U, U, I, 0);
  const int32_t* res = resident + l * S;
  for (int64_t s = threadIdx.x; s < S && range.has_inflight(); s += blockDim.x) {
    const int64_t u = res[s];
    const int64_t k = u - range.first_inflight_unit();
    if (u != BAD && range.inflight(u) && k < miu) atomicMin(row_out + k, static_cast<int32_t>(s));
  }
  __syncthreads();
  for (int64_t k = threadIdx.x; k < miu; k += blockDim.x)
    if (row_out[k] == INT32_MAX) row_out[k] = BAD;
}

void locate_inflight_cuda(const at::Tensor& inflight_slots, const at::Tensor& resident,
                          const at::Tensor& history, const at::Tensor& capacity,
                          const at::Tensor& lease, int64_t tokens_per_unit,
                          int64_t max_inflight_tokens) {
  check_locate_inflight(inflight_slots, resident, history, capacity, lease, tokens_per_unit,
                        max_inflight_tokens);
  const int64_t rows = inflight_slots.size(0);
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(inflight_slots.device());
  launch_kernel(locate_inflight_kernel, dim3(static_cast<unsigned>(rows)), dim3(256), 0,
                c10::cuda::getCurrentCUDAStream(), inflight_slots.data_ptr<int32_t>(),
                resident.data_ptr<int32_t>(), history.data_ptr<int32_t>(),
                capacity.data_ptr<int32_t>(), lease.data_ptr<int32_t>(), inflight_slots.size(1),
                resident.size(0), resident.size(1), tokens_per_unit, max_inflight_tokens);
}

// ------------------------------------------------------------------------------------------------
// write_indices

__global__ void write_indices_kernel(int32_t* __restrict__ out, int32_t* __restrict__ start,
                                     const int32_t* __restrict__ resident,
                                     const int32_t* __restrict__ inflight_slots,
                                     const int32_t* __restrict__ history,
                                     const int32_t* __restrict__ capacity,
                                     const int32_t* __restrict__ lease, int64_t width,
                                     int64_t leases, int64_t S, int64_t miu, int64_t U, int64_t I) {
  pdl_enter();
  const int64_t r = blockIdx.x;
  int32_t* row_out = out + r * width;
  const int64_t l = lease[r];
  if (l < 0 || l >= leases) {
    for (int64_t j = threadIdx.x; j < width; j += blockDim.x) row_out[j] = BAD;
    if (threadIdx.x == 0) start[r] = BAD;
    return;
  }
  const RowRange range(history[r], capacity[r], U, U, I, 0);
  if (threadIdx.x == 0) start[r] = static_cast<int32_t>(range.inflight_start);
  for (int64_t j = threadIdx.x; j < width; j += blockDim.x) {
    const int64_t t = range.inflight_start + j;
    int32_t v = BAD;
    if (t < range.capacity) {
      const int64_t slot = inflight_slot(range, t / U, inflight_slots + r * miu, miu,
                                         resident + l * S, S);
      if (slot != BAD) v = static_cast<int32_t>((l * S + slot) * U + t % U);
    }
    row_out[j] = v;
  }
}

void write_indices_cuda(const at::Tensor& out, const at::Tensor& inflight_start,
                        const at::Tensor& resident, const at::Tensor& inflight_slots,
                        const at::Tensor& history, const at::Tensor& capacity,
                        const at::Tensor& lease, int64_t tokens_per_unit,
                        int64_t max_inflight_tokens) {
  check_write_indices(out, inflight_start, resident, inflight_slots, history, capacity, lease,
                      tokens_per_unit, max_inflight_tokens);
  const int64_t rows = out.size(0);
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const int threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, out.size(1))));
  launch_kernel(write_indices_kernel, dim3(static_cast<unsigned>(rows)), dim3(threads), 0,
                c10::cuda::getCurrentCUDAStream(), out.data_ptr<int32_t>(),
                inflight_start.data_ptr<int32_t>(), resident.data_ptr<int32_t>(),
                inflight_slots.data_ptr<int32_t>(), history.data_ptr<int32_t>(),
                capacity.data_ptr<int32_t>(), lease.data_ptr<int32_t>(), out.size(1),
                resident.size(0), resident.size(1), inflight_slots.size(1), tokens_per_unit,
                max_inflight_tokens);
}

// ------------------------------------------------------------------------------------------------
// flush

constexpr int kMaxFlushBuffers = 256;  // 256 x 88 B of parameters: within CUDA 12's 32 KB limit
constexpr int kFlushThreads = 256;

struct FlushBuffer {
  const uint8_t* cells;
  uint8_t* host;
  int64_t host_slot_stride;  // bytes between host slots (the pool group's slot bytes)
  int64_t host_slots;
  const int32_t* resident;
  const int32_t* inflight_slots;
  int32_t leases, slots, tokens_per_unit, max_inflight_tokens, miu, chunks, token_bytes, pad;
};

struct FlushParams {
  FlushBuffer buffers[kMaxFlushBuffers];
  const int32_t* page_table;
  const int32_t* new_history;
  const int32_t* history;
  const int32_t* capacity;
  const int32_t* lease;
  int64_t rows, pages, tokens_per_page, items_per_buffer, buffers_used, max_miu;
};

template <typename V>
__global__ __launch_bounds__(kFlushThreads) void flush_kernel(const __grid_constant__ FlushParams p) {
  pdl_enter();
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kFlushThreads / 32);
  const int64_t total = p.buffers_used * p.items_per_buffer;
  const int64_t P = p.tokens_per_page;
  for (int64_t item = (static_cast<int64_t>(blockIdx.x) * kFlushThreads + threadIdx.x) / 32;
       item < total; item += warps) {
    const FlushBuffer& b = p.buffers[item / p.items_per_buffer];
    const int64_t rest = item % p.items_per_buffer;
    const int64_t r = rest / p.max_miu, k = rest % p.max_miu;
    if (k >= b.miu || b.token_bytes == 0) continue;
    const int64_t l = p.lease[r];
    if (l < 0 || l >= b.leases) continue;
    const int64_t U = b.tokens_per_unit, E = P / U;
    const RowRange range(p.history[r], p.capacity[r], U, P, b.max_inflight_tokens, 0);
    const int64_t lo = range.inflight_start;
    const int64_t target = p.new_history[r];
    const int64_t hi = target < range.capacity ? target : range.capacity;
    const int64_t u = floor_div(lo, U) + k;
    if (lo >= hi || u * U >= hi) continue;
    const int64_t slot = inflight_slot(range, u, b.inflight_slots + r * b.miu, b.miu,
                                       b.resident + l * b.slots, b.slots);
    const int64_t page = u / E;
    if (slot == BAD || page >= p.pages) continue;
    const int64_t host_slot = p.page_table[r * p.pages + page];
    if (host_slot < 0 || host_slot >= b.host_slots) continue;
    const int64_t first = lo > u * U ? lo : u * U;
    const int64_t last = hi < (u + 1) * U ? hi : (u + 1) * U;
    const int64_t entry = l * b.slots + slot;
    const int64_t chunk_bytes = P * b.token_bytes, page_bytes = b.chunks * chunk_bytes;
    const uint8_t* src = b.cells + (entry / E) * page_bytes + ((entry % E) * U + first - u * U) * b.token_bytes;
    uint8_t* dst = b.host + host_slot * b.host_slot_stride + (first % P) * b.token_bytes;
    const int64_t vecs = (last - first) * b.token_bytes / static_cast<int64_t>(sizeof(V));
    const int64_t n = vecs * b.chunks;
    for (int64_t v = lane; v < n; v += 32) {
      const int64_t c = v / vecs, o = v % vecs;
      reinterpret_cast<V*>(dst + c * chunk_bytes)[o] =
          reinterpret_cast<const V*>(src + c * chunk_bytes)[o];
    }
  }
}

// The widest power-of-two vector dividing every size, stride and base address of the launch.
int vector_bytes(const FlushParams& p) {
  uint64_t bits = 16;
  for (int64_t i = 0; i < p.buffers_used; ++i) {
    const FlushBuffer& b = p.buffers[i];
    for (uint64_t x : {reinterpret_cast<uint64_t>(b.cells), reinterpret_cast<uint64_t>(b.host),
                       static_cast<uint64_t>(b.host_slot_stride),
                       static_cast<uint64_t>(b.token_bytes)}) {
      while (bits > 1 && x % bits) bits >>= 1;
    }
  }
  return static_cast<int>(bits);
}

int flush_grid(int device) {
  static int sms[64] = {0};
  if (device < 0 || device >= 64) return 132 * 4;
  if (sms[device] == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    sms[device] = n;
  }
  return sms[device] * 8;  // 64 warps per SM: enough stores in flight to fill the link
}

void flush_cuda(const at::Tensor& host_pool, at::IntArrayRef positions,
                const at::TensorList& cells, const at::TensorList& resident,
                const at::TensorList& inflight_slots, const at::Tensor& page_table,
                const at::Tensor& new_history, const at::Tensor& history,
                const at::Tensor& capacity, const at::Tensor& lease, at::IntArrayRef unit_params) {
  check_flush(host_pool, positions, cells, resident, inflight_slots, page_table, new_history,
              history, capacity, lease, unit_params);
  TORCH_CHECK(static_cast<int64_t>(cells.size()) <= kMaxFlushBuffers, "flush: at most ",
              kMaxFlushBuffers, " buffers per pool group, got ", cells.size());
  const int64_t rows = page_table.size(0);
  if (cells.empty() || rows == 0) return;
  const c10::cuda::CUDAGuard guard(page_table.device());
  FlushParams p{};
  p.page_table = page_table.data_ptr<int32_t>();
  p.new_history = new_history.data_ptr<int32_t>();
  p.history = history.data_ptr<int32_t>();
  p.capacity = capacity.data_ptr<int32_t>();
  p.lease = lease.data_ptr<int32_t>();
  p.rows = rows;
  p.pages = page_table.size(1);
  p.tokens_per_page = cells[0].size(2);
  p.buffers_used = static_cast<int64_t>(cells.size());
  for (size_t i = 0; i < cells.size(); ++i) {
    const at::Tensor& cell = cells[i];
    const HostPages host = host_pages_of(host_pool, positions[i]);
    TORCH_CHECK(cell.size(2) == p.tokens_per_page, "flush: every buffer of a pool group must have ",
                p.tokens_per_page, " tokens per page");
    FlushBuffer& b = p.buffers[i];
    b.cells = cell.data_ptr<uint8_t>();
    b.host = host.data;
    b.host_slot_stride = host.slot_stride;
    b.host_slots = host.slots;
    b.resident = resident[i].data_ptr<int32_t>();
    b.inflight_slots = inflight_slots[i].data_ptr<int32_t>();
    b.leases = static_cast<int32_t>(resident[i].size(0));
    b.slots = static_cast<int32_t>(unit_params[3 * i]);
    b.tokens_per_unit = static_cast<int32_t>(unit_params[3 * i + 1]);
    b.max_inflight_tokens = static_cast<int32_t>(unit_params[3 * i + 2]);
    b.miu = static_cast<int32_t>(inflight_slots[i].size(1));
    b.chunks = static_cast<int32_t>(cell.size(1));
    b.token_bytes = static_cast<int32_t>(cell.size(3));
    p.max_miu = std::max<int64_t>(p.max_miu, b.miu);
  }
  p.items_per_buffer = rows * p.max_miu;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t warps_needed = p.buffers_used * p.items_per_buffer;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(
      flush_grid(page_table.get_device()), (warps_needed + kFlushThreads / 32 - 1) / (kFlushThreads / 32))));
  void (*kernel)(FlushParams) = flush_kernel<uint8_t>;
  switch (vector_bytes(p)) {
    case 16: kernel = flush_kernel<uint4>; break;
    case 8: kernel = flush_kernel<uint2>; break;
    case 4: kernel = flush_kernel<uint32_t>; break;
    case 2: kernel = flush_kernel<uint16_t>; break;
    default: break;
  }
  launch_kernel(kernel, dim3(grid), dim3(kFlushThreads), 0, stream, p);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CUDA, m) {
  m.impl("locate_inflight", &locate_inflight_cuda);
  m.impl("write_indices", &write_indices_cuda);
  m.impl("flush", &flush_cuda);
}

}  // namespace torch_kvcm2
