// CUDA part of resolve_groups (csrc/resolve_groups.cpp, which checks and registers it): every
// group's resolve launch (resolve_kernel, as the per-group op launches it), side by side on the
// current stream and the library's side streams forked from it and joined back, then every
// group's fetch in one launch per fetch kernel (launch_fetch_groups), whose CTAs do what they do
// in the group's own launch: the results are resolve_step's per group, bit for bit. The resolves
// are not one launch: a kernel of every group's rows (grid rows x groups) faulted
// (docs/DESIGN.md, "Known limits").
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <unordered_map>
#include <vector>

#include "../groups.h"
#include "steps.cuh"

namespace torch_kvcm2 {
namespace {

constexpr size_t kSideStreams = 15;  // streams the resolves fork onto, at most

// From this many rows (the step's widest group) the fetch parts are launched one by one, as the
// per-group op launches them, instead of one launch for every group's parts. P-STEP-1 on an H100
// (2026-12-06), the one launch against per-group resolves and fetches: 1.31x and 1.11x faster at
// 1 and 8 rows, even at 32 (0.99x), slower from 64 (0.88x, 0.82x at 128); with the parts apart
// from 32 rows: 0.98x at 32 and 64, 1.00x at 128.
constexpr int64_t kFetchApartRows = 32;

// The side streams and events of one thread on one device, created at its first fork there and
// kept for the thread's life. The streams are the library's own, not torch's pool: a pool stream
// is also handed to callers (torch.cuda.Stream(), the default capture stream of
// torch.cuda.graph), and a fork onto a caller's stream would tie our resolves to its work. They
// are per thread because a stream that joined one thread's capture must not take another
// thread's eager launches meanwhile. Events: [0] the fork, [1 + i] side stream i's join, reused
// call after call (a wait takes the event's state when it is enqueued), so a step creates none.
struct SideStreams {
  std::vector<cudaStream_t> streams;
  std::vector<cudaEvent_t> events;
};

SideStreams& side_streams(int device, size_t side) {
  thread_local std::unordered_map<int, SideStreams> of_device;  // handles never released
  SideStreams& s = of_device[device];
  while (s.streams.size() < side) {
    cudaStream_t stream;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    s.streams.push_back(stream);
  }
  while (s.events.size() < side + 1) {
    cudaEvent_t e;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    s.events.push_back(e);
  }
  return s;
}

// Every plan's resolve: plan i on stream i mod (side streams + 1), stream 0 the current one, the
// side streams forked from it (they wait for its work so far) and joined back (it waits for
// theirs) before anything after; inside a capture the fork and the join are graph edges.
void launch_resolves(const std::vector<ResolvePlan>& plans, const c10::cuda::CUDAStream& current) {
  const size_t side = plans.empty() ? 0 : std::min(plans.size() - 1, kSideStreams);
  if (side == 0) {
    for (const ResolvePlan& plan : plans) launch_resolve(plan, current.stream());
    return;
  }
  SideStreams& s = side_streams(current.device_index(), side);
  C10_CUDA_CHECK(cudaEventRecord(s.events[0], current.stream()));
  for (size_t i = 0; i < side; ++i) C10_CUDA_CHECK(cudaStreamWaitEvent(s.streams[i], s.events[0], 0));
  for (size_t i = 0; i < plans.size(); ++i) {
    const size_t k = i % (side + 1);
    launch_resolve(plans[i], k == 0 ? current.stream() : s.streams[k - 1]);
  }
  for (size_t i = 0; i < side; ++i) {
    C10_CUDA_CHECK(cudaEventRecord(s.events[i + 1], s.streams[i]));
    C10_CUDA_CHECK(cudaStreamWaitEvent(current.stream(), s.events[i + 1], 0));
  }
}

}  // namespace

void run_groups_cuda(const GroupLists& a, const std::vector<StepGroup>& groups) {
  const c10::cuda::CUDAGuard guard(a.history.device());
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream();
  std::vector<ResolvePlan> plans;
  std::vector<FetchGroupArgs> fetches;
  plans.reserve(groups.size());
  for (const StepGroup& s : groups) {
    const size_t g = s.g;
    plans.push_back(plan_resolve(a.resident[g], a.recency[g], a.index_table[g], a.miss_list[g],
                                 a.miss_count[g], a.counters[g], a.inflight_slots[g],
                                 a.selected[g], a.history, a.capacity, a.lease,
                                 s.tokens_per_unit, a.tokens_per_page, s.max_inflight_tokens,
                                 s.window, s.scratch, a.write_table[g], a.write_start[g],
                                 s.sinks));
    if (s.buffers > 0)
      fetches.push_back({a.cells.slice(s.first_buffer, s.buffers), s.host_pools, s.page_tables,
                         s.positions, &a.miss_list[g], &a.miss_count[g], a.resident[g].size(1),
                         s.tokens_per_unit});
  }
  const std::shared_ptr<const FetchPlan> fetch = plan_fetch_groups(fetches);  // its checks first
  int64_t rows = 0;
  for (const ResolvePlan& plan : plans) rows = std::max(rows, plan.rows);
  launch_resolves(plans, current);
  launch_fetch_groups(*fetch, current.stream(), rows >= kFetchApartRows);
}

}  // namespace torch_kvcm2
