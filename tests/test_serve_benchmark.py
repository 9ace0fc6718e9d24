"""P-SERVE's benchmark (benchmarks/serve.py) on the CPU: --quick runs both sides at two contexts,
every level checked (what attention read, the indexer's top-K, the misses metrics() counted,
every decoded token on its pages, nothing leaked), and writes its table, JSON and plot; with
--overlap every torch_kvcm2 level runs again with its fetches through FetchStream, as checked."""
import importlib
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def serve():
    sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
    return importlib.import_module("serve")


def test_quick_serve_runs_both_sides_checked_with_table_json_and_plot(serve, tmp_path, capsys):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    assert serve.main(["--quick", "--overlap", "--slots-sweep", "48,128", "--json", str(out),
                       "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    swept = [lv for lv in data["levels"] if lv["slots"]]
    overlapped = [lv for lv in data["levels"] if lv["overlap"]]
    levels = [lv for lv in data["levels"] if not lv["overlap"] and not lv["slots"]]
    # every torch_kvcm2 level once more with the fetches on the side stream, checked the same
    ours = [(lv["context"], lv["layers"], lv["rows"]) for lv in levels if lv["side"] == "kvcm2"]
    assert [(lv["context"], lv["layers"], lv["rows"]) for lv in overlapped] == ours
    assert all(lv["side"] == "kvcm2" and lv["checked_tokens"] > 0 for lv in overlapped)
    for context in (256, 512):
        for side in ("dense", "kvcm2"):
            here = [lv for lv in levels if lv["context"] == context and lv["side"] == side]
            rows = [lv["rows"] for lv in here if lv["layers"] == 2]
            assert rows[0] == 1 and rows == sorted(rows) and len(rows) >= 3, (context, side, rows)
            # 1-2 requests again with the whole (3-layer) model
            assert [lv["rows"] for lv in here if lv["layers"] == 3] == [1, 2]
        summary = data["summary"][str(context)]
        assert summary["low_concurrency_layers"] == 3 and set(summary["low_concurrency_ratio"]) == {"1", "2"}
        mc = summary["max_concurrency"]
        # the quick budgets: torch_kvcm2 holds more requests than the dense baseline
        assert mc["kvcm2"] > mc["dense"] >= 1
        assert summary["binding"]["dense"].startswith("GPU memory")
        ratios = summary["overlap_tpot_ratio"]
        assert len(ratios) == sum(c == context for c, _, _ in ours) and all(r > 0 for r in ratios.values())
    assert all(lv["checked_tokens"] > 0 and lv["tokens_per_s"] > 0 and lv["host_p50"] > 0 for lv in levels)
    # every level against its physical bound, from the ceilings measured in the same run
    assert set(data["ceilings"]) == {"hbm", "h2d", "d2h", "gather", "gemm"}
    assert all(v > 0 for v in data["ceilings"].values())
    assert all(lv["bound_ms"] == max(lv["bound_terms"].values()) > 0 and lv["of_bound"] > 0
               and lv["bound_terms"][lv["bound_by"]] == lv["bound_ms"] for lv in levels)
    assert all(set(s["of_bound_at_best"]) == {"dense", "kvcm2"} for s in data["summary"].values())
    # the hit rate metrics() counted is the locality model's under an LRU of S slots
    ours = [lv for lv in levels + overlapped + swept if lv["side"] == "kvcm2"]
    assert all(0.6 < lv["hit_rate"] < 0.95 and abs(lv["hit_rate"] - lv["model_hit_rate"]) < 0.03
               for lv in ours)
    # the slots sweep: each context at torch_kvcm2's best concurrency (fewer where S's cells
    # leave room for fewer), more slots hitting more
    assert [(lv["context"], lv["slots"]) for lv in swept] == [(256, 48), (256, 128), (512, 48),
                                                              (512, 128)]
    for small, large in zip(swept[::2], swept[1::2]):
        assert large["rows"] <= small["rows"] and large["model_hit_rate"] > small["model_hit_rate"]
    printed = capsys.readouterr().out
    assert "numbers are not claims" in printed and "max concurrency" in printed
    assert "| kv+ov |" in printed and "with the fetches overlapped" in printed
    assert "# slots sweep" in printed
    pytest.importorskip("matplotlib")  # the [bench] extra; CI installs it
    assert png.stat().st_size > 10_000


def test_quick_serve_with_gpu_resident_history(serve, tmp_path):
    """--gpu-history-gb (RSD-1): at 1-2 requests every torch_kvcm2 row is on GPU history pages
    (no miss, every level checked as before); where the pages run out the rest stay on cells,
    and the maximum concurrency loses only what the pages take."""
    out = tmp_path / "serve.json"
    assert serve.main(["--quick", "--gpu-history-gb", "0.0003", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    ours = [lv for lv in data["levels"] if lv["side"] == "kvcm2"]
    assert all(lv["checked_tokens"] > 0 for lv in ours)
    small = [lv for lv in ours if lv["rows"] <= 2]
    assert small and all(lv["gpu_rows"] == lv["rows"] and lv["hit_rate"] == 1.0 for lv in small)
    assert any(lv["gpu_rows"] < lv["rows"] and lv["hit_rate"] < 1.0 for lv in ours)
    for summary in data["summary"].values():
        assert summary["max_concurrency"]["kvcm2"] > summary["max_concurrency"]["dense"]


def test_quick_serve_with_deepseek_attention_modules(serve, tmp_path):
    """--attention mla: every layer's attention is transformers' DeepseekV32Attention (random
    weights): its indexer's logits over the FP8 keys of the pool, the top-K, then absorbed MLA
    over the selected FP8 rows with the sparse MLA kernel, on both sides; every level checks
    the attention kernel's output against the reference over the rows written and the indexer's
    logits against their definition, and the bound counts the modules' weights and FLOPs."""
    pytest.importorskip("transformers")
    out = tmp_path / "serve.json"
    assert serve.main(["--quick", "--attention", "mla", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["shape"]["attention"] == "mla" and data["shape"]["latent_bytes"] == 656
    levels = data["levels"]
    assert {lv["side"] for lv in levels} == {"dense", "kvcm2"}
    assert all(lv["checked_tokens"] > 0 and lv["attention_bytes"] > 0 and lv["attention_flops"] > 0
               for lv in levels)
    ours = [lv for lv in levels if lv["side"] == "kvcm2"]
    assert all(abs(lv["hit_rate"] - lv["model_hit_rate"]) < 0.03 for lv in ours)
    for summary in data["summary"].values():
        assert summary["max_concurrency"]["kvcm2"] > summary["max_concurrency"]["dense"]
    sh = data["shape"]
    for lv in levels:  # the FLOPs by hand: projections, the indexer over every key, the kernel
        span = -(-(lv["context"] + sh["output"]) // sh["page"]) * sh["page"]
        want = 2 * lv["rows"] * (lv["attention_bytes"] / 2 + sh["index_heads"] * 128 * span
                                 + sh["heads"] * sh["top_k"] * (576 + 512))
        assert lv["attention_flops"] == pytest.approx(want)


def level_fails(serve, shape, match):
    """torch_kvcm2's side of ``shape`` runs a level of 2 requests at 256 tokens: its checks must
    fail with ``match`` (the test's planted fault in place)."""
    side = serve.Side(shape, "kvcm2", "cpu", 256)
    try:
        with pytest.raises(AssertionError, match=match):
            side.run_level(2)
    finally:
        side.close(check=False)


def test_attention_over_other_rows_fails_the_level(serve, monkeypatch):
    """A planted fault: the kernel handed each row's second selected entry in place of its first
    (a row missing from the set): the check against the reference over the rows written fails."""
    pytest.importorskip("transformers")
    mla = importlib.import_module("serve_mla")
    real = mla.MLA.attend

    def wrong(self, layer, x, resid, rows, index):
        index = index.clone()
        index[:, 0] = index[:, 1]
        return real(self, layer, x, resid, rows, index)

    monkeypatch.setattr(mla.MLA, "attend", wrong)
    level_fails(serve, serve.replace(serve.QUICK_MLA, attention="mla"), "differs from the reference")


def test_indexer_reading_other_pages_fails_the_level(serve, monkeypatch):
    """A planted fault: the indexer kernel handed each row's page table shifted by one page:
    the level's check of its logits against the definition over the pool fails."""
    pytest.importorskip("transformers")
    model = importlib.import_module("serve_model")
    real = model.indexer_logits
    monkeypatch.setattr(model, "indexer_logits",
                        lambda q, w, keys, pages, lengths, **kw: real(q, w, keys, pages.roll(1, 1),
                                                                      lengths, **kw))
    level_fails(serve, serve.replace(serve.QUICK_MLA, attention="mla"), "indexer's logits differ")


def test_keys_written_token_by_token_fail_the_level(serve, monkeypatch):
    """A planted fault: the step writes each decoded token's indexer key token by token into a
    pool the indexer reads in the engines' page layout: the level's check of the keys on their
    pages fails."""
    pytest.importorskip("transformers")
    model = importlib.import_module("serve_model")
    monkeypatch.setattr(model, "write_keys",
                        lambda shape, view, page, tok, words: model.write_tokens(view, page, tok, words))
    level_fails(serve, serve.replace(serve.QUICK_MLA, attention="mla"), "indexer key on its pages differs")


def test_misses_unlike_the_locality_models_fail_the_level(serve, monkeypatch):
    """A planted fault: a locality model that expects 20% more misses than the selections make
    under an LRU: the level's check of the misses metrics() counted fails."""
    model = importlib.import_module("serve_model")  # the stand-in's step, beside serve.py
    real = model.lru_misses
    monkeypatch.setattr(model, "lru_misses", lambda *a, **k: real(*a, **k) * 6 // 5)
    level_fails(serve, serve.QUICK, "misses counted by metrics")


def test_the_locality_model_meets_the_published_miss_rates():
    """benchmarks/locality.py's defaults under a plain LRU at top-k 2048: the published miss
    rates (30% / 13.4% / 6.7% at 2048 / 4096 / 8192 slots) within a point each."""
    sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
    locality = importlib.import_module("locality")
    fitted = locality.fit()
    for slots, published in locality.PUBLISHED.items():
        assert abs(fitted[slots] - published) < 0.01, (slots, fitted[slots], published)


def test_the_step_bound_by_hand(serve):
    """step_bound's three terms for a level worked by hand: 2 layers, 4 rows, context 448 plus
    64 output tokens on 64-token pages (512 tokens of keys), K = 8 rows of 100 B gathered, the
    weights 10 KB a layer of a 64-wide hidden dimension, 1 MB of misses a step."""
    shape = serve.Shape(layers=2, model_layers=2, latent_bytes=100, key_bytes=10, top_k=8,
                        page=64, output=64, hidden=64, dense_weight_mb=0.01, expert_mb=0.0)
    level = serve.Level(side="kvcm2", context=448, rows=4, layers=2, fetched_bytes_per_step=1e6)
    ceiling = {"hbm": 1.0, "h2d": 2.0, "gather": 0.5, "gemm": 1.0}
    wrows = 10_000 // 2 // 64  # 78 rows of the bf16 weight matrix
    hbm_bytes = 2 * (wrows * 64 * 2 + 4 * 512 * 10 + 4 * 8 * 100)
    ms, by, terms = serve.step_bound(shape, level, ceiling)
    assert terms["HBM"] == pytest.approx(hbm_bytes / 1e9 * 1e3)
    assert terms["GEMM"] == pytest.approx(2 * 2 * wrows * 64 * 4 / 1e12 * 1e3)
    assert terms["PCIe"] == pytest.approx(1e6 / 0.5e9 * 1e3)  # the gather, slower than the CE
    assert (ms, by) == (terms["PCIe"], "PCIe")


def test_serve_bad_flag_is_a_usage_error(serve, capsys):
    with pytest.raises(SystemExit) as exit_:
        serve.main(["--turnover", "1.5"])
    assert exit_.value.code == 2 and "--turnover" in capsys.readouterr().err


def test_a_shape_the_gpu_cannot_hold_is_refused_before_any_run(serve, monkeypatch):
    """The defaults' full-model run (KV budget 45 GB and 61 layers of stand-in weights, about
    83 GB) on a GPU with 78 GB free: refused up front, naming what to lower; the sweep's
    4-layer shape fits."""
    free = 78 * 10 ** 9
    monkeypatch.setattr(serve.torch.cuda, "mem_get_info", lambda *a: (free, free))
    monkeypatch.setattr(serve.torch.cuda, "get_device_name", lambda *a: "a 78 GB GPU")
    shape = serve.Shape(layers=4)  # the sweep's default
    full = serve.replace(shape, layers=shape.model_layers, max_concurrency=2)
    serve.check_gpu_fits([shape], "cuda")  # fits: returns
    with pytest.raises(SystemExit, match=r"61 layers need 8\d\.\d GB .* lower --gpu-kv-gb, or "
                                         r"leave the full model's run out with --low-layers 0"):
        serve.check_gpu_fits([shape, full], "cuda")
    serve.check_gpu_fits([serve.replace(full, gpu_kv_gb=30.0)], "cuda")


def test_without_matplotlib_the_plot_is_skipped_with_a_message(serve, monkeypatch, capsys):
    """No [bench] extra: ``plot`` says how to get it and returns False (the table still prints)."""
    import builtins
    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert serve.plot([], "unused.png", "title") is False
    assert "pip install -e .[bench]" in capsys.readouterr().err


def test_kernels_reports_the_costliest_at_low_concurrency_only(serve, tmp_path):
    """``--kernels N``: the levels of 1-2 requests ran their timed steps under the profiler and
    name their N costliest kernels (operators on the CPU) in µs a step, descending, on both
    sides; the others none."""
    out = tmp_path / "serve.json"
    assert serve.main(["--quick", "--kernels", "3", "--low-layers", "0", "--json", str(out)]) == 0
    levels = json.loads(out.read_text())["levels"]
    assert {lv["side"] for lv in levels if lv["rows"] <= 2} == {"dense", "kvcm2"}
    for lv in levels:
        kernels = list(lv["kernels_us"].values())
        if lv["rows"] <= 2:
            assert len(kernels) == 3 and all(k > 0 for k in kernels), lv["kernels_us"]
            assert kernels == sorted(kernels, reverse=True)
        else:
            assert kernels == []
