"""The benchmark harness runs end to end (CPU smoke run) and checks each op's outputs."""
import importlib.util
import json
import os
import sys


def test_quick_benchmark_run_checks_outputs_and_writes_json(tmp_path, capsys):
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "run.py")
    spec = importlib.util.spec_from_file_location("kvcm2_bench", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    ids = [r["id"] for r in data["results"]]
    assert ids == ["P-RES", "P-FETCH-ROW", "P-FETCH-PAGE", "P-FLUSH", "P-INDEX"]
    assert all(r["median_us"] > 0 for r in data["results"])
    assert "numbers are not claims" in capsys.readouterr().out
