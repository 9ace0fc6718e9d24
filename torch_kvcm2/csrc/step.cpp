// OP-STEP: one selection group's part of a decode step in one call -- resolve with the write
// indices of its in-flight tokens (resolve's optional outputs: on CUDA computed by the resolve
// kernel itself), then the fetch of the given buffers' misses. Both parts run their backend's
// kernels (through the dispatcher, below the autograd and inplace-or-view keys), so the results
// are those of resolve, write_indices and fetch called in that order, bit for bit, on CPU and
// CUDA alike. What it saves is host time: one call from Python instead of three
// (docs/HOST_PATH.md). Every argument is checked before any part runs, so a bad one changes
// nothing.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <limits>
#include <optional>
#include <vector>

#include "kvcm2.h"

namespace torch_kvcm2 {
namespace {

using T = const at::Tensor&;
using Opt = const std::optional<at::Tensor>&;
using ResolveFn = void(T, T, T, T, T, T, T, T, T, T, T, int64_t, int64_t, int64_t, int64_t, Opt,
                       Opt, Opt);
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
  check_resolve_write(write_table, write_start, selected, resident, inflight_slots, history,
                      capacity, lease, tokens_per_unit, max_inflight_tokens);
  if (!cells.empty())
    check_fetch(cells, host_pools, positions, page_tables, miss_list, miss_count,
                resident.size(1), tokens_per_unit);
  else
    TORCH_CHECK(host_pools.empty() && positions.empty() && page_tables.empty(),
                "resolve_step: no cells, so no host pools, positions or page tables either");
  static const auto resolve = handle<ResolveFn>("torch_kvcm2::resolve");
  static const auto fetch = handle<FetchFn>("torch_kvcm2::fetch");
  // The parts are this op's implementation, not calls of their own: straight to the backend.
  const c10::impl::ExcludeDispatchKeyGuard below(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
  resolve.call(resident, recency, index_table, miss_list, miss_count, counters, inflight_slots,
               selected, history, capacity, lease, tokens_per_unit, tokens_per_page,
               max_inflight_tokens, window, scratch, write_table, write_start);
  if (!cells.empty())
    fetch.call(cells, host_pools, positions, page_tables, miss_list, miss_count, resident.size(1),
               tokens_per_unit);
}

// A batch's resolve_step arguments, bound once per selection group, and its flush's and
// advance's (Batch, eagerly: an op call's host cost is mostly its argument parsing and checks,
// benchmarks/op_call_cost.py). resolve_bound(group, selected, fetch) is resolve_step with the
// group's bound tensors and, with fetch, every layer of the group fetched; flush_bound(targets)
// the flush of every pool group and its watermark; advance_bound(accepted) the advance of the
// bound lengths. On CUDA the kernel launches of each are recorded once (their checks and
// parameters done) and made again with the selection's, targets' or counts' address, so a call
// costs its launches only. Each returns false, having done nothing, for a tensor unlike the
// bound one (the caller checks it and calls the op). Its mutations are not visible to
// torch.compile: compiled code calls the ops.
#ifdef TORCH_KVCM2_WITH_CUDA
using Recorded = std::shared_ptr<RecordedLaunches>;
#else
struct Recorded {};  // a CPU build records nothing
#endif

struct StepPlan : torch::CustomClassHolder {
  // record_launches false: every call goes through the ops (tests compare the two).
  explicit StepPlan(bool record_launches) : record(record_launches) {}
  struct Group {
    std::vector<at::Tensor> state;  // resident .. write_start (9), history, capacity, lease
    std::optional<at::Tensor> scratch;
    std::vector<at::Tensor> cells, pools, tables;
    std::vector<int64_t> positions;
    int64_t tokens_per_unit, tokens_per_page, max_inflight_tokens, window;
    Recorded bare, fetched;  // resolve_step without, with the fetch
  };
  std::vector<Group> groups;
  // flush's arguments per sparse pool group, then flush_watermark's (Batch.flush)
  struct Flush {
    at::Tensor pool, page_table;
    std::vector<int64_t> positions, params;
    std::vector<at::Tensor> cells, resident, inflight_slots;
  };
  std::vector<Flush> flushes;
  std::vector<at::Tensor> lengths;  // written, declared, history, capacity, lease
  std::vector<int64_t> shapes;

  int64_t add_group(std::vector<at::Tensor> state, std::optional<at::Tensor> scratch,
                    std::vector<at::Tensor> cells, std::vector<at::Tensor> pools,
                    std::vector<int64_t> positions, std::vector<at::Tensor> tables,
                    int64_t tokens_per_unit, int64_t tokens_per_page, int64_t max_inflight_tokens,
                    int64_t window) {
    TORCH_CHECK(state.size() == 12, "StepPlan.add_group: 12 state tensors, got ", state.size());
    TORCH_CHECK(cells.size() == pools.size() && cells.size() == positions.size() &&
                    cells.size() == tables.size(),
                "StepPlan.add_group: one pool, position and page table per cell tensor");
    Group g{std::move(state), std::move(scratch), std::move(cells), std::move(pools),
            std::move(tables), std::move(positions), tokens_per_unit, tokens_per_page,
            max_inflight_tokens, window};
#ifdef TORCH_KVCM2_WITH_CUDA
    const at::Tensor& index_table = g.state[2];
    if (record && index_table.is_cuda() && index_table.dim() == 2) {
      g.bare = RecordedLaunches::record([&](T selected) { run(g, selected, false); }, index_table);
      g.fetched = RecordedLaunches::record([&](T selected) { run(g, selected, true); }, index_table);
    }
#endif
    groups.push_back(std::move(g));
    return static_cast<int64_t>(groups.size()) - 1;
  }

  void add_flush(at::Tensor pool, std::vector<int64_t> positions, std::vector<at::Tensor> cells,
                 std::vector<at::Tensor> resident, std::vector<at::Tensor> inflight_slots,
                 at::Tensor page_table, std::vector<int64_t> params) {
    TORCH_CHECK(lengths.empty(), "StepPlan.add_flush: every flush before set_watermark");
    flushes.push_back(Flush{std::move(pool), std::move(page_table), std::move(positions),
                            std::move(params), std::move(cells), std::move(resident),
                            std::move(inflight_slots)});
  }

  void set_watermark(std::vector<at::Tensor> tensors, std::vector<int64_t> shape_pairs) {
    TORCH_CHECK(tensors.size() == 5, "StepPlan.set_watermark: 5 tensors, got ", tensors.size());
    lengths = std::move(tensors);
    shapes = std::move(shape_pairs);
#ifdef TORCH_KVCM2_WITH_CUDA
    const at::Tensor& history = lengths[2];
    if (record && history.is_cuda() && history.dim() == 1) {
      flushed = RecordedLaunches::record([&](T target) { run_flush(target); }, history);
    }
#endif
  }

  // Batch.resolve's eager path: resolve_step of group `group` with the bound arguments and
  // `selected`, with the fetch of every layer of the group or without, when the selection has
  // the bound shape (int32 [rows, K], contiguous, on the bound device): through the recorded
  // launches when it matches them, else through the ops. False, and nothing done, for any other
  // selection (the caller checks it and calls the op).
  bool resolve_bound(int64_t group, const at::Tensor& selected, bool fetch) {
    TORCH_CHECK(group >= 0 && group < static_cast<int64_t>(groups.size()),
                "StepPlan.resolve_bound: no group ", group);
    const Group& g = groups[group];
    return bound_call(fetch ? g.fetched : g.bare, selected, g.state[2],  // the index table's shape
                      [&] { run(g, selected, fetch); });
  }

  // Batch.flush's eager path, for targets new_history like the bound history: every pool
  // group's flush, then the watermark (add_flush before set_watermark); false, and nothing
  // done, for other targets.
  bool flush_bound(const at::Tensor& new_history) {
    TORCH_CHECK(lengths.size() == 5, "StepPlan.flush_bound: set_watermark first");
    return bound_call(flushed, new_history, lengths[2], [&] { run_flush(new_history); });
  }

  // Batch.advance's eager path, for accepted counts like the bound history: the advance op
  // on the bound lengths and counters; false, and nothing done, for other counts.
  bool advance_bound(const at::Tensor& accepted) {
    TORCH_CHECK(advance_state.size() == 2, "StepPlan.advance_bound: set_advance first");
    return bound_call(advanced, accepted, lengths[2], [&] { run_advance(accepted); });
  }

  // The module functions' half (plan_call below): the recorded launches of a bound call with
  // the data at `address`, whose tensor the caller has found like the bound one (dtype, device,
  // shape, contiguity); false, and nothing done, without a recording or for an address not
  // 16-byte aligned (the caller then takes the bound call above).
  bool resolve_at(int64_t group, void* address, bool fetch) {
    TORCH_CHECK(group >= 0 && group < static_cast<int64_t>(groups.size()),
                "StepPlan.resolve_at: no group ", group);
    const Group& g = groups[group];
    return launch_at(fetch ? g.fetched : g.bare, address);
  }
  bool flush_at(void* address) { return launch_at(flushed, address); }
  bool advance_at(void* address) { return launch_at(advanced, address); }

  // This plan's address, for the module functions (Batch holds the plan while it uses them).
  int64_t address() { return reinterpret_cast<int64_t>(this); }

  // How many of the bound calls make recorded launches (tests: 0 on CPU; on CUDA two per
  // group, the flush and the advance).
  int64_t recordings() const {
#ifdef TORCH_KVCM2_WITH_CUDA
    int64_t n = (flushed != nullptr) + (advanced != nullptr);
    for (const Group& g : groups) n += (g.bare != nullptr) + (g.fetched != nullptr);
    return n;
#else
    return 0;
#endif
  }

  void set_advance(at::Tensor lengths_table, at::Tensor counters) {
    TORCH_CHECK(lengths.size() == 5, "StepPlan.set_advance: set_watermark first");
    advance_state = {std::move(lengths_table), std::move(counters)};
#ifdef TORCH_KVCM2_WITH_CUDA
    const at::Tensor& history = lengths[2];
    if (record && history.is_cuda()) {
      advanced = RecordedLaunches::record([&](T accepted) { run_advance(accepted); }, history);
    }
#endif
  }

 private:
  bool record;
  std::vector<at::Tensor> advance_state;  // the lengths table [6, rows] and counters
  Recorded flushed, advanced;

  void run_advance(const at::Tensor& accepted) {
    static const auto op = handle<void(T, T, T)>("torch_kvcm2::advance");
    const c10::impl::ExcludeDispatchKeyGuard below(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
    op.call(advance_state[0], advance_state[1], accepted);
  }

  static bool launch_at(const Recorded& recorded, void* address) {
#ifdef TORCH_KVCM2_WITH_CUDA
    return recorded && recorded->launch_at(address);
#else
    (void)recorded, (void)address;
    return false;
#endif
  }

  // A bound call with tensor `t`: through the recorded launches when `t` matches them, else
  // through `ops` when `t` is like `bound` (dtype, device, shape, contiguous); false otherwise.
  template <typename Ops>
  static bool bound_call(const Recorded& recorded, const at::Tensor& t, const at::Tensor& bound,
                         const Ops& ops) {
#ifdef TORCH_KVCM2_WITH_CUDA
    if (recorded && recorded->matches(t)) {
      recorded->launch(t);
      return true;
    }
#endif
    if (!t.defined() || t.scalar_type() != bound.scalar_type() || t.device() != bound.device() ||
        t.sizes() != bound.sizes() || !t.is_contiguous())
      return false;
    ops();
    return true;
  }

  // The ops through the dispatcher (each checks its arguments first).
  void run_flush(const at::Tensor& new_history) {
    using FlushFn = void(T, at::IntArrayRef, const at::TensorList&, const at::TensorList&,
                         const at::TensorList&, T, T, T, T, T, at::IntArrayRef);
    using WatermarkFn = void(T, T, T, T, T, T, at::IntArrayRef);
    static const auto flush_op = handle<FlushFn>("torch_kvcm2::flush");
    static const auto watermark = handle<WatermarkFn>("torch_kvcm2::flush_watermark");
    const c10::impl::ExcludeDispatchKeyGuard below(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
    const std::vector<at::Tensor>& w = lengths;
    for (const Flush& f : flushes)
      flush_op.call(f.pool, f.positions, f.cells, f.resident, f.inflight_slots, f.page_table,
                    new_history, w[2], w[3], w[4], f.params);
    watermark.call(w[0], w[1], new_history, w[2], w[3], w[4], shapes);
  }

  static void run(const Group& g, const at::Tensor& selected, bool fetch) {
    const std::vector<at::Tensor>& s = g.state;
    const std::vector<at::Tensor> none;
    const std::vector<int64_t> no_positions;
    resolve_step(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], fetch ? g.cells : none,
                 selected, s[9], s[10], s[11], fetch ? g.pools : none,
                 fetch ? g.positions : no_positions, fetch ? g.tables : none, g.tokens_per_unit,
                 g.tokens_per_page, g.max_inflight_tokens, g.window, g.scratch);
  }
};

// The eager step's calls from Python without a torch.classes method call (whose argument
// parsing costs about as much as a launch): torch_kvcm2._C.plan_resolve(plan, group, address,
// fetch), plan_flush(plan, address) and plan_advance(plan, address), with `plan` a StepPlan's
// address() and `address` the data of a tensor the caller has checked is like the bound one
// (Batch: dtype, device, shape, contiguity). Each returns True when the recorded launches were
// made, False when nothing was done.
enum class Call { resolve, flush, advance };

// Python ints to C++ values: false, with the Python exception set, for one that is not an int
// or out of range.
bool to_cpp(PyObject* o, long long& value) {
  value = PyLong_AsLongLong(o);
  return !PyErr_Occurred();
}
bool to_cpp(PyObject* o, void*& value) {
  value = PyLong_AsVoidPtr(o);
  return !PyErr_Occurred();
}

// `done()`'s bool as a Python bool, or a RuntimeError with the C++ exception's message.
template <typename Done>
PyObject* python_bool(const Done& done) {
  try {
    return PyBool_FromLong(done());
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

template <Call call>
PyObject* plan_call(PyObject*, PyObject* const* args, Py_ssize_t n) {
  constexpr bool resolve = call == Call::resolve;
  if (n != (resolve ? 4 : 2)) {
    PyErr_SetString(PyExc_TypeError, resolve ? "plan_resolve(plan, group, address, fetch)"
                                             : "plan_flush / plan_advance(plan, address)");
    return nullptr;
  }
  void *plan = nullptr, *address = nullptr;
  long long group = 0;
  int fetch = 0;
  if (!to_cpp(args[0], plan) || !to_cpp(args[resolve ? 2 : 1], address)) return nullptr;
  if (resolve && (!to_cpp(args[1], group) || (fetch = PyObject_IsTrue(args[3])) < 0))
    return nullptr;
  if (plan == nullptr) {
    PyErr_SetString(PyExc_ValueError, "plan 0 is not a StepPlan's address");
    return nullptr;
  }
  auto* p = static_cast<StepPlan*>(plan);
  return python_bool([&] {
    if constexpr (call == Call::resolve) return p->resolve_at(group, address, fetch != 0);
    if constexpr (call == Call::flush) return p->flush_at(address);
    if constexpr (call == Call::advance) return p->advance_at(address);
  });
}

// torch_kvcm2._C.readback(device, src, dst, bytes, event): readback() of kvcm2.h (Batch.advance
// and record_advance on CUDA, with the batch's lengths, a pinned buffer of its ring and that
// buffer's event); True when queued, False while the stream is capturing.
PyObject* readback_call(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 5) {
    PyErr_SetString(PyExc_TypeError, "readback(device, src, dst, bytes, event)");
    return nullptr;
  }
  long long device = 0, bytes = 0;
  void *src = nullptr, *dst = nullptr, *event = nullptr;
  if (!to_cpp(args[0], device) || !to_cpp(args[1], src) || !to_cpp(args[2], dst) ||
      !to_cpp(args[3], bytes) || !to_cpp(args[4], event))
    return nullptr;
  if (src == nullptr || dst == nullptr || event == nullptr || bytes < 0 || device < 0 ||
      device >= std::numeric_limits<c10::DeviceIndex>::max()) {
    PyErr_SetString(PyExc_ValueError,
                    "readback: null address or event, negative size or device out of range");
    return nullptr;
  }
#ifdef TORCH_KVCM2_WITH_CUDA
  return python_bool([&] {
    return readback(static_cast<int>(device), src, dst, static_cast<size_t>(bytes), event);
  });
#else
  PyErr_SetString(PyExc_RuntimeError, "readback: this build has no CUDA kernels");
  return nullptr;
#endif
}

template <PyObject* (*fn)(PyObject*, PyObject* const*, Py_ssize_t)>
PyCFunction fastcall() {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn));
}

}  // namespace

PyMethodDef* step_plan_methods() {
  static PyMethodDef methods[] = {
      {"plan_resolve", fastcall<plan_call<Call::resolve>>(), METH_FASTCALL,
       "A StepPlan's recorded resolve_step of a group (Batch.resolve's eager path)."},
      {"plan_flush", fastcall<plan_call<Call::flush>>(), METH_FASTCALL,
       "A StepPlan's recorded flush and watermark (Batch.flush's eager path)."},
      {"plan_advance", fastcall<plan_call<Call::advance>>(), METH_FASTCALL,
       "A StepPlan's recorded advance (Batch.advance's eager path)."},
      {"readback", fastcall<readback_call>(), METH_FASTCALL,
       "The lengths' read-back copy and its event (Batch.advance, record_advance on CUDA)."},
      {nullptr, nullptr, 0, nullptr}};
  return methods;
}

TORCH_LIBRARY_FRAGMENT(torch_kvcm2, m) {
  m.class_<StepPlan>("StepPlan")
      .def(torch::init<bool>())
      .def("add_group", &StepPlan::add_group)
      .def("add_flush", &StepPlan::add_flush)
      .def("set_watermark", &StepPlan::set_watermark)
      .def("resolve_bound", &StepPlan::resolve_bound)
      .def("flush_bound", &StepPlan::flush_bound)
      .def("set_advance", &StepPlan::set_advance)
      .def("advance_bound", &StepPlan::advance_bound)
      .def("recordings", &StepPlan::recordings)
      .def("address", &StepPlan::address);
}

TORCH_LIBRARY_IMPL(torch_kvcm2, CPU, m) { m.impl("resolve_step", &resolve_step); }
#ifdef TORCH_KVCM2_WITH_CUDA
TORCH_LIBRARY_IMPL(torch_kvcm2, CUDA, m) { m.impl("resolve_step", &resolve_step); }
#endif

}  // namespace torch_kvcm2
