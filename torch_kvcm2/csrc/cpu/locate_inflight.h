// The in-flight slot records of one row, CPU side: written by resolve (cpu/resolve.cpp) after each
// row and by locate_inflight (cpu/locate_inflight.cpp) from residency alone; write_indices and
// flush read them through inflight_slot (kvcm2.h).
#pragma once

#include <algorithm>
#include <cstdint>

#include "../kvcm2.h"

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

}  // namespace torch_kvcm2
