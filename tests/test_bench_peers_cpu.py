"""The CPU-runnable parts of the peer, small-shape, decode, generate, decomposition and torch benchmarks (they run on
the GPU machine): their ``--dry-run`` reports (JSON written, the table printed last), the jitted chain of
``bench_peers`` on the JAX bridge's CPU target against ``jax.nn``'s XLA attention, ``bench_small``'s count of HLO ops
per call, and ``bench_torch``'s interval of its paired ratio."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _bench(name: str):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


@pytest.mark.parametrize("name, files, last", [
    ("bench_peers", ["bench_peers.json"], "device time per call in a jitted chain"),
    ("bench_small", ["bench_small.json"], "verdict: not enough rows measured"),
    ("bench_decode", ["bench_decode.json", "bench_decode_growing.json"], "stages of a new-signature call"),
    ("bench_generate", ["bench_generate.json"], "x sdpa: the median of each round's ratio to sdpa's run"),
    ("bench_decomposition", ["bench_decomposition.json"], "B4 N16 T=S=4k causal     fp8-e4m3   4"),
])
def test_dry_run_writes_its_report_and_prints_the_table_last(name, files, last, tmp_path, capsys):
    _bench(name).main(["--dry-run", "--quick", "--out", str(tmp_path)])
    for file in files:
        report = json.loads((tmp_path / file).read_text())
        assert report["dry_run"] is True
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[-1].startswith(last), lines[-3:]
    assert any(line.startswith("== ") for line in lines)          # run_all's summary takes the table from there


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_a_chain_lowers_its_attention_function_once(mode):
    """Each call of a chain calls one lowered function (a Pallas kernel compiles once per chain, not per call)."""
    import jax
    import jax.numpy as jnp

    chain = 5
    fn = _bench("bench_jax").program(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"),
                                     mode, chain, None)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 16, 2, 8)), jnp.bfloat16)
    text = fn.lower(x, x, x, x).as_text()
    assert text.count("func.func private") <= 2, text[:2000]      # the forward; with fwd+bwd, its vjp
    assert text.count("call @") >= chain, text[:2000]


def test_peers_rows_in_the_issue_order_survive_a_phase_cut_short():
    peers = _bench("bench_peers")
    names = [s.name for s in peers.shapes(quick=False)]
    assert names[:3] == ["B1 N8 T=S=256 D64", "B1 N16 T=S=16k D128 causal", "B4 N16 T=S=4k D128"]
    assert len(set(names)) == len(names) == 8
    assert all(4 <= s.chain(m) <= 64 for s in peers.shapes(quick=False) for m in peers.MODES)


def test_peers_chain_runs_ours_on_the_cpu_target_and_matches_xla():
    import jax

    peers = _bench("bench_peers")
    shape = peers.Shape(1, 2, 32, 64, True)
    inputs = peers.inputs_for(shape, np.random.default_rng(3))
    outputs = {}
    for impl in ("ours", "ours eager", "jax.nn xla"):
        for mode in peers.MODES:
            row = peers.Row(shape.name, mode, impl, chain=2)
            peers.measure(row, shape, inputs, 1, None)
            assert row.error is None, row.notes.get("traceback")
            assert row.notes["timer"] == "host-clock" and row.notes["finite"] and row.device_us > 0
            fn = peers.program(peers.attention(impl, shape), mode, 2, None)
            outputs[impl, mode] = np.asarray(jax.block_until_ready(fn(*inputs)), np.float32)
    for mode in peers.MODES:
        want = outputs["jax.nn xla", mode]
        for impl in ("ours", "ours eager"):
            error = np.linalg.norm(outputs[impl, mode] - want) / np.linalg.norm(want)
            assert error < 2e-2, f"{impl} {mode}: relative error {error:.2e} against jax.nn xla"


def test_a_peer_that_cannot_be_imported_is_a_row_with_its_reason(monkeypatch):
    peers = _bench("bench_peers")

    def missing():
        raise ModuleNotFoundError("No module named 'tokamax'")

    monkeypatch.setattr(peers, "import_tokamax", missing)
    shape = peers.Shape(1, 2, 32, 64, False)
    row = peers.Row(shape.name, "fwd", "tokamax mosaic", chain=2)
    peers.measure(row, shape, peers.inputs_for(shape, np.random.default_rng(0)), 1, None)
    assert row.error == "ModuleNotFoundError: No module named 'tokamax'" and row.device_us is None
    rows = [row]
    peers.ratios(rows)
    assert "tokamax mosaic" in peers.table(rows, [])


def test_xprof_stub_is_importable(monkeypatch, tmp_path):
    peers = _bench("bench_peers")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "xprof", raising=False)
    monkeypatch.setitem(sys.modules, "tokamax", object())       # `import tokamax` after the stub: a stand-in
    try:
        import xprof  # noqa: F401
        pytest.skip("xprof is installed: no stub is written")
    except ImportError:
        pass
    peers.import_tokamax()
    tools = importlib.import_module("xprof.cli.tools")
    assert tools.get_kernel_stats_tool is None
    for name in [m for m in sys.modules if m == "xprof" or m.startswith("xprof.")]:
        monkeypatch.delitem(sys.modules, name)


def test_small_counts_one_custom_call_per_forward_and_two_per_training_step():
    small, peers = _bench("bench_small"), _bench("bench_peers")
    shape = peers.Shape(1, 2, 32, 64, False)
    inputs = peers.inputs_for(shape, np.random.default_rng(0))
    forward = small.hlo_ops(peers.program(peers.attention("ours", shape), "fwd", 3, None), inputs, 3)
    training = small.hlo_ops(peers.program(peers.attention("ours", shape), "fwd+bwd", 3, None), inputs, 3)
    assert forward.get("custom-call") == 1.0 and training.get("custom-call") == 2.0, (forward, training)


@pytest.mark.parametrize("T, n", [(4096, 2), (4096, 4), (64, 8)])
def test_decomposition_blocks_cover_the_causal_mask_once(T, n):
    """The block calls of ``bench_decomposition`` together keep every (query, key) pair of the causal mask
    exactly once, and the merge counts match the partials each row and key block receives."""
    bench = _bench("bench_decomposition")
    cover = np.zeros((T, T), np.int64)
    b = T // n
    for block in bench.blocks(1, T, n):
        if block.causal:                       # the diagonal blocks, batched
            assert (block.batch, block.T, block.S) == (n, b, b)
            for i in range(n):
                cover[i * b:(i + 1) * b, i * b:(i + 1) * b] += np.tril(np.ones((b, b), np.int64))
        else:                                  # row block i against keys [0, i b)
            i = block.S // b
            cover[i * b:(i + 1) * b, :block.S] += 1
    np.testing.assert_array_equal(cover, np.tril(np.ones((T, T), np.int64)))
    forward, backward = bench.merges(n)
    assert forward == n - 1
    key_partials = [1 + sum(1 for blk in bench.blocks(1, T, n) if not blk.causal and blk.S > j * b) for j in range(n)]
    assert backward == (n - 1) + 2 * sum(p - 1 for p in key_partials)


def test_run_all_bundles_every_file_into_one_archive(tmp_path):
    """``benchmarks/run_all.py --bundle``: every file of ``$OUT`` goes into one archive beside the summary, nested
    ones included, and the originals are removed."""
    import tarfile

    benchmarks = Path(__file__).resolve().parent.parent / "benchmarks"
    if str(benchmarks) not in sys.path:
        sys.path.insert(0, str(benchmarks))
    run_all = importlib.import_module("run_all")
    (tmp_path / "ab").mkdir()
    for name in ("tests.log", "gpu_tests.xml", "summary.txt", "ab/new1.json"):
        (tmp_path / name).write_text(name)
    run_all.bundle(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["bundle.tar.gz", "summary.txt"]
    with tarfile.open(tmp_path / "bundle.tar.gz") as archive:
        assert sorted(archive.getnames()) == ["ab/new1.json", "gpu_tests.xml", "tests.log"]


def test_bench_torch_median_interval_brackets_the_median_and_is_reproducible():
    """``bench_torch.median_interval``: seeded (a report's interval is recomputed exactly from its steps), it holds
    the median, and paired ratios that sit above 1 give an interval that excludes 1."""
    pytest.importorskip("torch")
    bench = _bench("bench_torch")
    rng = np.random.default_rng(17)
    ratios = list(1.006 + 0.004 * rng.standard_normal(30))
    low, high = bench.median_interval(ratios)
    assert low <= float(np.median(ratios)) <= high and 1.0 < low < high
    assert bench.median_interval(ratios) == [low, high]
    noise = list(1.0 + 0.01 * rng.standard_normal(30))
    low, high = bench.median_interval(noise)
    assert low < 1.0 < high, (low, high)
