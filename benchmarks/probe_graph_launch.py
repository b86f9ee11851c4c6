"""What ``cudaGraphLaunch`` costs the host, by what the stream holds (not a test).

    python benchmarks/probe_graph_launch.py [--launches 2000] [--out FILE]

``bench_host.py`` measured a replayed launch at about 3 us with the GPU idle and 7.7 us back to back, and the
JAX handler's replayed launch about as slow inside a jitted chain.  Is that the GPU pacing the host (a kernel of
about 8 us at that shape), or the driver's cost of launching an executable graph whose previous launch has not
finished (which several instances of one graph, used in turn, would avoid)?  One CuPy elementwise kernel is
captured into executable graphs (``cupy.cuda.Graph``), for three kernel lengths, and launched:

* ``idle``          - one launch, timed alone after the device drained;
* ``same graph``    - ``--launches`` launches of one executable back to back;
* ``N graphs in turn`` - the same number, cycling over N executables of the same captured kernel;
* ``kernel``        - the kernel launched directly (no graph), back to back.

Host clock per launch, median of 5 rounds; the device time of one kernel (events) on each row.  Prints a table
and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import cupy as cp

LENGTHS = {"short": 1 << 10, "medium": 1 << 21, "long": 1 << 24}     # float32 elements


def _kernel(x, y):
    cp.multiply(x, 2.0, out=y)


def _graphs(x, y, stream, count: int) -> list:
    graphs = []
    for _ in range(count):
        with stream:
            stream.begin_capture()
            _kernel(x, y)
            graphs.append(stream.end_capture())
    return graphs


def _per_launch_us(launch, launches: int, stream) -> float:
    samples = []
    for _ in range(5):
        stream.synchronize()
        start = time.perf_counter()
        for i in range(launches):
            launch(i)
        samples.append((time.perf_counter() - start) / launches * 1e6)
    stream.synchronize()
    return statistics.median(samples)


def _idle_us(launch, stream, rounds: int = 200) -> float:
    samples = []
    for i in range(rounds):
        stream.synchronize()
        start = time.perf_counter()
        launch(i)
        samples.append((time.perf_counter() - start) * 1e6)
    stream.synchronize()
    return statistics.median(samples)


def _kernel_us(x, y, stream) -> float:
    start, end = cp.cuda.Event(), cp.cuda.Event()
    with stream:
        for _ in range(10):
            _kernel(x, y)
        start.record(stream)
        for _ in range(100):
            _kernel(x, y)
        end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 10.0       # ms per 100 -> us per kernel


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=2000)
    parser.add_argument("--out", default="probe_graph_launch.json")
    args = parser.parse_args()
    stream = cp.cuda.Stream(non_blocking=True)
    rows = []
    for name, n in LENGTHS.items():
        x = cp.random.default_rng(0).standard_normal(n, dtype=cp.float32)
        y = cp.empty_like(x)
        kernel = _kernel_us(x, y, stream)
        graphs = _graphs(x, y, stream, 4)
        for graph in graphs:
            graph.launch(stream)
        stream.synchronize()
        one = graphs[0]
        cases = {"idle": lambda i: one.launch(stream)}
        for count in (1, 2, 4):
            cases[f"{count} graph(s) in turn"] = (lambda i, c=count: graphs[i % c].launch(stream))
        for case, launch in cases.items():
            us = _idle_us(launch, stream) if case == "idle" else _per_launch_us(launch, args.launches, stream)
            rows.append({"kernel": name, "elements": n, "kernel_us": kernel, "case": case, "host_us": us})

        def direct(i):
            with stream:
                _kernel(x, y)
        rows.append({"kernel": name, "elements": n, "kernel_us": kernel, "case": "kernel, no graph",
                     "host_us": _per_launch_us(direct, args.launches, stream)})
        del graphs
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print("== cudaGraphLaunch host us per launch (median of 5 rounds; kernel = device us of one kernel)")
    print(f"{'kernel':8s} {'kernel us':>9s}  {'case':24s} {'host us':>8s}")
    for r in rows:
        print(f"{r['kernel']:8s} {r['kernel_us']:9.1f}  {r['case']:24s} {r['host_us']:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
