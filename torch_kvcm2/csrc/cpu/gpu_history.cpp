// CPU kernel of resolve_gpu_history (RSD-1): the rows of a selection group whose history is on
// GPU pages, after resolve left them as holes. Simple loops; cuda/gpu_history.cu must reproduce
// them bit for bit.
#include <ATen/ATen.h>
#include <torch/library.h>

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

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CPU, m) {
  m.impl("resolve_gpu_history", &resolve_gpu_history_cpu);
}

}  // namespace torch_kvcm2
