"""Host cost of one op call by the shape of its arguments: an op with ``resolve_step``'s 22
arguments (14 tensors, three lists of 4 tensors), the same with empty lists, an op of two
arguments, a ``torch.classes`` method of two arguments, and ``x.add_(1)``; the probe ops'
kernels do nothing, so the times are argument parsing and dispatch. Builds a small probe
extension with ``torch.utils.cpp_extension.load_inline`` (a C++ compiler and ninja, about a
minute); CPU tensors. ``python benchmarks/op_call_cost.py [calls]`` prints median µs per call."""
import sys

import torch
from torch.utils.cpp_extension import load_inline

from harness import median_call_us

SOURCE = r"""
#include <torch/custom_class.h>
#include <torch/library.h>
#include <vector>
namespace {
struct Plan : torch::CustomClassHolder {
  std::vector<at::Tensor> bound;
  explicit Plan(std::vector<at::Tensor> b) : bound(std::move(b)) {}
  int64_t run(const at::Tensor& selected, int64_t group) {
    return selected.size(0) + group + static_cast<int64_t>(bound.size());
  }
};
using T = const at::Tensor&;
void many(T, T, T, T, T, T, T, T, T, const at::TensorList&, T, T, T, T, const at::TensorList&,
          at::IntArrayRef, const at::TensorList&, int64_t, int64_t, int64_t, int64_t,
          const std::optional<at::Tensor>&) {}
void two(T, int64_t) {}
}  // namespace
TORCH_LIBRARY(kvcm2_call_cost, m) {
  m.class_<Plan>("Plan").def(torch::init<std::vector<at::Tensor>>()).def("run", &Plan::run);
  m.def("many(Tensor(a!) a, Tensor(b!) b, Tensor(c!) c, Tensor(d!) d, Tensor(e!) e, "
        "Tensor(f!) f, Tensor(g!) g, Tensor(h!) h, Tensor(i!) i, Tensor(j!)[] cells, Tensor sel, "
        "Tensor hist, Tensor cap, Tensor lease, Tensor[] pools, int[] pos, Tensor[] tables, "
        "int u, int p, int m, int w, Tensor(k!)? s=None) -> ()");
  m.def("two(Tensor sel, int g) -> ()");
}
TORCH_LIBRARY_IMPL(kvcm2_call_cost, CPU, m) {
  m.impl("many", &many);
  m.impl("two", &two);
}
"""


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    load_inline("kvcm2_call_cost", cpp_sources=[SOURCE], is_python_module=False)
    t = [torch.zeros(4, 4, dtype=torch.int32) for _ in range(14)]
    cells = [torch.zeros(8, dtype=torch.uint8) for _ in range(4)]
    many, two = torch.ops.kvcm2_call_cost.many.default, torch.ops.kvcm2_call_cost.two.default
    full = (*t[:9], cells, *t[9:13], [t[13]] * 4, [0, 1, 2, 3], [t[0]] * 4, 1, 64, 16, 0, None)
    bare = (*t[:9], [], *t[9:13], [], [], [], 1, 64, 16, 0, None)
    plan = torch.classes.kvcm2_call_cost.Plan(t)
    assert plan.run(t[0], 3) == 4 + 3 + 14, "the class method did not run"
    x = torch.zeros(4)
    rows = [("op, 22 arguments (lists of 4 tensors)", lambda: many(*full)),
            ("op, 22 arguments, empty lists", lambda: many(*bare)),
            ("op, 2 arguments", lambda: two(t[0], 1)),
            ("torch.classes method, 2 arguments", lambda: plan.run(t[0], 1)),
            ("x.add_(1)", lambda: x.add_(1))]
    for label, fn in rows:
        print(f"{label:42s} {median_call_us(fn, calls, calls // 20):6.2f} us")
    assert bool((x == x[0]).all()) and float(x[0]) > 0, "x.add_ did not run"


if __name__ == "__main__":
    main()
