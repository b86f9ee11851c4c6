"""The CPU-runnable parts of ``benchmarks/soak.py`` (the soak itself runs on the GPU machine): its
configurations, threads, single-threaded expected results, comparisons, report and table, with the NumPy
reference standing in for the CuPy path and the JAX bridge on its CPU target.  Only errors and mismatches
are asserted (the memory targets are the GPU run's)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


def _soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module                       # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_dry_run_has_no_errors_and_no_mismatches(tmp_path, capsys):
    import cudnn_attn

    soak = _soak()
    cache = cudnn_attn.graph_cache
    out = tmp_path / "soak.json"
    soak.main(["--dry-run", "--calls", "96", "--threads", "3", "--cache-size", "2", "--phase-calls", "40",
               "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["errors"] == {} and report["mismatches"] == {}, report["messages"]
    assert report["calls"] == 96 and set(report["calls_by_path"]) == set(soak.PATHS)
    assert report["growth"].keys() == {"host_rss", "host_rss_trimmed", "malloc_in_use", "python_blocks"}
    phases = [row["phase"] for row in report["phases"]]        # settled after 9 calls, then 40, 40 and 7
    assert phases == ["warm-up", "settled", "after 49 calls", "after 89 calls", "final (after gc)"], phases
    assert all(row["live_graphs"] == 0 for row in report["phases"])    # the reference path builds no graph
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith(("PASS", "FAIL"))   # the table comes last
    assert cudnn_attn.graph_cache is cache and cudnn_attn.engine.prepared.graph_cache is cache     # put back


def test_dry_run_with_recompilation_releases_dead_executables(tmp_path):
    """Executable churn: jitted functions are remade every few JAX calls and JAX's caches cleared at each phase;
    no call fails (every live executable finds its call site) and no executable outlives the final clear."""
    soak = _soak()
    out = tmp_path / "soak.json"
    soak.main(["--dry-run", "--calls", "120", "--threads", "3", "--cache-size", "2", "--phase-calls", "40",
               "--recompile-every", "4", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["errors"] == {} and report["mismatches"] == {}, report["messages"]
    assert report["jax_recompiles"] > 0
    assert report["jax_side_at_end"]["live_executable_sites"] == 0


def test_the_memory_verdict_reads_the_trend_of_the_second_half():
    """A leak (memory growing with the calls) fails; a high-water mark reached in the first half, and readings
    that scatter by +-1 MiB around a flat line, pass (seeded scatter)."""
    import numpy as np

    soak, mib = _soak(), 1 << 20
    rng = np.random.default_rng(2026)
    calls = list(range(50_000, 100_001, 1000))

    def verdict(values, key="host_rss"):
        rows = [{"calls": c, key: v} for c, v in zip(calls, values)]
        trends, errors = soak._trends(rows, [key])
        report = {"errors": {}, "mismatches": {}, "trend_second_half": trends, "trend_error_second_half": errors}
        return soak.verdict(report)

    flat = 1000 * mib + rng.uniform(-mib, mib, len(calls))
    assert verdict(flat)[0], verdict(flat)
    leak = flat + np.linspace(0, 3 * mib, len(calls))              # 3 MiB over the half: a leak
    ok, failures = verdict(leak)
    assert not ok and failures[0].startswith("host_rss grew"), failures

    # Device readings move in the driver's 2 MiB pages and scatter by +-3 MiB: a line through them tilts by a MiB
    # with nothing growing (its standard error says so); 8 MiB of growth through the same scatter is a leak.
    def pages(values):
        return np.round(values / (2 * mib)) * 2 * mib

    key, zigzag = "device_outside_pools", 600 * mib + 4 * mib * (-1.0) ** np.arange(len(calls))
    tilted = pages(zigzag + np.linspace(0, 1.2 * mib, len(calls)))
    assert soak._trends([{"calls": c, key: v} for c, v in zip(calls, tilted)], [key])[0][key] >= mib, "a tilted line"
    assert verdict(tilted, key)[0], verdict(tilted, key)
    ok, failures = verdict(pages(zigzag + np.linspace(0, 8 * mib, len(calls))), key)
    assert not ok and failures[0].startswith(f"{key} grew"), failures
