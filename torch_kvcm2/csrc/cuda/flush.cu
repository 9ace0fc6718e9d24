// CUDA kernel of OP-FLUSH. It reproduces cpu/flush.cpp bit for bit.
//
// One launch per sparse pool group. A fixed grid of warps sweeps (buffer, row, in-flight unit)
// items; each warp copies its unit's tokens in [s0, min(new_history, c)) from the cell to the
// host page through the device-mapped view, chunk by chunk, with the widest vectors every buffer
// of the launch allows. Stores to host memory are posted PCIe writes, so many warps in flight
// keep the link busy.
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

// At most 48 registers, so 5 CTAs (40 warps) fit per SM.
template <typename V>
__global__ __launch_bounds__(kFlushThreads, 5) void flush_kernel(const __grid_constant__ FlushParams p) {
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
    const RowRange range(p.history[r], p.capacity[r], U, P, b.max_inflight_tokens, 0, 0);
    const int64_t lo = range.inflight_start;
    const int64_t hi = flush_end(p.new_history[r], range.capacity);
    const int64_t u = range.first_inflight_unit() + k;
    if (lo >= hi || u * U >= hi) continue;
    const int64_t slot = inflight_slot(range, u, b.inflight_slots + r * b.miu, b.miu,
                                       b.resident + l * b.slots, b.slots);
    if (slot == BAD) continue;
    const int64_t host_slot = table_host_slot(p.page_table, r, p.pages, u / E, b.host_slots);
    if (host_slot < 0) continue;
    const int64_t first = lo > u * U ? lo : u * U;
    const int64_t last = hi < (u + 1) * U ? hi : (u + 1) * U;
    const int64_t chunk_bytes = P * b.token_bytes, page_bytes = b.chunks * chunk_bytes;
    const int64_t unit_bytes = U * b.token_bytes, offset = (first - u * U) * b.token_bytes;
    const uint8_t* src =
        cell_address(b.cells, l * b.slots + slot, E, page_bytes, unit_bytes, offset);
    // u and E fit int32 (capacity is int32; check_flush): a 32-bit remainder.
    uint8_t* dst = host_address(b.host, host_slot, b.host_slot_stride, static_cast<int32_t>(u),
                                static_cast<int32_t>(E), unit_bytes, offset);
    const int64_t vecs = (last - first) * b.token_bytes / static_cast<int64_t>(sizeof(V));
    const int64_t n = vecs * b.chunks;
    for (int64_t v = lane; v < n; v += 32) {
      const int64_t c = v / vecs, o = v % vecs;
      reinterpret_cast<V*>(dst + c * chunk_bytes)[o] =
          reinterpret_cast<const V*>(src + c * chunk_bytes)[o];
    }
  }
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
  // 64 warps per SM: enough stores in flight to fill the link.
  const int64_t max_grid = 8 * static_cast<int64_t>(device_info(page_table.get_device()).sms);
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(
      max_grid, (warps_needed + kFlushThreads / 32 - 1) / (kFlushThreads / 32))));
  // The widest vector dividing every size, stride and base address of the launch.
  int vec = 16;
  for (int64_t i = 0; i < p.buffers_used; ++i) {
    const FlushBuffer& b = p.buffers[i];
    vec = std::min(vec, vector_bytes({reinterpret_cast<uintptr_t>(b.cells),
                                      reinterpret_cast<uintptr_t>(b.host),
                                      static_cast<uint64_t>(b.host_slot_stride),
                                      static_cast<uint64_t>(b.token_bytes)}));
  }
  void (*kernel)(FlushParams) = flush_kernel<uint8_t>;
  switch (vec) {
    case 16: kernel = flush_kernel<uint4>; break;
    case 8: kernel = flush_kernel<uint2>; break;
    case 4: kernel = flush_kernel<uint32_t>; break;
    case 2: kernel = flush_kernel<uint16_t>; break;
    default: break;
  }
  launch_kernel(kernel, dim3(grid), dim3(kFlushThreads), 0, stream, p);
}

struct WatermarkParams {
  int32_t* written;
  const int32_t *declared, *target, *history, *capacity, *lease;
  int64_t rows, pairs;
  int64_t shapes[2 * kMaxWatermarkShapes];
};

constexpr int kWatermarkThreads = 128;

// One thread per row: the flush's SAFE-2 watermark (flushed_watermark in rules.h, as on the CPU).
__global__ __launch_bounds__(kWatermarkThreads) void flush_watermark_kernel(
    const __grid_constant__ WatermarkParams p) {
  pdl_enter();
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWatermarkThreads + threadIdx.x;
  if (r >= p.rows || p.lease[r] < 0) return;
  p.written[r] = static_cast<int32_t>(flushed_watermark(p.history[r], p.capacity[r], p.written[r],
                                                        p.declared[r], p.target[r], p.shapes,
                                                        p.pairs));
}

void flush_watermark_cuda(const at::Tensor& written, const at::Tensor& declared,
                          const at::Tensor& new_history, const at::Tensor& history,
                          const at::Tensor& capacity, const at::Tensor& lease,
                          at::IntArrayRef shapes) {
  check_flush_watermark(written, declared, new_history, history, capacity, lease, shapes);
  const c10::cuda::CUDAGuard guard(written.device());
  WatermarkParams p{};
  p.written = written.data_ptr<int32_t>();
  p.declared = declared.data_ptr<int32_t>();
  p.target = new_history.data_ptr<int32_t>();
  p.history = history.data_ptr<int32_t>();
  p.capacity = capacity.data_ptr<int32_t>();
  p.lease = lease.data_ptr<int32_t>();
  p.rows = written.size(0);
  p.pairs = static_cast<int64_t>(shapes.size()) / 2;
  for (size_t i = 0; i < shapes.size(); ++i) p.shapes[i] = shapes[i];
  if (p.rows == 0) return;
  const unsigned grid = static_cast<unsigned>((p.rows + kWatermarkThreads - 1) / kWatermarkThreads);
  launch_kernel(flush_watermark_kernel, dim3(grid), dim3(kWatermarkThreads), 0,
                c10::cuda::getCurrentCUDAStream(), p);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CUDA, m) {
  m.impl("flush", &flush_cuda);
  m.impl("flush_watermark", &flush_watermark_cuda);
}

}  // namespace torch_kvcm2
