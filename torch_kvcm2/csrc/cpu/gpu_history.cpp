// CPU kernels of resolve_gpu_history and flush_gpu_history (RSD-1): the rows whose history is on
// GPU pages, which resolve and flush leave alone. Simple loops; cuda/gpu_history.cu must
// reproduce them bit for bit.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "../checks.h"
#include "../rules.h"

namespace torch_kvcm2 {
namespace {

void resolve_gpu_history_cpu(const at::Tensor& index_table, const at::Tensor& write_table,
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
  const int64_t K = selected.numel() / (rows > 0 ? rows : 1);  // every query token's columns
  const int64_t W = write_table.size(1), pages = gpu_pages.size(1);
  const int64_t U = tokens_per_unit, E = tokens_per_page / tokens_per_unit;
  const int32_t* sel = selected.data_ptr<int32_t>();
  const int32_t* flag = gpu_rows.data_ptr<int32_t>();
  const int32_t* table = gpu_pages.data_ptr<int32_t>();
  const int32_t* hist = history.data_ptr<int32_t>();
  const int32_t* cap = capacity.data_ptr<int32_t>();
  const int32_t* own = lease.data_ptr<int32_t>();
  int32_t* out = index_table.data_ptr<int32_t>();
  int32_t* write = write_table.data_ptr<int32_t>();
  int32_t* start = write_start.data_ptr<int32_t>();
  int64_t hits = 0, invalid = 0;
  std::unordered_set<int32_t> seen;
  for (int64_t r = 0; r < rows; ++r) {
    if (flag[r] == 0 || own[r] < 0) continue;  // resolve's row (or a hole): left as it is
    const RowRange range(hist[r], cap[r], U, tokens_per_page, max_inflight_tokens, window, sinks);
    const int32_t* pages_row = table + r * pages;
    seen.clear();
    for (int64_t j = 0; j < K; ++j) {
      const int32_t u = sel[r * K + j];
      int64_t entry = BAD;
      if (u >= 0) {
        if (range.selectable(u))
          entry = gpu_history_entry(pages_row, pages, u, E, cell_entries, gpu_slots);
        if (seen.insert(u).second) ++(entry != BAD ? hits : invalid);
      }
      out[r * K + j] = static_cast<int32_t>(entry);
    }
    start[r] = static_cast<int32_t>(range.inflight_start);
    for (int64_t j = 0; j < W; ++j) {
      const int64_t t = range.inflight_start + j;
      int64_t v = BAD;
      if (t < range.capacity) {
        const int64_t entry =
            gpu_history_entry(pages_row, pages, t / U, E, cell_entries, gpu_slots);
        if (entry != BAD) v = entry * U + t % U;
      }
      write[r * W + j] = static_cast<int32_t>(v);
    }
  }
  int64_t* total = counters.data_ptr<int64_t>();
  total[kHits] += hits;
  total[kInvalid] += invalid;
}

void flush_gpu_history_cpu(const at::Tensor& host_pool, at::IntArrayRef positions,
                           const at::TensorList& spaces, const at::Tensor& gpu_rows,
                           const at::Tensor& gpu_pages, const at::Tensor& page_table,
                           const at::Tensor& new_history, const at::Tensor& history,
                           const at::Tensor& capacity, const at::Tensor& lease,
                           at::IntArrayRef unit_params) {
  check_flush_gpu_history(host_pool, positions, spaces, gpu_rows, gpu_pages, page_table,
                          new_history, history, capacity, lease, unit_params);
  const int64_t rows = page_table.size(0), pages = page_table.size(1);
  const int64_t gpu_table_pages = gpu_pages.size(1);
  const int32_t* table = page_table.data_ptr<int32_t>();
  const int32_t* gpu_table = gpu_pages.data_ptr<int32_t>();
  const int32_t* flag = gpu_rows.data_ptr<int32_t>();
  const int32_t* target = new_history.data_ptr<int32_t>();
  const int32_t* hist = history.data_ptr<int32_t>();
  const int32_t* cap = capacity.data_ptr<int32_t>();
  const int32_t* own = lease.data_ptr<int32_t>();
  for (size_t b = 0; b < spaces.size(); ++b) {
    const at::Tensor& space = spaces[b];
    const HostPages host = host_pages_of(host_pool, positions[b]);
    const int64_t cell_pages = unit_params[3 * b], U = unit_params[3 * b + 1],
                  I = unit_params[3 * b + 2];
    const int64_t chunks = space.size(1), P = space.size(2), token_bytes = space.size(3);
    const int64_t chunk_bytes = P * token_bytes, page_bytes = chunks * chunk_bytes;
    if (page_bytes == 0) continue;
    const int64_t gpu_slots = space.size(0) - cell_pages;
    const uint8_t* base = space.data_ptr<uint8_t>();
    for (int64_t r = 0; r < rows; ++r) {
      if (flag[r] == 0 || own[r] < 0) continue;  // flush's row (or a hole)
      const RowRange range(hist[r], cap[r], U, P, I, 0, 0);
      const int64_t lo = range.inflight_start;
      const int64_t hi = flush_end(target[r], range.capacity);
      for (int64_t t0 = lo; t0 < hi;) {
        const int64_t page = t0 / P, t1 = std::min(hi, (page + 1) * P);
        const int64_t gpu = page < gpu_table_pages ? gpu_table[r * gpu_table_pages + page] : BAD;
        const int64_t host_slot = table_host_slot(table, r, pages, page, host.slots);
        if (gpu >= 0 && gpu < gpu_slots && host_slot >= 0) {
          const int64_t offset = (t0 - page * P) * token_bytes;
          const uint8_t* src = base + (cell_pages + gpu) * page_bytes + offset;
          uint8_t* dst = host.data + host_slot * host.slot_stride + offset;
          for (int64_t k = 0; k < chunks; ++k)
            std::memcpy(dst + k * chunk_bytes, src + k * chunk_bytes, (t1 - t0) * token_bytes);
        }
        t0 = t1;
      }
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CPU, m) {
  m.impl("resolve_gpu_history", &resolve_gpu_history_cpu);
  m.impl("flush_gpu_history", &flush_gpu_history_cpu);
}

}  // namespace torch_kvcm2
