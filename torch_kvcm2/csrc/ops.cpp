// The op catalogue of torch_kvcm2: every schema in one TORCH_LIBRARY block. Mutated tensors carry
// distinct alias sets and mutating ops return nothing, so torch.compile re-inplaces them and
// opcheck's schema test holds. Backends register kernels in cpu/*.cpp and cuda/*.cu.
#include <Python.h>
#include <torch/library.h>

#include "groups.h"
#include "rank_sync.h"
#include "rules.h"

namespace torch_kvcm2 {
PyMethodDef* rules_methods();  // rules_py.cpp: rules.h's length rules, for the parity test
}

extern "C" {
// Importing torch_kvcm2._C loads this library so the registrations below run; its module
// functions expose rules.h's length rules (rules_py.cpp), and its integer constants are the
// layouts the ops and the Python side share, defined here once (ops.py reads them).
PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1,
                               torch_kvcm2::rules_methods()};
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  using namespace torch_kvcm2;
  const struct {
    const char* name;
    long value;
  } constants[] = {
      {"BAD", BAD},
      {"MISS_FIELDS", kMissFields},
      {"MISS_COUNT_WORDS", kMissCountWords},
      {"NUM_COUNTERS", kNumCounters},
      {"MAX_WATERMARK_SHAPES", kMaxWatermarkShapes},
      {"LENGTH_ROWS", kLengthRows},
      {"HISTORY", kHistory},
      {"CAPACITY", kCapacity},
      {"LEASE", kLease},
      {"WRITTEN", kWritten},
      {"DECLARED", kDeclared},
      {"ALLOCATED", kAllocated},
      {"GROUP_FIELDS", static_cast<long>(kGroupFields)},
      {"BUFFER_FIELDS", static_cast<long>(kBufferFields)},
      {"HEADER_WORDS", static_cast<long>(rank_header::kWords)},
      {"MAX_WORLD", static_cast<long>(rank_header::kMaxWorld)},
  };
  for (const auto& c : constants) {
    if (PyModule_AddIntConstant(m, c.name, c.value) != 0) {
      Py_DECREF(m);
      return nullptr;
    }
  }
  return m;
}
}

TORCH_LIBRARY(torch_kvcm2, m) {
  // OP-INDEX, page form: slot ids -> kernel unit indices (slot*scale + pos)*E + i.
  m.def(
      "convert_page_indices(Tensor(a!) out, Tensor page_table, Tensor capacity, int scale, "
      "int pos, int units_per_page, int tokens_per_unit) -> ()");
  // OP-INDEX, token form: token positions -> (page_table[t div P]*scale + pos)*P + t mod P.
  m.def(
      "convert_token_indices(Tensor(a!) out, Tensor selected, Tensor page_table, "
      "Tensor capacity, int scale, int pos, int tokens_per_page) -> ()");
  // OP-RESOLVE: one selection group, every seated row. Also records, per row, the slot of each
  // in-flight unit (column k: unit floor(s0/U) + k) for write_indices and flush. selected and
  // index_table are [rows, K] or [rows, T', K] (MTP-2). scratch: the CUDA kernel's table region
  // for rows too wide for shared memory (ignored on CPU; docs/MTP.md). write_table and
  // write_start (both or neither): OP-WRITE's outputs, as write_indices would write them next.
  m.def(
      "resolve(Tensor(a!) resident, Tensor(b!) recency, Tensor(c!) index_table, "
      "Tensor(d!) miss_list, Tensor(e!) miss_count, Tensor(f!) counters, "
      "Tensor(g!) inflight_slots, Tensor selected, Tensor history, Tensor capacity, Tensor lease, "
      "int tokens_per_unit, int tokens_per_page, int max_inflight_tokens, int window, "
      "Tensor(h!)? scratch=None, Tensor(i!)? write_table=None, Tensor(j!)? write_start=None, "
      "int sinks=0) -> ()");
  // OP-FETCH: layers of one selection group, every missed unit of each of their sparse buffers,
  // host page -> cell. A buffer's host pages are (its pool group's whole pool, its position in a
  // slot): ops never take two views of one pool, which would alias (see HostPages in checks.h).
  m.def(
      "fetch(Tensor(a!)[] cells, Tensor[] host_pools, int[] positions, Tensor[] page_tables, "
      "Tensor miss_list, Tensor miss_count, int slots, int tokens_per_unit) -> ()");
  // OP-STEP: resolve with its write outputs (write_table, write_start), then fetch of the given
  // buffers (none: no fetch), one call (csrc/resolve_step.cpp).
  m.def(
      "resolve_step(Tensor(a!) resident, Tensor(b!) recency, Tensor(c!) index_table, "
      "Tensor(d!) miss_list, Tensor(e!) miss_count, Tensor(f!) counters, "
      "Tensor(g!) inflight_slots, Tensor(h!) write_table, Tensor(i!) write_start, "
      "Tensor(j!)[] cells, Tensor selected, Tensor history, Tensor capacity, Tensor lease, "
      "Tensor[] host_pools, int[] positions, Tensor[] page_tables, int tokens_per_unit, "
      "int tokens_per_page, int max_inflight_tokens, int window, Tensor(k!)? scratch=None, "
      "int sinks=0) -> ()");
  // OP-STEP for several selection groups in one call: group g's part is resolve_step's with
  // resident[g], ..., write_start[g], selected[g], and group_params[6g .. 6g+5] = (tokens_per_unit,
  // max_inflight_tokens, window, sinks, index into scratch or -1, buffers to fetch): its run of cells, in
  // group order, each cell b with buffer_params[3b .. 3b+2] = (index into host_pools, position in
  // a slot, index into page_tables) -- the pools and page tables once each, not once per buffer
  // (every tensor of a list costs the eager call its parsing). The groups share no mutated
  // tensor; on CUDA the groups' resolve launches run side by side on forked side streams and
  // every group's fetch is one launch (csrc/resolve_groups.cpp).
  m.def(
      "resolve_groups(Tensor(a!)[] resident, Tensor(b!)[] recency, Tensor(c!)[] index_table, "
      "Tensor(d!)[] miss_list, Tensor(e!)[] miss_count, Tensor(f!)[] counters, "
      "Tensor(g!)[] inflight_slots, Tensor(h!)[] write_table, Tensor(i!)[] write_start, "
      "Tensor(j!)[] cells, Tensor(k!)[] scratch, Tensor[] selected, Tensor history, "
      "Tensor capacity, Tensor lease, Tensor[] host_pools, Tensor[] page_tables, "
      "int tokens_per_page, int[] group_params, int[] buffer_params) -> ()");
  // The in-flight slot records resolve writes, recomputed from residency alone (the lowest slot
  // holding each in-flight unit), for callers that change lengths or residency between resolves.
  m.def(
      "locate_inflight(Tensor(a!) inflight_slots, Tensor resident, Tensor history, "
      "Tensor capacity, Tensor lease, int tokens_per_unit, int max_inflight_tokens) -> ()");
  // OP-WRITE: per row and in-flight token t = inflight_start + j, its token index in the cells.
  m.def(
      "write_indices(Tensor(a!) out, Tensor(b!) inflight_start, Tensor resident, "
      "Tensor inflight_slots, Tensor history, Tensor capacity, Tensor lease, int tokens_per_unit, "
      "int max_inflight_tokens) -> ()");
  // RSD-1: the rows of one selection group whose history is on GPU pages (gpu_rows[r] != 0,
  // seated), after resolve saw them as holes. gpu_pages int32[rows, pages]: the row's GPU page
  // slot per page ordinal (BAD: none). A selected, selectable unit u on GPU page p gets entry
  // cell_entries + p*E + u mod E, the pages lying after the cells in one index space; in-flight
  // token t goes to token index (entry of t div U)*U + t mod U; write_start = s0. Each distinct
  // ordinal counts once: a hit, or invalid (not selectable, or no GPU page: bad data). Other
  // rows are left as resolve wrote them.
  m.def(
      "resolve_gpu_history(Tensor(a!) index_table, Tensor(b!) write_table, "
      "Tensor(c!) write_start, Tensor(d!) counters, Tensor selected, Tensor gpu_rows, "
      "Tensor gpu_pages, Tensor history, Tensor capacity, Tensor lease, int cell_entries, "
      "int gpu_slots, int tokens_per_unit, int tokens_per_page, int max_inflight_tokens, "
      "int window, int sinks) -> ()");
  // OP-FLUSH: one sparse pool group (host_pool); cells -> host pages for [s0, min(new_history, c)).
  m.def(
      "flush(Tensor(a!) host_pool, int[] positions, Tensor[] cells, Tensor[] resident, "
      "Tensor[] inflight_slots, Tensor page_table, Tensor new_history, Tensor history, "
      "Tensor capacity, Tensor lease, int[] unit_params) -> ()");
  // RSD-1's flush: one sparse pool group, the rows whose history is on GPU pages (gpu_rows[r] !=
  // 0, seated): tokens [s0, min(new_history, c)) from page cell_pages + gpu_pages[r][t div P] of
  // the buffer's index space (spaces[b]: its cells, then its GPU pages) to the host page of
  // page_table[r][t div P], row t mod P. unit_params per buffer: (cell_pages, tokens_per_unit,
  // max_inflight_tokens). flush leaves such rows alone (their in-flight slot records are BAD).
  m.def(
      "flush_gpu_history(Tensor(a!) host_pool, int[] positions, Tensor[] spaces, "
      "Tensor gpu_rows, Tensor gpu_pages, Tensor page_table, Tensor new_history, Tensor history, "
      "Tensor capacity, Tensor lease, int[] unit_params) -> ()");
  // OP-FLUSH's watermark (SAFE-2) for every seated row: written = max(written, min(new_history, c))
  // when every token below the in-flight range was on host pages already (max(written, declared)
  // >= the largest in-flight start s0 over the (U, I) pairs in shapes), else unchanged.
  m.def(
      "flush_watermark(Tensor(a!) written, Tensor declared, Tensor new_history, Tensor history, "
      "Tensor capacity, Tensor lease, int[] shapes) -> ()");
  // HOST-3: every seated row's lengths advanced by its accepted tokens on the device (advance_row
  // in rules.h). lengths: a batch's int32[6, rows] (history, capacity, lease, written, declared,
  // allocated; only history and capacity change); counters int64[2] += (refused, short) rows.
  m.def("advance(Tensor(a!) lengths, Tensor(b!) counters, Tensor accepted) -> ()");
  // BAT-3: empty residency of leases that changed owner, in every selection group g:
  // resident[g][l] = BAD and recency[g][l] = 0, 1, ..., S-1 for each l in leases (int64; one
  // outside [0, leases of the group) is skipped).
  m.def("clear_leases(Tensor(a!)[] resident, Tensor(b!)[] recency, Tensor leases) -> ()");
  // Setup only (CUDA builds): a CUDA tensor aliasing a CPU tensor's memory through the
  // device-mapped (UVA) address; register=True registers the memory as pinned+mapped when it is
  // not yet, register=False aliases the host address of memory registered range by range.
  m.def("uva_view(Tensor host, bool register=True) -> Tensor");
  // Setup only: cudaHostRegister / cudaHostUnregister of one host range (the host region).
  m.def("host_register(int address, int nbytes, int device, bool register) -> ()");
  // TP-3/TP-4 (docs/TP.md): the step ordering of the ranks of a host group. header is the shared
  // rank header (int64[512]); gen this rank's generation (int64[1]). Batch.sync runs both, once
  // per step, after the last flush and before the first fetch. rank_signal: gen += 1, then
  // header's counter of `rank` = gen (release, system scope); the pools are read (it orders after
  // the writes to them). rank_wait: until every rank's counter >= gen (bounded by timeout_us; a
  // rank that left or a timeout writes the header's failure record, then raises on CPU and traps
  // on CUDA); the pools are declared written so that every later read of them orders after it.
  m.def(
      "rank_signal(Tensor(a!) header, Tensor(b!) gen, Tensor[] pools, int rank, int world) -> ()");
  m.def(
      "rank_wait(Tensor(a!) header, Tensor(b!)[] pools, Tensor gen, int rank, int world, "
      "int timeout_us) -> ()");
}
