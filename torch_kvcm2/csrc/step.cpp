// OP-STEP: one selection group's part of a decode step in one call -- resolve, the write indices
// of its in-flight tokens (from the residency and in-flight slot records resolve leaves), then
// the fetch of the given buffers' misses. Each part runs its backend's kernel (through the
// dispatcher, below the autograd and inplace-or-view keys), so the results are those of the
// three ops called in that order, bit for bit, on CPU and CUDA alike. What it saves is host time:
// one call from Python instead of three (each ~5 us of argument parsing and dispatch on the
// H200 host, docs/HOST_PATH.md). Every argument is checked before any part runs, so a bad one
// changes nothing.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>

#include "kvcm2.h"

namespace torch_kvcm2 {
namespace {

using T = const at::Tensor&;
using ResolveFn = void(T, T, T, T, T, T, T, T, T, T, T, int64_t, int64_t, int64_t, int64_t,
                       const std::optional<at::Tensor>&);
using WriteFn = void(T, T, T, T, T, T, T, int64_t, int64_t);
using FetchFn = void(const at::TensorList&, const at::TensorList&, at::IntArrayRef,
                     const at::TensorList&, T, T, int64_t, int64_t);

template <typename Fn>
c10::TypedOperatorHandle<Fn> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

void resolve_step(T resident, T recency, T index_table, T miss_list, T miss_count, T counters,
                  T inflight_slots, T write_table, T write_start, const at::TensorList& cells,
                  T selected, T history, T capacity, T lease, const at::TensorList& host_pools,
                  at::IntArrayRef positions, const at::TensorList& page_tables,
                  int64_t tokens_per_unit, int64_t tokens_per_page, int64_t max_inflight_tokens,
                  int64_t window, const std::optional<at::Tensor>& scratch) {
  check_resolve(resident, recency, index_table, miss_list, miss_count, counters, inflight_slots,
                selected, history, capacity, lease, tokens_per_unit, tokens_per_page,
                max_inflight_tokens, window);
  check_write_indices(write_table, write_start, resident, inflight_slots, history, capacity, lease,
                      tokens_per_unit, max_inflight_tokens);
  TORCH_CHECK(write_table.size(0) == selected.size(0), "resolve_step: write_table has ",
              write_table.size(0), " rows, selected ", selected.size(0));
  if (!cells.empty())
    check_fetch(cells, host_pools, positions, page_tables, miss_list, miss_count,
                resident.size(1), tokens_per_unit);
  static const auto resolve = handle<ResolveFn>("torch_kvcm2::resolve");
  static const auto write = handle<WriteFn>("torch_kvcm2::write_indices");
  static const auto fetch = handle<FetchFn>("torch_kvcm2::fetch");
  // The parts are this op's implementation, not calls of their own: straight to the backend.
  const c10::impl::ExcludeDispatchKeyGuard below(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
  resolve.call(resident, recency, index_table, miss_list, miss_count, counters, inflight_slots,
               selected, history, capacity, lease, tokens_per_unit, tokens_per_page,
               max_inflight_tokens, window, scratch);
  write.call(write_table, write_start, resident, inflight_slots, history, capacity, lease,
             tokens_per_unit, max_inflight_tokens);
  if (!cells.empty())
    fetch.call(cells, host_pools, positions, page_tables, miss_list, miss_count, resident.size(1),
               tokens_per_unit);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CPU, m) { m.impl("resolve_step", &resolve_step); }
#ifdef TORCH_KVCM2_WITH_CUDA
TORCH_LIBRARY_IMPL(torch_kvcm2, CUDA, m) { m.impl("resolve_step", &resolve_step); }
#endif

}  // namespace torch_kvcm2
