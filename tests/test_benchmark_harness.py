"""The benchmark harness runs end to end (CPU smoke run) and checks each op's outputs; the
benchmark files keep their structure (no import of the driver, no import circle, no file past
900 lines)."""
import ast
import importlib.util
import json
import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")

IDS = ["P-RES", "P-RES-MTP", "P-RES-MTP", "P-FETCH-ROW", "P-FETCH-PAGE", "P-FETCH-HS", "P-FETCH-HS", "P-FETCH-HS", "P-FETCH-HS", "P-FLUSH", "P-INDEX", "P-INDEX-L", "P-TORCH", "P-STEP",
       "P-STEP-HS", "P-STEP-1", "P-STEP-1", "P-STEP-WALL", "P-STEP-WALL", "P-CAP", "P-HOST", "P-HOST", "P-STEP-WALL", "P-STEP-WALL", "P-OBS", "P-START", "P-START-GROW",
       "P-START-OLD", "P-PFX", "P-PFX", "P-PFX", "P-TP", "P-TP", "P-TP", "P-TP",
       "P-PREEMPT", "P-PREEMPT", "P-PREEMPT", "P-DEMOTE", "P-SERVE", "P-SERVE"]


@pytest.fixture(scope="module")
def bench():
    """benchmarks/run.py (the driver) as a module; it puts benchmarks/ on sys.path, where the
    area modules and harness.py are then imported from."""
    path = os.path.join(BENCHMARKS, "run.py")
    spec = importlib.util.spec_from_file_location("kvcm2_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def area(bench):
    """An area module or the harness of benchmarks/, by name (after run.py put them on the path)."""
    return importlib.import_module


def test_quick_benchmark_run_checks_outputs_and_writes_json(bench, area, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    results = {r["id"]: r for r in data["results"]}
    assert [r["id"] for r in data["results"]] == IDS
    assert all(r["median_us"] > 0 for r in data["results"] if r["id"] != "P-CAP")
    assert all(r["passed"] is None for r in data["results"])  # the CPU run claims nothing
    assert data["scaling"] == []
    printed = capsys.readouterr().out
    assert "numbers are not claims" in printed
    for rid in ("P-INDEX", "P-INDEX-L", "P-TORCH", "P-STEP", "P-STEP-HS", "P-CAP"):
        assert f"# {rid}: " in printed  # its note under the table

    obs = results["P-OBS"]["extra"]  # metrics() every timed step, at least one scrape
    assert obs["metrics_calls"] >= 7 * 8 and obs["scrapes"] >= 1 and obs["without_us"] > 0
    demote = results["P-DEMOTE"]["extra"]  # the demotion moved nothing over PCIe
    assert demote["bytes_moved"] == 0 and demote["demote_publish_us"] > 0
    torch_ = results["P-TORCH"]["extra"]
    assert torch_["torch_us"] > 0 and torch_["ratio"] == pytest.approx(torch_["torch_us"] / torch_["library_us"])

    sizes = area("harness").step_sizes(quick=True)
    for rid, groups in (("P-STEP", len(sizes["groups"])), ("P-STEP-HS", sum(sizes["groups"]))):
        r = results[rid]
        e = r["extra"]
        layers, rows = sum(sizes["groups"]), sizes["rows"]
        assert (e["layers"], e["groups"], e["rows"], e["K"], e["S"]) == (layers, groups, rows, sizes["K"], sizes["S"])
        assert e["fetch_bytes"] == rows * e["new"] * 656 * layers and e["flush_bytes"] == rows * 656 * layers
        assert r["nbytes"] == e["fetch_bytes"] + e["flush_bytes"]
        assert e["cells_bytes"] == layers * rows * sizes["S"] * 656
        assert e["limit_us"] == pytest.approx(1.2 * e["ideal_us"] + groups * results["P-RES"]["median_us"])

    step_1 = [r for r in data["results"] if r["id"] == "P-STEP-1"]
    for rows, r in zip((1, 2), step_1):  # every group in one call, per group in the same run
        e = r["extra"]
        assert e["rows"] == rows and e["all_us"] == r["median_us"] and e["group_us"] > 0
        assert e["fetch_bytes"] == rows * e["new"] * 656 * sum(sizes["groups"])
    walls = [r["shape"] for r in data["results"] if r["id"] == "P-STEP-WALL"]
    assert sum("x 1r" in w for w in walls) == 2 and sum("all groups in one call" in w for w in walls) == 1

    preempt = [r for r in data["results"] if r["id"] == "P-PREEMPT"]
    assert preempt[0]["nbytes"] == preempt[1]["nbytes"] == 16 * 3 * 64 * 132  # 1K tokens, 3 layers
    e = preempt[0]["extra"]
    assert e["host_waits"] == 0 and e["pieces"] == 4  # the copy back in 4 pieces
    assert len(e["step_during_us"]) == 6 // 2 + 4 + 1  # until the last piece, one step each

    cap = results["P-CAP"]["extra"]
    assert len(cap["contexts"]) == 2 and cap["contexts"][0]["context"] < cap["contexts"][1]["context"]
    assert {c["cells_bytes"] for c in cap["contexts"]} == {2 * cap["cells_bytes_per_layer"]}
    assert cap["cells_bytes_per_layer"] == 128 * 656  # S x U x bytes_per_token (quick: S = 128)
    assert all(c["dense_bytes"] == 2 * c["context"] * 656 for c in cap["contexts"])


def test_scaling_table_is_checked_and_follows_bytes(area):
    points = area("bench_fetch").bench_scaling(area("harness").Timer("cpu", 1), "cpu", quick=True)
    assert {p["sweep"] for p in points} == {"rows", "K", "S", "miss"}
    assert all(p["us"] > 0 and p["bytes"] == p["misses"] * 656 for p in points)
    miss = [p for p in points if p["sweep"] == "miss"]
    assert [p["miss_pct"] for p in miss] == sorted(p["miss_pct"] for p in miss)
    assert miss[-1]["miss_pct"] == 100 and miss[-1]["misses"] == miss[-1]["rows"] * miss[-1]["K"]


def test_eager_parts_runs_its_checks_and_prints_every_part():
    """benchmarks/eager_parts.py (CPU): its checks pass (the cold step's misses and bytes, the
    warm steps' hits, valid index and write tables, every row advanced every step) and it prints
    the step's runs and every part."""
    import subprocess
    script = os.path.join(BENCHMARKS, "eager_parts.py")
    out = subprocess.run([sys.executable, script, "cpu"], capture_output=True, text=True,
                         cwd=BENCHMARKS, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert sum(line.startswith("step [eager] host ") for line in lines) == 10
    assert any(line.startswith("step ops alone") for line in lines)
    for part in ("x.add_(1)", "Batch.publish() (nothing changed)",
                 "Batch.resolve(0, sel, fetch=True)", "Batch.resolve(0, sel)",
                 "Batch.resolve_groups(3 groups, fetch=True)", "Batch.resolve_groups(3 groups)",
                 "Batch.fetch(",
                 "Batch.write_indices(0)", "Batch.flush(targets)", "Batch.advance(zeros)"):
        assert any(line.startswith(part) and line.endswith(" us") for line in lines), part


def benchmark_imports() -> dict:
    """For every benchmarks/*.py: the names of the other benchmark modules it imports (at any
    depth of the file: in functions too)."""
    files = sorted(f for f in os.listdir(BENCHMARKS) if f.endswith(".py"))
    local = {f[:-3] for f in files}
    graph = {}
    for f in files:
        with open(os.path.join(BENCHMARKS, f)) as fh:
            tree = ast.parse(fh.read(), filename=f)
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        graph[f[:-3]] = names & local
    return graph


def test_no_benchmark_imports_the_driver_and_no_import_cycle():
    graph = benchmark_imports()
    assert {"run", "harness"} <= set(graph)
    importers = sorted(m for m, deps in graph.items() if "run" in deps)
    assert not importers, f"benchmark modules import run.py: {importers}"
    done, path = set(), []

    def visit(module):  # depth-first; a module met again on the current path closes a cycle
        if module in path:
            raise AssertionError("benchmark import cycle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        path.append(module)
        for dep in sorted(graph[module]):
            visit(dep)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_every_benchmark_file_is_at_most_900_lines():
    long = {}
    for f in sorted(os.listdir(BENCHMARKS)):
        if f.endswith(".py"):
            with open(os.path.join(BENCHMARKS, f)) as fh:
                n = sum(1 for _ in fh)
            if n > 900:
                long[f] = n
    assert not long, f"benchmark files past 900 lines: {long}"
