// CPU kernel of HOST-3's length advance (Batch.advance): advance_row of kvcm2.h per seated row.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../kvcm2.h"

namespace torch_kvcm2 {
namespace {

void advance_cpu(const at::Tensor& lengths, const at::Tensor& counters,
                 const at::Tensor& accepted) {
  check_advance(lengths, counters, accepted);
  const int64_t rows = lengths.size(1);
  int32_t* L = lengths.data_ptr<int32_t>();
  int32_t* h = L + kHistory * rows;
  int32_t* c = L + kCapacity * rows;
  const int32_t* lease = L + kLease * rows;
  const int32_t* written = L + kWritten * rows;
  const int32_t* allocated = L + kAllocated * rows;
  const int32_t* a = accepted.data_ptr<int32_t>();
  int64_t refused = 0, short_rows = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (lease[r] < 0) continue;
    const int outcome = advance_row(h[r], c[r], written[r], allocated[r], a[r]);
    refused += outcome == 1;
    short_rows += outcome == 2;
  }
  int64_t* n = counters.data_ptr<int64_t>();
  n[0] += refused;
  n[1] += short_rows;
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CPU, m) { m.impl("advance", &advance_cpu); }

}  // namespace torch_kvcm2
