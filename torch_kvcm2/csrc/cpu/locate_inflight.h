// The in-flight slot records of one row, CPU side: written by resolve (cpu/resolve.cpp) after each
// row and by locate_inflight (cpu/locate_inflight.cpp) from residency alone; write_indices (and
// resolve when it writes them too) and flush read them through inflight_slot (rules.h).
#pragma once

#include <algorithm>
#include <cstdint>

#include "../rules.h"

namespace torch_kvcm2 {

// One row's records from its lease's resident row: column k holds the lowest slot holding
// in-flight unit floor(s0/U) + k, BAD when none does.
inline void record_inflight(const int32_t* res, int64_t S, const RowRange& range, int32_t* slots,
                            int64_t miu) {
  std::fill(slots, slots + miu, BAD);
  for (int64_t s = S - 1; s >= 0; --s) {  // descending: the lowest slot writes last
    const int64_t k = res[s] - range.first_inflight_unit();
    if (res[s] != BAD && range.inflight(res[s]) && k < miu) slots[k] = static_cast<int32_t>(s);
  }
}

// One seated row's write indices (OP-WRITE) from its records: token s0 + j goes to cell token
// index out[j] ((l*S + slot)*U + t mod U), BAD past capacity and where its unit has no slot.
// Returns s0.
inline int32_t write_row(const int32_t* res, int64_t S, int64_t l, const RowRange& range,
                         const int32_t* slots, int64_t miu, int32_t* out, int64_t width) {
  const int64_t U = range.tokens_per_unit;
  std::fill(out, out + width, BAD);
  for (int64_t j = 0; j < width && range.inflight_start + j < range.capacity; ++j) {
    const int64_t t = range.inflight_start + j;
    const int64_t slot = inflight_slot(range, t / U, slots, miu, res, S);
    if (slot != BAD) out[j] = static_cast<int32_t>((l * S + slot) * U + t % U);
  }
  return static_cast<int32_t>(range.inflight_start);
}

}  // namespace torch_kvcm2
