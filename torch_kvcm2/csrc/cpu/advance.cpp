// CPU kernels of the per-row bookkeeping ops: HOST-3's length advance (Batch.advance, advance_row
// of rules.h per seated row) and the residency clear of leases that changed owner (Batch.publish).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../checks.h"
#include "../rules.h"

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

void clear_leases_cpu(const at::TensorList& resident, const at::TensorList& recency,
                      const at::Tensor& leases) {
  check_clear_leases(resident, recency, leases);
  const int64_t* l = leases.data_ptr<int64_t>();
  for (size_t g = 0; g < resident.size(); ++g) {
    const int64_t rows = resident[g].size(0), S = resident[g].size(1);
    int32_t* res = resident[g].data_ptr<int32_t>();
    int32_t* rec = recency[g].data_ptr<int32_t>();
    for (int64_t i = 0; i < leases.size(0); ++i) {
      if (l[i] < 0 || l[i] >= rows) continue;
      for (int64_t s = 0; s < S; ++s) {
        res[l[i] * S + s] = BAD;
        rec[l[i] * S + s] = static_cast<int32_t>(s);
      }
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CPU, m) {
  m.impl("advance", &advance_cpu);
  m.impl("clear_leases", &clear_leases_cpu);
}

}  // namespace torch_kvcm2
