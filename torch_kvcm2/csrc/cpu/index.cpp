// CPU kernels of OP-INDEX: the executable semantics, plain loops.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../checks.h"
#include "../rules.h"

namespace torch_kvcm2 {
namespace {

void convert_page_indices_cpu(const at::Tensor& out, const at::Tensor& page_table,
                              const at::Tensor& capacity, int64_t scale, int64_t pos,
                              int64_t units_per_page, int64_t tokens_per_unit) {
  check_convert_page_indices(out, page_table, capacity, scale, pos, units_per_page,
                             tokens_per_unit);
  const int64_t rows = out.size(0), width = out.size(1), pages = page_table.size(1);
  const int32_t* table = page_table.data_ptr<int32_t>();
  const int32_t* cap = capacity.data_ptr<int32_t>();
  int32_t* dst = out.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t units = ceil_div(std::max<int64_t>(cap[r], 0), tokens_per_unit);
    for (int64_t j = 0; j < width; ++j) {
      const int64_t p = j / units_per_page;
      int32_t v = BAD;
      if (j < units && p < pages) {
        const int64_t slot = table[r * pages + p];
        if (slot >= 0) {
          const int64_t unit = (slot * scale + pos) * units_per_page + j % units_per_page;
          v = unit <= INT32_MAX ? static_cast<int32_t>(unit) : BAD;
        }
      }
      dst[r * width + j] = v;
    }
  }
}

void convert_token_indices_cpu(const at::Tensor& out, const at::Tensor& selected,
                               const at::Tensor& page_table, const at::Tensor& capacity,
                               int64_t scale, int64_t pos, int64_t tokens_per_page) {
  check_convert_token_indices(out, selected, page_table, capacity, scale, pos, tokens_per_page);
  const int64_t rows = selected.size(0), width = selected.size(1), pages = page_table.size(1);
  const int32_t* sel = selected.data_ptr<int32_t>();
  const int32_t* table = page_table.data_ptr<int32_t>();
  const int32_t* cap = capacity.data_ptr<int32_t>();
  int32_t* dst = out.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < width; ++j) {
      const int64_t t = sel[r * width + j];
      const int64_t p = t / tokens_per_page;
      int32_t v = BAD;
      if (t >= 0 && t < cap[r] && p < pages) {
        const int64_t slot = table[r * pages + p];
        if (slot >= 0) {
          const int64_t token = (slot * scale + pos) * tokens_per_page + t % tokens_per_page;
          v = token <= INT32_MAX ? static_cast<int32_t>(token) : BAD;
        }
      }
      dst[r * width + j] = v;
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CPU, m) {
  m.impl("convert_page_indices", &convert_page_indices_cpu);
  m.impl("convert_token_indices", &convert_token_indices_cpu);
}

}  // namespace torch_kvcm2
