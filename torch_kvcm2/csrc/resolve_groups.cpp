// OP-STEP for several selection groups in one call (resolve_groups): each group's part equals
// resolve_step's for that group, bit for bit. The groups share no mutated state, so the order
// between them is free: on CPU every group's resolve, then every group's fetch, through the
// dispatcher like resolve_step; on CUDA (cuda/resolve_groups.cu) every group's resolve launch,
// side by side on side streams forked from the current one and joined back, then every group's
// fetch as one launch. Both backends register the one wrapper below. What it saves: the host's
// calls per group, and on the GPU the groups' resolves and fetches one after another, which is
// most of a small batch's step (benchmarks/NOTES.md, P-STEP-1).
#include <ATen/core/Tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>
#include <unordered_set>

#include "checks.h"
#include "groups.h"
#include "parts.h"

namespace torch_kvcm2 {

std::vector<StepGroup> check_resolve_groups(const GroupLists& a) {
  const auto& [resident, recency, index_table, miss_list, miss_count, counters, inflight_slots,
               write_table, write_start, cells, scratch, selected, history, capacity, lease,
               host_pools, page_tables, tokens_per_page, group_params, buffer_params] = a;
  const char* op = "resolve_groups";
  const size_t n = resident.size();
  for (const at::TensorList* list : {&recency, &index_table, &miss_list, &miss_count, &counters,
                                     &inflight_slots, &write_table, &write_start, &selected}) {
    TORCH_CHECK(list->size() == n, op, ": every per-group list must have one entry per group (",
                n, " resident tables), got one of ", list->size());
  }
  TORCH_CHECK(group_params.size() == n * static_cast<size_t>(kGroupFields), op,
              ": group_params must have ", kGroupFields, " entries per group (", n * kGroupFields,
              "), got ", group_params.size());
  TORCH_CHECK(buffer_params.size() == cells.size() * static_cast<size_t>(kBufferFields), op,
              ": buffer_params must have ", kBufferFields, " entries per buffer (",
              cells.size() * kBufferFields, "), got ", buffer_params.size());
  std::vector<StepGroup> groups;
  groups.reserve(n);
  size_t buffer = 0;
  std::unordered_set<const void*> mutated;  // no two groups mutate one tensor's memory
  auto claim = [&](const at::Tensor& t, size_t g, const char* name) {
    if (t.numel() == 0) return;
    TORCH_CHECK(mutated.insert(t.data_ptr()).second, op, ": group ", g, "'s ", name,
                " shares its memory with a tensor another group mutates");
  };
  for (size_t g = 0; g < n; ++g) {
    const int64_t* f = group_params.data() + g * kGroupFields;
    TORCH_CHECK(f[4] >= -1 && f[4] < static_cast<int64_t>(scratch.size()), op, ": group ", g,
                ": scratch index ", f[4], " outside [-1, ", scratch.size(), ")");
    TORCH_CHECK(f[5] >= 0 && buffer + static_cast<size_t>(f[5]) <= cells.size(), op, ": group ",
                g, ": ", f[5], " buffers from buffer ", buffer, " exceed the ", cells.size(),
                " given");
    StepGroup s{g, f[0], f[1], f[2], f[3], std::nullopt, buffer, static_cast<size_t>(f[5]),
                {}, {}, {}};
    if (f[4] >= 0) s.scratch = scratch[f[4]];
    for (size_t b = buffer; b < buffer + s.buffers; ++b) {
      const int64_t* e = buffer_params.data() + b * kBufferFields;
      TORCH_CHECK(e[0] >= 0 && e[0] < static_cast<int64_t>(host_pools.size()) && e[2] >= 0 &&
                      e[2] < static_cast<int64_t>(page_tables.size()),
                  op, ": buffer ", b, ": host pool ", e[0], " or page table ", e[2],
                  " outside the ", host_pools.size(), " and ", page_tables.size(), " given");
      s.host_pools.push_back(host_pools[e[0]]);
      s.positions.push_back(e[1]);
      s.page_tables.push_back(page_tables[e[2]]);
    }
    buffer += s.buffers;
    check_resolve(resident[g], recency[g], index_table[g], miss_list[g], miss_count[g],
                  counters[g], inflight_slots[g], selected[g], history, capacity, lease,
                  s.tokens_per_unit, tokens_per_page, s.max_inflight_tokens, s.window, s.sinks);
    check_resolve_write(write_table[g], write_start[g], selected[g], resident[g],
                        inflight_slots[g], history, capacity, lease, s.tokens_per_unit,
                        s.max_inflight_tokens);
    if (s.buffers > 0)
      check_fetch(cells.slice(s.first_buffer, s.buffers), s.host_pools, s.positions,
                  s.page_tables, miss_list[g], miss_count[g], resident[g].size(1),
                  s.tokens_per_unit);
    const char* names[] = {"resident", "recency", "index_table", "miss_list", "miss_count",
                           "counters", "inflight_slots", "write_table", "write_start"};
    const at::TensorList* lists[] = {&resident, &recency, &index_table, &miss_list,
                                     &miss_count, &counters, &inflight_slots, &write_table,
                                     &write_start};
    for (size_t i = 0; i < 9; ++i) claim((*lists[i])[g], g, names[i]);
    if (s.scratch.has_value()) claim(*s.scratch, g, "scratch");
    for (size_t b = s.first_buffer; b < s.first_buffer + s.buffers; ++b) claim(cells[b], g, "cells");
    groups.push_back(std::move(s));
  }
  TORCH_CHECK(buffer == cells.size(), op, ": the groups fetch ", buffer, " buffers but ",
              cells.size(), " are given");
  return groups;
}

namespace {

// The CPU parts: every group's resolve, then every group's fetch, through the dispatcher.
void run_groups_cpu(const GroupLists& a, const std::vector<StepGroup>& groups) {
  const c10::impl::ExcludeDispatchKeyGuard below(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
  for (const StepGroup& s : groups) {
    const size_t g = s.g;
    parts::resolve().call(a.resident[g], a.recency[g], a.index_table[g], a.miss_list[g],
                          a.miss_count[g], a.counters[g], a.inflight_slots[g], a.selected[g],
                          a.history, a.capacity, a.lease, s.tokens_per_unit, a.tokens_per_page,
                          s.max_inflight_tokens, s.window, s.scratch, a.write_table[g],
                          a.write_start[g], s.sinks);
  }
  for (const StepGroup& s : groups) {
    if (s.buffers == 0) continue;
    parts::fetch().call(a.cells.slice(s.first_buffer, s.buffers), s.host_pools, s.positions,
                        s.page_tables, a.miss_list[s.g], a.miss_count[s.g],
                        a.resident[s.g].size(1), s.tokens_per_unit);
  }
}

// The op for both backends: its arguments as GroupLists, checked, then the backend's run.
template <void (*run)(const GroupLists&, const std::vector<StepGroup>&)>
void resolve_groups(const at::TensorList& resident, const at::TensorList& recency,
                    const at::TensorList& index_table, const at::TensorList& miss_list,
                    const at::TensorList& miss_count, const at::TensorList& counters,
                    const at::TensorList& inflight_slots, const at::TensorList& write_table,
                    const at::TensorList& write_start, const at::TensorList& cells,
                    const at::TensorList& scratch, const at::TensorList& selected,
                    const at::Tensor& history, const at::Tensor& capacity,
                    const at::Tensor& lease, const at::TensorList& host_pools,
                    const at::TensorList& page_tables, int64_t tokens_per_page,
                    at::IntArrayRef group_params, at::IntArrayRef buffer_params) {
  const GroupLists a{resident, recency, index_table, miss_list, miss_count, counters,
                     inflight_slots, write_table, write_start, cells, scratch, selected,
                     history, capacity, lease, host_pools, page_tables, tokens_per_page,
                     group_params, buffer_params};
  run(a, check_resolve_groups(a));
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CPU, m) {
  m.impl("resolve_groups", &resolve_groups<run_groups_cpu>);
}
#ifdef TORCH_KVCM2_WITH_CUDA
TORCH_LIBRARY_IMPL(torch_kvcm2, CUDA, m) {
  m.impl("resolve_groups", &resolve_groups<run_groups_cuda>);
}
#endif

}  // namespace torch_kvcm2
