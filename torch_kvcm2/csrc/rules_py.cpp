// The length rules of rules.h as plain module functions of torch_kvcm2._C, for the parity test
// against the Python rules (tests/test_rules.py: torch_kvcm2/lengths.py, memory.py):
//   length_rules(h, c, written, declared, target, allocated, accepted, shapes) ->
//       (inflight starts per shape, host_direct_end, flushed_watermark, advance outcome,
//        advanced history, advanced capacity)
//     with shapes a sequence of (tokens_per_unit, max_inflight_tokens) pairs; the outcome is
//     advance_row's: 0 moved, 1 refused, 2 short.
//   length_row_order() -> {"HISTORY": 0, ..., "ALLOCATED": 5}, LengthRow's values.
//   window_rules(h, c, U, P, I, window, sinks, units) -> (sink_pages, first_live_page,
//       (RowRange::selectable(u) for u in units)): the pages a windowed life cycle keeps and
//       what one row may select (TIER-3).
// Every length is an int32 (device data); tokens_per_unit >= 1; a non-int argument raises
// TypeError, one out of range OverflowError or ValueError.
#include <Python.h>

#include <cstdint>
#include <limits>

#include "rules.h"

namespace torch_kvcm2 {
namespace {

// A Python int (not a bool) in [lo, hi] as `value`: false, with TypeError, OverflowError or
// ValueError set, otherwise.
bool int_arg(PyObject* o, const char* name, int64_t lo, int64_t hi, int64_t& value) {
  if (!PyLong_Check(o) || PyBool_Check(o)) {
    PyErr_Format(PyExc_TypeError, "length_rules: %s must be an int", name);
    return false;
  }
  const long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) return false;
  if (v < lo || v > hi) {
    PyErr_Format(PyExc_ValueError, "length_rules: %s = %lld is outside [%lld, %lld]", name, v,
                 static_cast<long long>(lo), static_cast<long long>(hi));
    return false;
  }
  value = v;
  return true;
}

constexpr int64_t kInt32Min = std::numeric_limits<int32_t>::min();
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// shapes as int64[2 * pairs] (at most kMaxWatermarkShapes pairs, as flush_watermark takes).
bool shapes_arg(PyObject* o, int64_t (&shapes)[2 * kMaxWatermarkShapes], int64_t& pairs) {
  const Py_ssize_t n = PySequence_Check(o) ? PySequence_Size(o) : -1;
  if (n < 0) {
    PyErr_Clear();
    PyErr_SetString(PyExc_TypeError, "length_rules: shapes must be a sequence of (U, I) pairs");
    return false;
  }
  if (n > kMaxWatermarkShapes) {
    PyErr_Format(PyExc_ValueError, "length_rules: at most %d shapes", kMaxWatermarkShapes);
    return false;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* pair = PySequence_GetItem(o, i);
    if (pair == nullptr) return false;
    bool ok = PySequence_Check(pair) && PySequence_Size(pair) == 2;
    if (!ok) {
      PyErr_Clear();
      PyErr_SetString(PyExc_TypeError, "length_rules: each shape must be a (U, I) pair");
    }
    for (int k = 0; ok && k < 2; ++k) {
      PyObject* item = PySequence_GetItem(pair, k);
      ok = item != nullptr && int_arg(item, k == 0 ? "tokens_per_unit" : "max_inflight_tokens",
                                      k == 0 ? 1 : 0, kInt32Max, shapes[2 * i + k]);
      Py_XDECREF(item);
    }
    Py_DECREF(pair);
    if (!ok) return false;
  }
  pairs = n;
  return true;
}

PyObject* length_rules(PyObject*, PyObject* const* args, Py_ssize_t n) {
  static const char* const names[] = {"h",         "c",        "written", "declared",
                                      "target",    "allocated", "accepted"};
  constexpr int kLengths = 7;
  if (n != kLengths + 1) {
    PyErr_SetString(PyExc_TypeError,
                    "length_rules(h, c, written, declared, target, allocated, accepted, shapes)");
    return nullptr;
  }
  int64_t v[kLengths];
  for (int i = 0; i < kLengths; ++i)
    if (!int_arg(args[i], names[i], kInt32Min, kInt32Max, v[i])) return nullptr;
  int64_t shapes[2 * kMaxWatermarkShapes];
  int64_t pairs = 0;
  if (!shapes_arg(args[kLengths], shapes, pairs)) return nullptr;
  const int64_t h = v[0], c = v[1], written = v[2], declared = v[3], target = v[4];
  PyObject* starts = PyTuple_New(pairs);
  if (starts == nullptr) return nullptr;
  for (int64_t i = 0; i < pairs; ++i)
    PyTuple_SetItem(starts, i, PyLong_FromLongLong(inflight_start(h, c, shapes[2 * i],
                                                                  shapes[2 * i + 1])));
  int32_t new_h = static_cast<int32_t>(h), new_c = static_cast<int32_t>(c);
  const int outcome = advance_row(new_h, new_c, static_cast<int32_t>(written),
                                  static_cast<int32_t>(v[5]), static_cast<int32_t>(v[6]));
  return Py_BuildValue("(NLLiii)", starts,
                       static_cast<long long>(host_direct_end(h, c, shapes, pairs)),
                       static_cast<long long>(
                           flushed_watermark(h, c, written, declared, target, shapes, pairs)),
                       outcome, new_h, new_c);
}

PyObject* length_row_order(PyObject*, PyObject* const*, Py_ssize_t n) {
  if (n != 0) {
    PyErr_SetString(PyExc_TypeError, "length_row_order() takes no arguments");
    return nullptr;
  }
  return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i,s:i}", "HISTORY", kHistory, "CAPACITY",
                       kCapacity, "LEASE", kLease, "WRITTEN", kWritten, "DECLARED", kDeclared,
                       "ALLOCATED", kAllocated, "ROWS", kLengthRows);
}

PyObject* window_rules(PyObject*, PyObject* const* args, Py_ssize_t n) {
  static const char* const names[] = {"h", "c", "tokens_per_unit", "tokens_per_page",
                                      "max_inflight_tokens", "window", "sinks"};
  static const int64_t lows[] = {kInt32Min, kInt32Min, 1, 1, 0, 0, 0};
  constexpr int kScalars = 7;
  if (n != kScalars + 1) {
    PyErr_SetString(PyExc_TypeError, "window_rules(h, c, U, P, I, window, sinks, units)");
    return nullptr;
  }
  int64_t v[kScalars];
  for (int i = 0; i < kScalars; ++i)
    if (!int_arg(args[i], names[i], lows[i], kInt32Max, v[i])) return nullptr;
  if (v[3] % v[2] != 0) {
    PyErr_SetString(PyExc_ValueError, "window_rules: tokens_per_unit must divide tokens_per_page");
    return nullptr;
  }
  PyObject* units = args[kScalars];
  const Py_ssize_t count = PySequence_Check(units) ? PySequence_Size(units) : -1;
  if (count < 0) {
    PyErr_Clear();
    PyErr_SetString(PyExc_TypeError, "window_rules: units must be a sequence of ints");
    return nullptr;
  }
  PyObject* selectable = PyTuple_New(count);
  const RowRange range(v[0], v[1], v[2], v[3], v[4], v[5], v[6]);
  for (Py_ssize_t i = 0; selectable != nullptr && i < count; ++i) {
    PyObject* item = PySequence_GetItem(units, i);
    int64_t u = 0;
    const bool ok = item != nullptr && int_arg(item, "unit", kInt32Min, kInt32Max, u);
    Py_XDECREF(item);
    if (!ok) {
      Py_CLEAR(selectable);
      break;
    }
    PyTuple_SetItem(selectable, i, PyBool_FromLong(range.selectable(u)));
  }
  if (selectable == nullptr) return nullptr;
  return Py_BuildValue("(LLN)", static_cast<long long>(v[5] > 0 ? sink_pages(v[6], v[3]) : 0),
                       static_cast<long long>(first_live_page(range.history, v[3], v[5])),
                       selectable);
}

template <PyObject* (*fn)(PyObject*, PyObject* const*, Py_ssize_t)>
PyCFunction fastcall() {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn));
}

}  // namespace

PyMethodDef* rules_methods() {
  static PyMethodDef methods[] = {
      {"length_rules", fastcall<length_rules>(), METH_FASTCALL,
       "rules.h's length rules of one row (tests/test_rules.py)."},
      {"length_row_order", fastcall<length_row_order>(), METH_FASTCALL,
       "rules.h's LengthRow values by memory.py's names."},
      {"window_rules", fastcall<window_rules>(), METH_FASTCALL,
       "rules.h's sink pages, first live page and selectable units of one row (TIER-3)."},
      {nullptr, nullptr, 0, nullptr}};
  return methods;
}

}  // namespace torch_kvcm2
