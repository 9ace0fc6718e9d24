// CUDA kernels of resolve_gpu_history and flush_gpu_history (RSD-1). They reproduce
// cpu/gpu_history.cpp bit for bit. resolve_gpu_history: one CTA per row, a thread per column
// up to 1024; a row's distinct selected ordinals are found with an open-addressing set in
// shared memory (at least twice as many words as columns), whose first inserter of an ordinal
// counts it (a ballot per warp), so the counters do not depend on the order the threads run
// in. flush_gpu_history: warps over (buffer, row, page of the flush range), as flush.cu's over
// in-flight units.
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

__global__ __launch_bounds__(1024) void resolve_gpu_history_kernel(
    int32_t* __restrict__ out, int32_t* __restrict__ write, int32_t* __restrict__ start,
    unsigned long long* __restrict__ counters, const int32_t* __restrict__ selected,
    const int32_t* __restrict__ flag, const int32_t* __restrict__ table,
    const int32_t* __restrict__ history, const int32_t* __restrict__ capacity,
    const int32_t* __restrict__ lease, int64_t K, int64_t W, int64_t pages, int64_t cell_entries,
    int64_t gpu_slots, int64_t U, int64_t P, int64_t I, int64_t window, int64_t sinks,
    int set_bits) {
  extern __shared__ int32_t seen[];  // 1 << set_bits words: BAD or an ordinal
  __shared__ int counts[2];          // this row's distinct hits and invalid ordinals
  const int set_size = 1 << set_bits;
  for (int i = threadIdx.x; i < set_size; i += blockDim.x) seen[i] = BAD;
  if (threadIdx.x < 2) counts[threadIdx.x] = 0;
  pdl_enter();
  const int64_t r = blockIdx.x;
  if (flag[r] == 0 || lease[r] < 0) return;  // resolve's row (or a hole): left as it is
  __syncthreads();
  const RowRange range(history[r], capacity[r], U, P, I, window, sinks);
  const int32_t* pages_row = table + r * pages;
  const int64_t E = P / U;
  const uint32_t mask = static_cast<uint32_t>(set_size - 1);
  const int lane = threadIdx.x & 31;
  // whole warps per round (blockDim.x is a multiple of 32), so each round's new ordinals are
  // counted with one ballot per warp and one shared atomic per warp and kind
  for (int64_t j0 = threadIdx.x - lane; j0 < K; j0 += blockDim.x) {
    const int64_t j = j0 + lane;
    const int32_t u = j < K ? selected[r * K + j] : BAD;
    int64_t entry = BAD;
    bool first = false;
    if (u >= 0) {
      if (range.selectable(u))
        entry = gpu_history_entry(pages_row, pages, u, E, cell_entries, gpu_slots);
      // multiplicative hash, the high bits; linear probing (the set is at most half full)
      uint32_t h = (static_cast<uint32_t>(u) * 2654435761u) >> (32 - set_bits);
      while (true) {
        const int32_t was = atomicCAS(&seen[h], BAD, u);
        if (was == BAD) {
          first = true;
          break;
        }
        if (was == u) break;
        h = (h + 1) & mask;
      }
    }
    const unsigned hits = __ballot_sync(0xffffffffu, first && entry != BAD);
    const unsigned invalid = __ballot_sync(0xffffffffu, first && entry == BAD);
    if (lane == 0) {
      if (hits) atomicAdd(&counts[0], __popc(hits));
      if (invalid) atomicAdd(&counts[1], __popc(invalid));
    }
    if (j < K) out[r * K + j] = static_cast<int32_t>(entry);
  }
  if (threadIdx.x == 0) start[r] = static_cast<int32_t>(range.inflight_start);
  for (int64_t j = threadIdx.x; j < W; j += blockDim.x) {
    const int64_t t = range.inflight_start + j;
    int64_t v = BAD;
    if (t < range.capacity) {
      const int64_t entry = gpu_history_entry(pages_row, pages, t / U, E, cell_entries, gpu_slots);
      if (entry != BAD) v = entry * U + t % U;
    }
    write[r * W + j] = static_cast<int32_t>(v);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (counts[0]) atomicAdd(counters + kHits, static_cast<unsigned long long>(counts[0]));
    if (counts[1]) atomicAdd(counters + kInvalid, static_cast<unsigned long long>(counts[1]));
  }
}

void resolve_gpu_history_cuda(const at::Tensor& index_table, const at::Tensor& write_table,
                              const at::Tensor& write_start, const at::Tensor& counters,
                              const at::Tensor& selected, const at::Tensor& gpu_rows,
                              const at::Tensor& gpu_pages, const at::Tensor& history,
                              const at::Tensor& capacity, const at::Tensor& lease,
                              int64_t cell_entries, int64_t gpu_slots, int64_t tokens_per_unit,
                              int64_t tokens_per_page, int64_t max_inflight_tokens, int64_t window,
                              int64_t sinks) {
  check_resolve_gpu_history(index_table, write_table, write_start, counters, selected, gpu_rows,
                            gpu_pages, history, capacity, lease, cell_entries, gpu_slots,
                            tokens_per_unit, tokens_per_page, max_inflight_tokens, window, sinks);
  const int64_t rows = selected.size(0);
  if (rows == 0) return;
  const int64_t K = selected.numel() / rows;
  int set_bits = 6;  // at least 64 words, at least twice the columns
  while ((int64_t{1} << set_bits) < 2 * K) ++set_bits;
  const size_t smem = sizeof(int32_t) << set_bits;
  const c10::cuda::CUDAGuard guard(selected.device());
  const int device = selected.get_device();
  const auto kernel = resolve_gpu_history_kernel;
  TORCH_CHECK(static_cast<int64_t>(smem) + static_smem(kernel_id(kernel), device) <=
                  device_info(device).smem_optin,
              "resolve_gpu_history: ", K, " columns per row need a ", smem,
              "-byte set, more shared memory than one block may use");
  allow_dynamic_smem(kernel_id(kernel), device, smem);
  // a thread per column up to 1024 (whole warps: the kernel's rounds are warp-wide): the loop
  // over a row's columns is a chain of dependent loads, so fewer rounds is what a row costs
  const int64_t columns = std::max(K, write_table.size(1));
  const int threads =
      static_cast<int>(std::min<int64_t>(1024, std::max<int64_t>(32, ceil_div(columns, 32) * 32)));
  launch_kernel(kernel, dim3(static_cast<unsigned>(rows)), dim3(threads), smem,
                c10::cuda::getCurrentCUDAStream(), index_table.data_ptr<int32_t>(),
                write_table.data_ptr<int32_t>(), write_start.data_ptr<int32_t>(),
                reinterpret_cast<unsigned long long*>(counters.data_ptr<int64_t>()),
                selected.data_ptr<int32_t>(), gpu_rows.data_ptr<int32_t>(),
                gpu_pages.data_ptr<int32_t>(), history.data_ptr<int32_t>(),
                capacity.data_ptr<int32_t>(), lease.data_ptr<int32_t>(), K, write_table.size(1),
                gpu_pages.size(1), cell_entries, gpu_slots, tokens_per_unit, tokens_per_page,
                max_inflight_tokens, window, sinks, set_bits);
}

constexpr int kMaxFlushBuffers = 256;  // as flush.cu: the parameters stay within 32 KB
constexpr int kFlushThreads = 256;

struct GpuFlushBuffer {
  const uint8_t* space;  // the buffer's index space: its cells, then its GPU pages
  uint8_t* host;
  int64_t host_slot_stride, host_slots, cell_pages, gpu_slots;
  int32_t tokens_per_unit, max_inflight_tokens, chunks, token_bytes;
};

struct GpuFlushParams {
  GpuFlushBuffer buffers[kMaxFlushBuffers];
  const int32_t *page_table, *gpu_pages, *gpu_rows, *new_history, *history, *capacity, *lease;
  int64_t rows, pages, gpu_table_pages, tokens_per_page, pages_per_row, buffers_used;
};

// One warp per (buffer, row, k-th page of the row's flush range): the range's tokens on that
// page, from its GPU page to its host page, chunk by chunk, with vectors of V.
template <typename V>
__global__ __launch_bounds__(kFlushThreads) void flush_gpu_history_kernel(
    const __grid_constant__ GpuFlushParams p) {
  pdl_enter();
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kFlushThreads / 32);
  const int64_t per_buffer = p.rows * p.pages_per_row;
  const int64_t total = p.buffers_used * per_buffer;
  const int64_t P = p.tokens_per_page;
  for (int64_t item = (static_cast<int64_t>(blockIdx.x) * kFlushThreads + threadIdx.x) / 32;
       item < total; item += warps) {
    const GpuFlushBuffer& b = p.buffers[item / per_buffer];
    const int64_t rest = item % per_buffer;
    const int64_t r = rest / p.pages_per_row, k = rest % p.pages_per_row;
    if (b.token_bytes == 0 || p.gpu_rows[r] == 0 || p.lease[r] < 0) continue;
    const RowRange range(p.history[r], p.capacity[r], b.tokens_per_unit, P,
                         b.max_inflight_tokens, 0, 0);
    const int64_t lo = range.inflight_start;
    const int64_t hi = flush_end(p.new_history[r], range.capacity);
    const int64_t page = lo / P + k;
    if (lo >= hi || page * P >= hi) continue;
    const int64_t t0 = lo > page * P ? lo : page * P;
    const int64_t t1 = hi < (page + 1) * P ? hi : (page + 1) * P;
    const int64_t gpu = page < p.gpu_table_pages ? p.gpu_pages[r * p.gpu_table_pages + page] : BAD;
    const int64_t host_slot = table_host_slot(p.page_table, r, p.pages, page, b.host_slots);
    if (gpu < 0 || gpu >= b.gpu_slots || host_slot < 0) continue;
    const int64_t chunk_bytes = P * b.token_bytes, page_bytes = b.chunks * chunk_bytes;
    const int64_t offset = (t0 - page * P) * b.token_bytes;
    const uint8_t* src = b.space + (b.cell_pages + gpu) * page_bytes + offset;
    uint8_t* dst = b.host + host_slot * b.host_slot_stride + offset;
    const int64_t vecs = (t1 - t0) * b.token_bytes / static_cast<int64_t>(sizeof(V));
    const int64_t n = vecs * b.chunks;
    for (int64_t v = lane; v < n; v += 32) {
      const int64_t c = v / vecs, o = v % vecs;
      reinterpret_cast<V*>(dst + c * chunk_bytes)[o] =
          reinterpret_cast<const V*>(src + c * chunk_bytes)[o];
    }
  }
}

void flush_gpu_history_cuda(const at::Tensor& host_pool, at::IntArrayRef positions,
                            const at::TensorList& spaces, const at::Tensor& gpu_rows,
                            const at::Tensor& gpu_pages, const at::Tensor& page_table,
                            const at::Tensor& new_history, const at::Tensor& history,
                            const at::Tensor& capacity, const at::Tensor& lease,
                            at::IntArrayRef unit_params) {
  check_flush_gpu_history(host_pool, positions, spaces, gpu_rows, gpu_pages, page_table,
                          new_history, history, capacity, lease, unit_params);
  TORCH_CHECK(static_cast<int64_t>(spaces.size()) <= kMaxFlushBuffers, "flush_gpu_history: at "
              "most ", kMaxFlushBuffers, " buffers per pool group, got ", spaces.size());
  const int64_t rows = page_table.size(0);
  if (spaces.empty() || rows == 0) return;
  const c10::cuda::CUDAGuard guard(page_table.device());
  GpuFlushParams p{};
  p.page_table = page_table.data_ptr<int32_t>();
  p.gpu_pages = gpu_pages.data_ptr<int32_t>();
  p.gpu_rows = gpu_rows.data_ptr<int32_t>();
  p.new_history = new_history.data_ptr<int32_t>();
  p.history = history.data_ptr<int32_t>();
  p.capacity = capacity.data_ptr<int32_t>();
  p.lease = lease.data_ptr<int32_t>();
  p.rows = rows;
  p.pages = page_table.size(1);
  p.gpu_table_pages = gpu_pages.size(1);
  p.tokens_per_page = spaces[0].size(2);
  p.buffers_used = static_cast<int64_t>(spaces.size());
  int vec = 16;
  for (size_t i = 0; i < spaces.size(); ++i) {
    const at::Tensor& space = spaces[i];
    TORCH_CHECK(space.size(2) == p.tokens_per_page, "flush_gpu_history: every buffer of a pool "
                "group must have ", p.tokens_per_page, " tokens per page");
    const HostPages host = host_pages_of(host_pool, positions[i]);
    GpuFlushBuffer& b = p.buffers[i];
    b.space = space.data_ptr<uint8_t>();
    b.host = host.data;
    b.host_slot_stride = host.slot_stride;
    b.host_slots = host.slots;
    b.cell_pages = unit_params[3 * i];
    b.gpu_slots = space.size(0) - b.cell_pages;
    b.tokens_per_unit = static_cast<int32_t>(unit_params[3 * i + 1]);
    b.max_inflight_tokens = static_cast<int32_t>(unit_params[3 * i + 2]);
    b.chunks = static_cast<int32_t>(space.size(1));
    b.token_bytes = static_cast<int32_t>(space.size(3));
    // a flush range holds at most I + U - 1 tokens: that many, plus one, pages at most
    p.pages_per_row = std::max<int64_t>(
        p.pages_per_row,
        ceil_div(b.max_inflight_tokens + b.tokens_per_unit - 1, p.tokens_per_page) + 1);
    vec = std::min(vec, vector_bytes({reinterpret_cast<uintptr_t>(b.space),
                                      reinterpret_cast<uintptr_t>(b.host),
                                      static_cast<uint64_t>(b.host_slot_stride),
                                      static_cast<uint64_t>(b.token_bytes)}));
  }
  const int64_t warps_needed = p.buffers_used * rows * p.pages_per_row;
  const int64_t max_grid = 8 * static_cast<int64_t>(device_info(page_table.get_device()).sms);
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(
      max_grid, (warps_needed + kFlushThreads / 32 - 1) / (kFlushThreads / 32))));
  void (*kernel)(GpuFlushParams) = flush_gpu_history_kernel<uint8_t>;
  switch (vec) {
    case 16: kernel = flush_gpu_history_kernel<uint4>; break;
    case 8: kernel = flush_gpu_history_kernel<uint2>; break;
    case 4: kernel = flush_gpu_history_kernel<uint32_t>; break;
    case 2: kernel = flush_gpu_history_kernel<uint16_t>; break;
    default: break;
  }
  launch_kernel(kernel, dim3(grid), dim3(kFlushThreads), 0, c10::cuda::getCurrentCUDAStream(), p);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CUDA, m) {
  m.impl("resolve_gpu_history", &resolve_gpu_history_cuda);
  m.impl("flush_gpu_history", &flush_gpu_history_cuda);
}

}  // namespace torch_kvcm2
