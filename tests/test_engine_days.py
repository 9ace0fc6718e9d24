"""Engine days (ENG-1..3): the fake engine of examples/engine.py drives one manager and one batch
through arrivals, chunked prefills, speculative decoding, shared system prompts, continuations,
preemptions, aborts and finishes; every decode step checks what attention read, every finished
request's history is checked bit for bit, and after the drain nothing is leaked (the engine
raises EngineDayFailed with the seed, the step and the knobs otherwise). The CPU days run in CI;
the CUDA day replays the device step as one CUDA graph with delays injected
(``TORCH_KVCM2_ENGINE_REQUEST_STEPS`` request-steps, default 100,000)."""
import os

import pytest

from engine import DELAY_OPS, Workload, run_day  # examples/engine.py (conftest puts examples/ on the path)

DAYS = [  # (id, knobs): every knob on in some day
    ("closed-default", dict(seed=1, steps=600)),
    ("closed-seed-7", dict(seed=7, steps=600, concurrency=8)),
    ("open-loop", dict(seed=2, arrival="open", arrival_rate=0.4, steps=600)),
    ("tight-pool", dict(seed=3, pool_pages=90, abort_rate=0.02, steps=600)),
    ("all-speculative", dict(seed=4, speculative_share=1.0, draft_tokens=3, locality=0.95,
                             steps=400)),
    ("sharing-heavy", dict(seed=5, continuation_share=0.4, system_prompt_share=0.5,
                           system_prompts=1, delay_ops=DELAY_OPS, steps=600)),
    ("long-prompts-small-chunks", dict(seed=6, prompt_lengths=(200, 1000), prefill_chunk=40,
                                       output_lengths=(2, 16), concurrency=8, pool_pages=160,
                                       steps=400)),
    # overloaded (360 arrivals, the host pool binds): the queue drains 2,340 steps after the
    # arrivals stop with preemptions offloading to the host tier (1,960 keeping dense pages)
    ("open-speculative-tight", dict(seed=8, arrival="open", arrival_rate=0.6, pool_pages=100,
                                    speculative_share=0.6, draft_tokens=4, steps=600,
                                    max_drain_steps=3000)),
    ("tiny-chunks-wide-inflight", dict(seed=9, prefill_chunk=9, max_inflight_tokens=12,
                                       prompt_lengths=(8, 300), steps=600)),
    ("low-locality-delays", dict(seed=10, locality=0.5, delay_ops=("resolve", "flush"),
                                 abort_rate=0.03, steps=600)),
    # GPU-resident history (RSD-1/2): room for a few rows (promotions and demotions all day,
    # with preemptions, sharing, speculation, aborts), and room for every row
    ("gpu-history-tight", dict(seed=13, gpu_history_pages=40, output_lengths=(16, 120),
                               pool_pages=100, steps=500)),
    ("gpu-history-roomy", dict(seed=14, gpu_history_pages=8 * 100, speculative_share=0.6,
                               steps=400)),
]


@pytest.mark.parametrize("knobs", [k for _, k in DAYS], ids=[i for i, _ in DAYS])
def test_cpu_engine_day(knobs):
    result = run_day(Workload(**knobs))
    assert result.steps >= knobs.get("steps", 300)
    assert result.finished > 10 and result.tokens_generated > 0
    assert result.checked_tokens > 0 and result.verified_history_tokens > 0
    if knobs.get("delay_ops"):
        assert all(result.delays[op] > 0 for op in knobs["delay_ops"])
    if knobs.get("gpu_history_pages"):  # rows moved onto GPU pages and, when tight, off them
        history = result.gpu_history
        assert history["promotions"] > 0 and history["promoted_bytes"] > 0, history
        if knobs["gpu_history_pages"] < 100:  # the tight day: rows that grew were demoted
            assert history["demotions"] > 0, history


def test_preemption_happens_and_resumes_bit_exact():
    result = run_day(Workload(seed=11, pool_pages=80, steps=120, abort_rate=0.0))
    assert result.preemptions > 0 and result.resumes > 0
    assert result.offloads > 0  # preemptions moved dense pages to the host tier (TIER-1)
    # every resumed request that finished had its history verified bit for bit (dense pages
    # back from the host tier included), and the drain found both tiers empty
    assert result.finished > 0 and result.verified_history_tokens > 0


def test_aborts_leave_nothing():
    result = run_day(Workload(seed=12, abort_rate=0.1, steps=120, continuation_share=0.0,
                              system_prompt_share=0.0))
    assert result.aborts > 5  # and the drain's leak checks passed (run_day raises otherwise)


def test_aborts_without_commits_leave_every_slot_free():
    """With nothing committed (every request aborts before finishing), the drained pools have no
    cached slot either: every page came back."""
    result = run_day(Workload(seed=13, abort_rate=1.0, steps=40))
    assert result.aborts > 0 and result.finished == 0
    assert result.cached_slots_at_end == [0, 0]


def test_shared_prompts_hit_the_prefix_cache():
    result = run_day(Workload(seed=14, system_prompt_share=1.0, continuation_share=0.0,
                              system_prompts=1, steps=120, abort_rate=0.0))
    assert result.prefix_hits > 5
    assert result.prefix_tokens >= result.prefix_hits * 16


def test_speculative_rows_accept_one_to_t():
    result = run_day(Workload(seed=15, speculative_share=1.0, draft_tokens=3, steps=120))
    T = 4
    assert set(result.accepted) <= set(range(1, T + 1))
    assert {1, T} <= set(result.accepted)  # both ends of 1..T happen


def test_default_locality_repeats_most_of_the_top_k():
    result = run_day(Workload(seed=16, steps=100))
    assert result.locality >= 0.85


@pytest.mark.cuda
def test_cuda_engine_day_one_graph_with_delays():
    """The device step captured once as one CUDA graph and replayed across membership changes,
    with a sleep kernel before every op of DELAY_OPS, until the request-steps reach
    TORCH_KVCM2_ENGINE_REQUEST_STEPS (default 100,000), over as many seeded days as it takes."""
    want = int(os.environ.get("TORCH_KVCM2_ENGINE_REQUEST_STEPS", "100000"))
    done, seed, totals = 0, 100, dict(days=0, steps=0, preemptions=0, resumes=0, aborts=0,
                                      finished=0, prefix_hits=0, checked_tokens=0,
                                      graph_replays=0)
    while done < want:
        knobs = dict(seed=seed, device="cuda", graph=True, delay_ops=DELAY_OPS,
                     steps=max(50, min(3000, (want - done) // 6)), pool_pages=120)
        result = run_day(Workload(**knobs))
        assert result.finished > 0 and result.checked_tokens > 0
        assert all(result.delays[op] > 0 for op in DELAY_OPS)
        assert result.graph_replays > 0
        print(f"cuda engine day seed {seed}: {result.summary()}")
        done += result.request_steps
        seed += 1
        totals["days"] += 1
        for key in totals.keys() - {"days"}:
            totals[key] += getattr(result, key)
    print(f"cuda engine days: {done} request-steps, " + ", ".join(f"{v} {k}" for k, v in totals.items()))
    assert done >= want and totals["preemptions"] > 0 and totals["resumes"] > 0


@pytest.mark.cuda
def test_cuda_engine_day_one_graph_with_gpu_history():
    """The captured device step with GPU-resident history: rows move onto GPU pages and off
    them between replays (residency is device data, so the one graph serves every mix), every
    read and finished history checked as on any day."""
    result = run_day(Workload(seed=120, device="cuda", graph=True, gpu_history_pages=40,
                              output_lengths=(16, 120), pool_pages=120, steps=600))
    assert result.finished > 0 and result.checked_tokens > 0 and result.graph_replays > 0
    history = result.gpu_history
    assert history["promotions"] > 0 and history["demotions"] > 0, history
