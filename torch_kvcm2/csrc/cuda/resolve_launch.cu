// Host wrapper of OP-RESOLVE's CUDA kernel (resolve.cu): the argument checks, the shared-memory
// layout of a row (the hash size, a global table region for rows too wide for shared memory),
// the choice of the kernel's instantiation and its launch, one CTA per row, split into plan and
// launch (steps.cuh).
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../checks.h"
#include "../rules.h"
#include "launch.cuh"
#include "resolve.cuh"
#include "steps.cuh"

namespace torch_kvcm2 {
namespace {

int ceil_log2(int64_t n) {
  int bits = 0;
  while ((int64_t{1} << bits) < n) ++bits;
  return bits;
}

}  // namespace

ResolvePlan plan_resolve(const at::Tensor& resident, const at::Tensor& recency,
                  const at::Tensor& index_table, const at::Tensor& miss_list,
                  const at::Tensor& miss_count, const at::Tensor& counters,
                  const at::Tensor& inflight_slots, const at::Tensor& selected,
                  const at::Tensor& history, const at::Tensor& capacity, const at::Tensor& lease,
                  int64_t tokens_per_unit, int64_t tokens_per_page, int64_t max_inflight_tokens,
                  int64_t window, const std::optional<at::Tensor>& scratch,
                  const std::optional<at::Tensor>& write_table,
                  const std::optional<at::Tensor>& write_start, int64_t sinks) {
  const bool writes = write_table.has_value() && write_table->defined();
  ResolvePlan plan;
  // K: a row's columns over all its query tokens ([rows, T', K] is [rows, T'*K] in memory); the
  // kernel resolves them as one selection, which is MTP-3's union (duplicates across tokens are
  // duplicates within the row: one hash entry, first column kept).
  const int64_t rows = selected.size(0), S = resident.size(1);
  const int64_t K = selected.dim() == 3 ? selected.size(1) * selected.size(2) : selected.size(1);
  int32_t* const count = miss_count.data_ptr<int32_t>();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(count) % 8 == 0,
              "resolve: miss_count must be 8-byte aligned (its reservation word is 64-bit)");
  plan.rows = rows;
  plan.count = count;
  plan.writes = writes;
  if (rows == 0) return plan;  // no CTA: the launch zeroes the count
  const int64_t MI = max_inflight_units(max_inflight_tokens, tokens_per_unit);
  TORCH_CHECK(rows * (K + MI) <= INT32_MAX, "resolve: too many miss-list entries for int32");
  // Scan counts are 16-bit lanes (Tally); shared memory bounds both far lower anyway.
  TORCH_CHECK(K <= 65535, "resolve: at most 65535 selected columns per row, got ", K);
  TORCH_CHECK(MI <= 65535, "resolve: max_inflight_tokens / tokens_per_unit too large");
  // Hash of >= 4K entries (load <= 1/4: measured 3.4 us faster than 1/2 at K=2048, S=4096) when
  // shared memory allows, else >= 2K (load <= 1/2).
  int bits = std::max(1, ceil_log2(4 * K));
  if (ResolveLayout<int64_t>(S, K, int64_t{1} << bits, MI).bytes > 200 * 1024)
    bits = std::max(1, ceil_log2(2 * K));
  ResolveLayout<int64_t> layout(S, K, int64_t{1} << bits, MI);
  const int device = resident.get_device();
  // The kernel of the table region's memory space (global: wide rows' scratch) that writes the
  // write outputs or not (resolve_kernel).
  auto kernel_of = [writes](bool global) { return resolve_kernel_of(global, writes); };
  int static_bytes = static_smem(kernel_id(kernel_of(false)), device);
  const int smem_optin = device_info(device).smem_optin;
  // Rows too wide for the shared layout (multi-token selections) take the table region from
  // `scratch`: the hash of >= 2K entries, resolve_scratch_bytes in torch_kvcm2/memory.py.
  unsigned char* table_scratch = nullptr;
  if (layout.bytes + static_bytes > smem_optin && scratch.has_value() && scratch->defined()) {
    bits = std::max(1, ceil_log2(2 * K));
    layout = ResolveLayout<int64_t>(S, K, int64_t{1} << bits, MI, true);
    const at::Tensor& t = *scratch;
    TORCH_CHECK(t.device() == resident.device() && t.scalar_type() == at::kByte &&
                    t.is_contiguous() && t.numel() >= rows * layout.table_bytes,
                "resolve: scratch must be a contiguous uint8 tensor on ", resident.device(),
                " of >= rows x ", layout.table_bytes, " = ", rows * layout.table_bytes,
                " bytes for ", K, " selected columns per row, got ", t.scalar_type(), " ",
                t.sizes(), " on ", t.device());
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
                "resolve: scratch must be 16-byte aligned");
    table_scratch = static_cast<unsigned char*>(t.data_ptr());
    static_bytes = static_smem(kernel_id(kernel_of(true)), device);
  }
  plan.global_table = table_scratch != nullptr;
  const ResolveKernel kernel = kernel_of(plan.global_table);
  TORCH_CHECK(layout.bytes + static_bytes <= smem_optin, "resolve: S=", S,
              ", selected columns per row (query tokens x K)=", K, ", max in-flight units=", MI,
              " need ", layout.bytes + static_bytes,
              " bytes of shared memory per row; the device allows ", smem_optin,
              table_scratch == nullptr ? " (pass a scratch tensor for wide rows: docs/MTP.md)"
                                       : " (docs/MTP.md)");
  plan.smem = static_cast<size_t>(layout.bytes);
  ResolveParams& p = plan.p;
  std::memset(&p, 0, sizeof p);  // every field not set below is 0
  p.resident = resident.data_ptr<int32_t>();
  p.recency = recency.data_ptr<int32_t>();
  p.index_table = index_table.data_ptr<int32_t>();
  p.miss_list = miss_list.data_ptr<int32_t>();
  p.miss_count = count;
  p.reservation = reinterpret_cast<unsigned long long*>(count + kMissReservation);
  p.counters = reinterpret_cast<unsigned long long*>(counters.data_ptr<int64_t>());
  p.inflight_slots = inflight_slots.data_ptr<int32_t>();
  p.selected = selected.data_ptr<int32_t>();
  p.history = history.data_ptr<int32_t>();
  p.capacity = capacity.data_ptr<int32_t>();
  p.lease = lease.data_ptr<int32_t>();
  p.leases = resident.size(0);
  p.tokens_per_unit = tokens_per_unit;
  p.tokens_per_page = tokens_per_page;
  p.max_inflight_tokens = max_inflight_tokens;
  p.window = window;
  p.sinks = sinks;
  p.rows = static_cast<int32_t>(rows);
  p.S = static_cast<int32_t>(S);
  p.K = static_cast<int32_t>(K);
  p.MI = static_cast<int32_t>(MI);
  p.hash_bits = bits;
#ifdef KVCM2_DEV
  p.force_stale = tuning().resolve_force_stale ? 1 : 0;
#endif
  p.table_scratch = table_scratch;
  p.write_table = writes ? write_table->data_ptr<int32_t>() : nullptr;
  p.write_start = writes ? write_start->data_ptr<int32_t>() : nullptr;
  p.write_width = writes ? static_cast<int32_t>(write_table->size(1)) : 0;
  p.L = ResolveLayout<uint32_t>(static_cast<uint32_t>(S), static_cast<uint32_t>(K),
                                uint32_t{1} << bits, static_cast<uint32_t>(MI),
                                table_scratch != nullptr);
  return plan;
}

void launch_resolve(const ResolvePlan& plan, cudaStream_t stream) {
  if (plan.rows == 0) {  // no CTA publishes a count
    C10_CUDA_CHECK(cudaMemsetAsync(plan.count, 0, sizeof(int32_t), stream));
    return;
  }
  const ResolveKernel kernel = resolve_kernel_of(plan.global_table, plan.writes);
  allow_dynamic_smem(kernel_id(kernel), c10::cuda::current_device(), plan.smem);
  launch_kernel(kernel, dim3(static_cast<unsigned>(plan.rows)), dim3(kResolveThreads), plan.smem,
                stream, plan.p);
}

namespace {

void resolve_cuda(const at::Tensor& resident, const at::Tensor& recency,
                  const at::Tensor& index_table, const at::Tensor& miss_list,
                  const at::Tensor& miss_count, const at::Tensor& counters,
                  const at::Tensor& inflight_slots, const at::Tensor& selected,
                  const at::Tensor& history, const at::Tensor& capacity, const at::Tensor& lease,
                  int64_t tokens_per_unit, int64_t tokens_per_page, int64_t max_inflight_tokens,
                  int64_t window, const std::optional<at::Tensor>& scratch,
                  const std::optional<at::Tensor>& write_table,
                  const std::optional<at::Tensor>& write_start, int64_t sinks) {
  check_resolve(resident, recency, index_table, miss_list, miss_count, counters, inflight_slots,
                selected, history, capacity, lease, tokens_per_unit, tokens_per_page,
                max_inflight_tokens, window, sinks);
  check_resolve_write(write_table, write_start, selected, resident, inflight_slots, history,
                      capacity, lease, tokens_per_unit, max_inflight_tokens);
  const c10::cuda::CUDAGuard guard(resident.device());
  launch_resolve(plan_resolve(resident, recency, index_table, miss_list, miss_count, counters,
                              inflight_slots, selected, history, capacity, lease,
                              tokens_per_unit, tokens_per_page, max_inflight_tokens, window,
                              scratch, write_table, write_start, sinks),
                 c10::cuda::getCurrentCUDAStream());
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_kvcm2, CUDA, m) { m.impl("resolve", &resolve_cuda); }

}  // namespace torch_kvcm2
