"""DeepSeek-V4 through the cache (STR-1, STR-2): transformers' own
``DeepseekV4ForCausalLM`` (a tiny random config: compressed sparse, heavily compressed and
sliding layers) against the stock model with its own dense cache, and the streams that carry it
(``torch_kvcm2.stream_set``)."""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE_PARAMS

transformers = pytest.importorskip("transformers", reason="the [models] extra (transformers)")

import torch_kvcm2 as kv  # noqa: E402
import torch_kvcm2.models as models  # noqa: E402
from torch_kvcm2 import stream_set as streams  # noqa: E402
from torch_kvcm2.models import reference, v4  # noqa: E402

PROMPT, CHUNK, NEW = 70, 32, 24  # three prefill chunks (32 + 32 + 6), then 23 decode steps

_MODELS = {}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(dtype=torch.float32, device="cpu"):
    key = (dtype, device)
    if key not in _MODELS:
        _MODELS[key] = models.tiny_model("v4", dtype=dtype, device=device)
    return _MODELS[key]


def lockstep(model, plant=None, rows=2):
    """Equal-length prompts through a Generator and the stock model in the same shapes: (our
    logits [steps, R, V], the stock's, the generator's metrics)."""
    prompts = torch.randint(2, 512, (rows, PROMPT), generator=torch.Generator().manual_seed(0))
    gen = models.Generator(model, max_rows=rows, max_tokens_per_row=256, prefill_chunk=CHUNK,
                           record_logits=True)
    requests = [gen.submit(p.tolist(), NEW) for p in prompts]
    if plant is not None:
        plant(gen)
    gen.run()
    ours = torch.stack([torch.stack(r.logits) for r in requests], dim=1)
    tokens = torch.tensor([r.generated for r in requests])
    stock = reference.stock_batch_logits(model, prompts, tokens, CHUNK).float()
    metrics = gen.metrics()
    gen.close()
    return ours, stock, metrics


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_v4_logits_are_bit_identical_to_the_stock_dense_cache(device):
    """CSA entries resolved and fetched into cells, HCA entries and index keys in pools, the
    window in windowed pages: the stock model's logits bit for bit, with entries missed and
    fetched on the way (a selection that never missed would not show the fetch works)."""
    ours, stock, metrics = lockstep(tiny(device=device))
    assert ours.shape == stock.shape == (NEW, 2, 512)
    for step in range(NEW):
        assert torch.equal(ours[step], stock[step]), (
            f"step {step}: max |diff| {(ours[step] - stock[step]).abs().max().item():.3g}")
    for group in (v4.csa_group(0), v4.csa_group(2)):
        counts = metrics["selection_groups"][group]
        assert counts["misses"] > 0 and counts["hits"] > 0, counts
    assert metrics["flushed_bytes"] > 0 and metrics["host_direct_bytes"] > 0


def skip_fetch(gen):
    """From the fourth step on, CSA resolves never fetch their misses: attention reads whatever
    the cells held."""
    batch = gen.batch.batches[4]
    resolve = batch.resolve

    def faulty(group, selected, out=None, fetch=False):
        return resolve(group, selected, out, fetch=fetch and gen.steps < 4)
    batch.resolve = faulty


def stale_entry(gen):
    """At step 10 layer 0's closing entry is not written into its cell (the row keeps what the
    slot held; the flush then writes that to the host pages)."""
    cache, put = gen.cache, v4.write_rows
    original = cache._csa

    def faulty(i, *args):
        if gen.steps == 10 and i == 0:
            v4.write_rows = lambda *a: None
            try:
                return original(i, *args)
            finally:
                v4.write_rows = put
        return original(i, *args)
    cache._csa = faulty


@pytest.mark.parametrize("fault", [skip_fetch, stale_entry], ids=["fetch-skipped", "stale-entry"])
def test_a_planted_fault_fails_the_check(fault):
    ours, stock, _ = lockstep(tiny(), plant=fault)
    assert not torch.equal(ours, stock)
    assert (ours - stock).abs().max().item() > reference.TOLERANCE[torch.float32].max_diff


def ragged(gen):
    g = torch.Generator().manual_seed(1)
    return [gen.submit(torch.randint(2, 512, (length,), generator=g).tolist(), new, arrival)
            for length, new, arrival in ((40, 14, 0), (101, 10, 0), (66, 12, 3))]


def test_ragged_requests_give_the_stock_tokens():
    """Requests of different lengths, one joining later: every row's windows close at its own
    steps, prefill and decode rows share steps; each request checked alone against the stock
    model (teacher-forced, fp32 tolerance, greedy tokens the stock argmax)."""
    model = tiny()
    gen = models.Generator(model, max_rows=3, max_tokens_per_row=256, prefill_chunk=32,
                           record_logits=True)
    requests = ragged(gen)
    gen.run()
    expected = {r.request_id: reference.stock_request_logits(model, r.prompt, r.generated, 32)
                for r in requests}
    result = reference.compare(requests, expected, near=1e-4)
    assert result.ok(reference.TOLERANCE[torch.float32]), result
    gen.close()


def shared_prefix_run(model, chunk: int, first: int, shared: int, max_tokens: int, seed: int):
    """Two requests through a ``share_prefixes`` Generator: the first of ``first`` random
    tokens, the second its first ``shared`` tokens and ten of its own, arriving once the first
    has committed; each checked alone against the stock model. Returns the requests and the
    prefix index's hit tokens."""
    gen = models.Generator(model, max_rows=2, max_tokens_per_row=max_tokens,
                           prefill_chunk=chunk, record_logits=True, share_prefixes=True)
    g = torch.Generator().manual_seed(seed)
    one = torch.randint(2, 512, (first,), generator=g).tolist()
    two = one[:shared] + torch.randint(2, 512, (10,), generator=g).tolist()
    requests = [gen.submit(one, 6), gen.submit(two, 6, arrival=first // chunk + 2)]
    gen.run()
    expected = {r.request_id: reference.stock_request_logits(model, r.prompt, r.generated, chunk)
                for r in requests}
    result = reference.compare(requests, expected, near=1e-4)
    assert result.ok(reference.TOLERANCE[torch.float32]), result
    hits = gen.metrics()["prefix"]["hit_tokens"]
    gen.close()
    return requests, hits


@pytest.mark.parametrize("arch", ["v4", "v32"])
def test_a_shared_prefix_gives_the_stock_tokens(arch):
    """The second request's prompt starts with the first's two whole pages (128 tokens): every
    stream shares them (the rate-1 stream's windowed pages hold the window and the compressor's
    per-token projections there, so nothing is recomputed) and it prefills only the rest; its
    logits and tokens are the stock model's over the whole prompt."""
    model = tiny() if arch == "v4" else models.tiny_model(arch)
    requests, hits = shared_prefix_run(model, 64, 150, 130, 256, seed=2)
    assert requests[1].reused_tokens == 128 and requests[0].reused_tokens == 0
    assert hits >= 128


@pytest.mark.parametrize("seed", [0, 1])
def test_v4_engine_day(seed):
    """A day of a V4-shaped engine: requests with random prompts (some sharing a system prompt
    of two pages) arrive at random steps on three rows, prefill in chunks, decode, and are
    preempted (their dense pages to the host tier) and resumed at random; every request's
    logits are then checked alone against the stock model, and nothing stays allocated."""
    import random

    rng, model = random.Random(seed), tiny()
    # pools for twice the rows: suspended requests keep their sparse pages
    gen = models.Generator(model, max_rows=3, max_tokens_per_row=640, prefill_chunk=48,
                           record_logits=True, share_prefixes=True, host_tier_bytes=4 << 20)
    system = [rng.randrange(2, 512) for _ in range(130)]
    requests = []
    for i in range(10):
        own = [rng.randrange(2, 512) for _ in range(rng.randrange(3, 120))]
        prompt = system + own if rng.random() < 0.5 else own
        requests.append(gen.submit(prompt, rng.randrange(2, 24), arrival=rng.randrange(0, 40)))
    suspended, preemptions = [], 0
    for _ in range(600):
        if not gen.pending and not suspended:
            break
        running = [r for r in requests if r.state == "running" and r.generated
                   and len(r.generated) < r.max_new_tokens - 1]
        if running and rng.random() < 0.08:
            victim = rng.choice(running)
            gen.suspend(victim)
            suspended.append(victim)
            preemptions += 1
        elif suspended and len(gen.running) < gen.batch.max_rows and rng.random() < 0.3:
            gen.resume(suspended.pop(0))
        gen.step()
    assert not gen.pending and not suspended
    assert preemptions > 0 and all(r.state == "finished" for r in requests)
    expected = {r.request_id: reference.stock_request_logits(model, r.prompt, r.generated, 48)
                for r in requests}
    result = reference.compare(requests, expected, near=1e-4)
    assert result.ok(reference.TOLERANCE[torch.float32]), result
    m = gen.metrics()
    assert m["prefix"]["hit_tokens"] > 0 and m["preemptions"] == preemptions
    for manager in gen.manager.managers.values():  # only committed pages stay, cached
        assert all(g["used_bytes"] == 0 for g in manager.metrics()["pool_groups"]), (
            manager.metrics()["pool_groups"])
    gen.close()


def test_a_shared_prefix_whose_window_pages_are_gone_shares_less():
    """With 16-token prefill chunks the first request (300 tokens) has released the window
    pages of its early prefix by the time it commits: the second (its first 290 tokens the
    same) shares the longest prefix every stream can still match (not the shortest match cut
    to the streams' common page, whose window pages are gone) and gives the stock tokens."""
    requests, _ = shared_prefix_run(tiny(), 16, 300, 290, 512, seed=3)
    assert requests[1].reused_tokens % 64 == 0


def test_a_request_grows_past_an_in_flight_range_advance_left():
    """Chunks of 6 tokens: after each step ``advance`` leaves the rate-4 stream's capacity at
    history + the step's width (cut at a page), an in-flight range nothing was written to;
    ``StreamRequest.resize`` drops it before growing (growing past it is refused, SAFE-1)."""
    spec = v4.describe_v4(tiny())
    group = streams.StreamSet(v4.stream_configs(spec, max_rows=1, max_tokens_per_row=128))
    batch = streams.StreamBatch(group)
    request = group.create_cache()
    batch.add(request)
    for _ in range(5):
        h = request.history_length
        assert request.resize(capacity=h + 6)
        assert request.lengths(4) == (h // 4 * 4, max((h + 6) // 4, h // 4 + 1) * 4)
        batch.publish()
        batch.finish_step([h], [6], host_writes=True)
        batch.poll()
    assert request.history_length == 30 and request.lengths(4)[0] == 28
    batch.close(discard=True)
    group.close()


# ---- the streams ----

def test_stream_lengths_derive_from_the_token_count():
    """History: the closed windows; capacity: the windows the step closes and at least the open
    one while tokens are in flight, nothing beyond history otherwise."""
    assert [streams.stream_history(h, 4) for h in (0, 3, 4, 7, 8)] == [0, 0, 4, 4, 8]
    assert streams.stream_capacity(7, 7, 4) == 4  # nothing in flight
    assert streams.stream_capacity(6, 7, 4) == 8  # the open window [4, 8)
    assert streams.stream_capacity(7, 8, 4) == 8  # token 7 closes window 1: it is in flight
    assert streams.stream_capacity(8, 9, 4) == 12
    assert streams.stream_capacity(0, 70, 4) == 68  # a chunk closing 17 windows
    assert streams.stream_capacity(0, 2, 4) == 4
    assert streams.stream_capacity(5, 9, 1) == 9
    assert streams.stream_max_tokens(256, 4) == 260


def test_can_fit_counts_every_stream():
    """``can_fit`` asks every stream for the most it holds (250 tokens: 252 at rate 4, 256 at
    rate 16, the open window's entry in flight at the last step): with the HCA stream's pool
    cut to 32 KiB it is the one that refuses first, at a count the rate-1 stream would still
    take."""
    spec = v4.describe_v4(tiny())
    configs = v4.stream_configs(spec, max_rows=2, max_tokens_per_row=256)
    hca = configs[16]
    configs[16] = kv.CacheConfig(tokens_per_page=hca.tokens_per_page, layers=hca.layers,
                                 max_rows=2, max_tokens_per_row=hca.max_tokens_per_row,
                                 gpu_budget_bytes=32 << 10,
                                 host_budget_bytes=hca.host_budget_bytes)
    group = streams.StreamSet(configs)
    try:
        assert [streams.stream_peak(250, r) for r in (1, 4, 16)] == [250, 252, 256]
        each = {n: {r: m.can_fit(streams.stream_peak(250, r), n)
                    for r, m in group.managers.items()} for n in range(1, 13)}
        assert all(group.can_fit(250, n) == all(each[n].values()) for n in each)
        refused = min(n for n in each if not group.can_fit(250, n))
        assert not each[refused][16] and each[refused][1]
    finally:
        group.close()


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop(1), "rate-1 stream"),
    (lambda c: c.__setitem__(2, c[4]), "tokens_per_unit = 2"),
    (lambda c: c.__setitem__(16, c[4]), "max_tokens_per_row must be at least 272"),
    (lambda c: c.__setitem__(3, c[1]), "multiple of the rate"),
])
def test_bad_stream_configs_are_refused_by_rule(change, message):
    configs = v4.stream_configs(v4.describe_v4(tiny()), max_rows=2, max_tokens_per_row=256)
    change(configs)
    with pytest.raises(ValueError, match=message):
        streams.StreamSet(configs)


def test_v4_refuses_what_it_does_not_run():
    model = tiny()
    for option in ({"mode": "absorbed"}, {"static_length": 256}, {"gpu_history_tokens": 64}):
        with pytest.raises(ValueError, match="not supported for DeepSeek-V4"):
            models.Generator(model, max_rows=1, max_tokens_per_row=128, **option)
    gen = models.Generator(model, max_rows=1, max_tokens_per_row=128)
    with pytest.raises(ValueError, match="runs eagerly"):
        gen.compile_decode()
    gen.close()
