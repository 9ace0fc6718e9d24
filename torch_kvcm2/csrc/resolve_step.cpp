// OP-STEP: one selection group's part of a decode step in one call -- resolve with the write
// indices of its in-flight tokens (resolve's optional outputs: on CUDA computed by the resolve
// kernel itself), then the fetch of the given buffers' misses. Both parts run their backend's
// kernels (through the dispatcher, below the autograd and inplace-or-view keys), so the results
// are those of resolve, write_indices and fetch called in that order, bit for bit, on CPU and
// CUDA alike. What it saves is host time: one call from Python instead of three
// (docs/HOST_PATH.md). Every argument is checked before any part runs, so a bad one changes
// nothing.
#include <ATen/core/Tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>

#include "checks.h"
#include "parts.h"
#include "rules.h"

namespace torch_kvcm2 {
namespace {

using T = const at::Tensor&;

void resolve_step(T resident, T recency, T index_table, T miss_list, T miss_count, T counters,
                  T inflight_slots, T write_table, T write_start, const at::TensorList& cells,
                  T selected, T history, T capacity, T lease, const at::TensorList& host_pools,
                  at::IntArrayRef positions, const at::TensorList& page_tables,
                  int64_t tokens_per_unit, int64_t tokens_per_page, int64_t max_inflight_tokens,
                  int64_t window, const std::optional<at::Tensor>& scratch, int64_t sinks) {
  check_resolve(resident, recency, index_table, miss_list, miss_count, counters, inflight_slots,
                selected, history, capacity, lease, tokens_per_unit, tokens_per_page,
                max_inflight_tokens, window, sinks);
  check_resolve_write(write_table, write_start, selected, resident, inflight_slots, history,
                      capacity, lease, tokens_per_unit, max_inflight_tokens);
  if (!cells.empty())
    check_fetch(cells, host_pools, positions, page_tables, miss_list, miss_count,
                resident.size(1), tokens_per_unit);
  else
    TORCH_CHECK(host_pools.empty() && positions.empty() && page_tables.empty(),
                "resolve_step: no cells, so no host pools, positions or page tables either");
  // The parts are this op's implementation, not calls of their own: straight to the backend.
  const c10::impl::ExcludeDispatchKeyGuard below(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
  parts::resolve().call(resident, recency, index_table, miss_list, miss_count, counters,
                        inflight_slots, selected, history, capacity, lease, tokens_per_unit,
                        tokens_per_page, max_inflight_tokens, window, scratch, write_table,
                        write_start, sinks);
  if (!cells.empty())
    parts::fetch().call(cells, host_pools, positions, page_tables, miss_list, miss_count,
                        resident.size(1), tokens_per_unit);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CPU, m) { m.impl("resolve_step", &resolve_step); }
#ifdef TORCH_KVCM2_WITH_CUDA
TORCH_LIBRARY_IMPL(torch_kvcm2, CUDA, m) { m.impl("resolve_step", &resolve_step); }
#endif

}  // namespace torch_kvcm2
