// CPU kernel of OP-RESOLVE: the executable semantics of REQUIREMENTS §7-8, simple loops over rows,
// columns and slots. The CUDA kernel (cuda/resolve.cu) must reproduce this state bit for bit.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <unordered_map>
#include <vector>

#include "../checks.h"
#include "../rules.h"
#include "locate_inflight.h"

namespace torch_kvcm2 {
namespace {

struct GroupCounters {
  int64_t hits = 0, misses = 0, invalid = 0;
};

// Resolves one seated row; returns nothing, appends to the miss list at *count.
void resolve_row(int32_t* res, int32_t* rec, int32_t* out, const int32_t* sel, int64_t K,
                 int64_t S, int64_t lease, int64_t row, const RowRange& range, int32_t* miss_list,
                 int32_t* count, GroupCounters& counters) {
  // Bad device data: a recency entry outside [0, S) stands for its own position (as on CUDA).
  for (int64_t q = 0; q < S; ++q)
    if (rec[q] < 0 || rec[q] >= S) rec[q] = static_cast<int32_t>(q);
  // Step 0: drop resident units that are no longer selectable.
  for (int64_t s = 0; s < S; ++s)  // (a negative unit other than BAD is bad data: dropped too)
    if (res[s] != BAD && !range.selectable(res[s])) res[s] = BAD;

  std::unordered_map<int64_t, int64_t> slot_of;  // unit -> slot, after this call's admissions
  for (int64_t s = 0; s < S; ++s)
    if (res[s] >= 0) slot_of.emplace(res[s], s);

  std::vector<uint8_t> cls(S, kUntouched);
  std::vector<uint8_t> hit(S, 0);

  // Step 1 (first half): in-flight units already resident are pinned; the rest await a slot.
  std::vector<int64_t> admits;
  for (int64_t u = range.first_inflight_unit(); u < range.end_inflight_unit(); ++u) {
    auto it = slot_of.find(u);
    if (it != slot_of.end()) cls[it->second] = kPinned;
    else admits.push_back(u);
  }

  // Step 2: classify distinct selected ordinals in first-occurrence order.
  std::unordered_map<int64_t, bool> seen;
  std::vector<int64_t> misses;
  for (int64_t j = 0; j < K; ++j) {
    const int64_t u = sel[j];
    if (u < 0 || !seen.emplace(u, true).second) continue;  // padding, or a duplicate
    if (!range.selectable(u)) {
      ++counters.invalid;
    } else if (slot_of.count(u)) {
      ++counters.hits;
      hit[slot_of[u]] = 1;
    } else if (range.inflight(u)) {
      ++counters.hits;  // admitted below; in-flight units are never fetched for a selection
    } else {
      misses.push_back(u);
    }
  }

  // Step 3: victims: empty slots, then slots neither hit nor pinned, each least recent first.
  std::vector<int64_t> victims;
  for (int64_t q = 0; q < S; ++q)
    if (res[rec[q]] == BAD) victims.push_back(rec[q]);
  for (int64_t q = 0; q < S; ++q) {
    const int64_t s = rec[q];
    if (res[s] != BAD && !hit[s] && cls[s] == kUntouched) victims.push_back(s);
  }
  size_t next = 0;
  auto place = [&](int64_t u, uint8_t c, bool fetch) {
    if (next == victims.size()) return false;
    const int64_t s = victims[next++];
    if (res[s] != BAD) slot_of.erase(res[s]);
    res[s] = static_cast<int32_t>(u);
    slot_of[u] = s;
    cls[s] = c;
    if (fetch) {
      int32_t* e = miss_list + static_cast<int64_t>(*count) * kMissFields;
      e[kMissLease] = static_cast<int32_t>(lease);
      e[kMissSlot] = static_cast<int32_t>(s);
      e[kMissRow] = static_cast<int32_t>(row);
      e[kMissUnit] = static_cast<int32_t>(u);
      ++*count;
    }
    return true;
  };
  for (int64_t u : admits)
    if (!place(u, kPinned, range.needs_fetch_on_admit(u))) ++counters.invalid;
  for (int64_t u : misses) {
    if (place(u, kMissed, true)) ++counters.misses;
    else ++counters.invalid;  // no slot left: only possible with bad input
  }

  // Step 5: the index table; selected units resident now are the row's hits for recency.
  for (int64_t j = 0; j < K; ++j) {
    const int64_t u = sel[j];
    auto it = (u >= 0 && range.selectable(u)) ? slot_of.find(u) : slot_of.end();
    if (it == slot_of.end()) {
      out[j] = BAD;
      continue;
    }
    out[j] = static_cast<int32_t>(lease * S + it->second);
    if (cls[it->second] != kMissed) cls[it->second] = kHit;
  }

  // Step 4: recency = untouched, misses, pinned, hits; each class in its previous order.
  std::vector<int32_t> order;
  order.reserve(S);
  for (int c = 0; c < kNumClasses; ++c)
    for (int64_t q = 0; q < S; ++q)
      if (cls[rec[q]] == c) order.push_back(rec[q]);
  std::memcpy(rec, order.data(), S * sizeof(int32_t));
}

void resolve_cpu(const at::Tensor& resident, const at::Tensor& recency,
                 const at::Tensor& index_table, const at::Tensor& miss_list,
                 const at::Tensor& miss_count, const at::Tensor& counters,
                 const at::Tensor& inflight_slots, const at::Tensor& selected,
                 const at::Tensor& history, const at::Tensor& capacity, const at::Tensor& lease,
                 int64_t tokens_per_unit, int64_t tokens_per_page, int64_t max_inflight_tokens,
                 int64_t window, const std::optional<at::Tensor>& /*scratch: CUDA's only*/,
                 const std::optional<at::Tensor>& write_table,
                 const std::optional<at::Tensor>& write_start, int64_t sinks) {
  check_resolve(resident, recency, index_table, miss_list, miss_count, counters, inflight_slots,
                selected, history, capacity, lease, tokens_per_unit, tokens_per_page,
                max_inflight_tokens, window, sinks);
  const bool writes = check_resolve_write(write_table, write_start, selected, resident,
                                          inflight_slots, history, capacity, lease,
                                          tokens_per_unit, max_inflight_tokens);
  const int64_t width = writes ? write_table->size(1) : 0;
  int32_t* const write = writes ? write_table->data_ptr<int32_t>() : nullptr;
  int32_t* const start = writes ? write_start->data_ptr<int32_t>() : nullptr;
  const int64_t miu = inflight_slots.size(1);
  int32_t* located = inflight_slots.data_ptr<int32_t>();
  // K: a row's columns over all its query tokens ([rows, T', K] is [rows, T'*K] in memory), the
  // width of the one selection their union is resolved as (MTP-3): duplicates across tokens are
  // duplicates within the row.
  const int64_t rows = selected.size(0);
  const int64_t K = selected.dim() == 3 ? selected.size(1) * selected.size(2) : selected.size(1);
  const int64_t leases = resident.size(0), S = resident.size(1);
  int32_t* res = resident.data_ptr<int32_t>();
  int32_t* rec = recency.data_ptr<int32_t>();
  int32_t* out = index_table.data_ptr<int32_t>();
  const int32_t* sel = selected.data_ptr<int32_t>();
  const int32_t* hist = history.data_ptr<int32_t>();
  const int32_t* cap = capacity.data_ptr<int32_t>();
  const int32_t* own = lease.data_ptr<int32_t>();
  int32_t* count = miss_count.data_ptr<int32_t>();
  *count = 0;
  GroupCounters c;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t l = own[r];
    if (l < 0 || l >= leases) {  // hole, suspended row, or a bad lease: touch no residency
      std::fill(out + r * K, out + (r + 1) * K, BAD);
      std::fill(located + r * miu, located + (r + 1) * miu, BAD);
      if (writes) {
        std::fill(write + r * width, write + (r + 1) * width, BAD);
        start[r] = BAD;
      }
      continue;
    }
    const RowRange range(hist[r], cap[r], tokens_per_unit, tokens_per_page, max_inflight_tokens,
                         window, sinks);
    resolve_row(res + l * S, rec + l * S, out + r * K, sel + r * K, K, S, l, r, range,
                miss_list.data_ptr<int32_t>(), count, c);
    record_inflight(res + l * S, S, range, located + r * miu, miu);  // after the row's resolve
    if (writes)  // as write_indices reads them next
      start[r] = write_row(res + l * S, S, l, range, located + r * miu, miu, write + r * width,
                           width);
  }
  int64_t* total = counters.data_ptr<int64_t>();
  total[kHits] += c.hits;
  total[kMisses] += c.misses;
  total[kInvalid] += c.invalid;
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CPU, m) { m.impl("resolve", &resolve_cpu); }

}  // namespace torch_kvcm2
