"""The first call of a new process: cold build, the persistent plan store, the kernel cache (not a test).

    python benchmarks/bench_first_call.py --out bench_out [--quick] [--dry-run] [--aot-dir DIR]

Every measurement runs in a fresh Python process (this script re-invoked with ``--child``), ``--runs``
times (median reported).  The call: bf16, B=2, T=S=1024, N=8, H=128, causal, forward.
Two paths are timed for each scenario, from after ``import cudnn_attn`` and the inputs to the end of
the first call (synchronised):

* ``api``   -- ``cudnn_attn.dot_product_attention``: whatever the public path does with the store;
* ``graph`` -- ``graphs.persist.build_or_load`` on a new cuDNN handle, then one launch: the store alone.

Scenarios:

* ``cold``            -- an empty store: the plan is built (NVRTC compiles its kernels);
* ``warm``            -- a new process over a store that already holds the plan (target <= 50 ms); the
  frontend (``import cudnn``) loads in the background during the setup (:mod:`cudnn_attn.engine.preload`);
  ``warm, engines not preloaded`` leaves cuDNN's engine libraries to the call (``CUDNN_ATTN_PRELOAD_ENGINES=0``),
  ``warm, preload off`` does neither in the background (``CUDNN_ATTN_PRELOAD=0``: the call imports it); the
  breakdown rows time the call's stages with the preload off and on;
* ``new length``      -- a known structure at a new sequence length through ``KernelCache``: in the same
  process after two lengths were built (target <= 60 ms), and in a new process over the store;
* ``deviceless``      -- a store filled by ``python -m cudnn_attn precompile --target sm90`` (on a CPU
  machine: pass it with ``--aot-dir``; else built here by the same command), used by a new process;
* ``import``          -- ``import cudnn_attn`` alone (target <= 250 ms, JAX not imported), and where the
  time goes (``python -X importtime``, the largest cumulative entries);
* ``dynamic runtime`` -- device time of the dynamic-shape plan against the static plan at T=S=4k
  (B=4, N=16): the kernel cache must not cost speed.

``--dry-run`` runs what a CPU can: the import, and the plan-level scenarios for the deviceless H200
target (``graph`` path, no launch: building, loading and the kernel cache with the stub driver).
Writes ``bench_first_call.json`` to ``--out``; prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = dict(B=2, T=1024, S=1024, N=8, K=8, H=128)
TARGETS_MS = {"warm": 50.0, "new length (same process)": 60.0, "import": 250.0}


# ---------------------------------------------------------------------------------------------------
# The child: one measurement in a fresh process
# ---------------------------------------------------------------------------------------------------
def _config(length: int, **changes):
    from cudnn_attn import MaskType
    from cudnn_attn.tools.selftest import call_config

    shape = {**SHAPE, "T": length, "S": length, **changes}
    return call_config(dtype="bfloat16", mask_type=MaskType.CAUSAL, training=False, **shape)


def _inputs(config):
    import cupy as cp
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(0)
    return tuple(cp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(ml_dtypes.bfloat16)
                 for shape in (config.q_shape, config.k_shape, config.v_shape))


class _GraphPath:
    """``build_or_load`` + one launch on an own handle (or, deviceless, the plan alone)."""

    def __init__(self, target: str, kernels: bool):
        from cudnn_attn.graphs import DevicelessTarget
        from cudnn_attn.persist.build import KernelCache
        from cudnn_attn.persist.store import PlanStore

        self.store = PlanStore.from_env()
        self.deviceless = target == "sm90"
        if self.deviceless:
            self.target = DevicelessTarget.h200()
        else:
            import cudnn
            import cupy as cp

            self.stream = cp.cuda.Stream(non_blocking=True)
            self.target = cudnn.create_handle()
            cudnn.set_stream(self.target, self.stream.ptr)
        self.kernels = KernelCache(self.store) if kernels else None

    def __call__(self, config, arrays) -> dict:
        from cudnn_attn.engine.launch import Launcher
        from cudnn_attn.graphs import TensorId
        from cudnn_attn.persist.build import build_or_load

        built = build_or_load(config, "fwd", self.target, store=self.store, kernels=self.kernels)
        facts = {"origin": built.origin, "plan": built.plan_name, "plan_s": built.build_seconds}
        if not self.deviceless:
            import cupy as cp

            q, k, v = arrays
            with self.stream:
                out = cp.empty(config.o_shape, q.dtype)
                workspace = cp.empty(max(built.workspace_size, 1), cp.uint8)
            launcher = Launcher(built)
            launcher({TensorId.Q: q.data.ptr, TensorId.K: k.data.ptr, TensorId.V: v.data.ptr, TensorId.O: out.data.ptr},
                     workspace.data.ptr, self.target)
            self.stream.synchronize()
            facts["launch_path"] = launcher.path
        return facts


def _api_call(config, arrays) -> dict:
    import cupy as cp

    import cudnn_attn
    from cudnn_attn import MaskType

    q, k, v = arrays
    cudnn_attn.dot_product_attention(q, k, v, scale=config.scale, mask_type=MaskType.CAUSAL)
    cp.cuda.runtime.deviceSynchronize()
    entries = list(getattr(cudnn_attn.graph_cache, "_entries", {}).values())      # what the cache holds (private)
    return {"origin": getattr(entries[-1].graph, "origin", "?") if entries else "?"}


# Library functions timed inside the public first call (``--child`` with ``breakdown``): (module, owner
# attribute path, label).  Each is wall time including what it calls; none of them calls another one
# listed at the same level, except the "of which" rows (marked with a leading "  ").
_STAGES = (
    ("cudnn_attn.fronts.cupy", "_validate_on_device", "validation"),
    ("cudnn_attn.engine.runtime", "DeviceContext.__init__", "device context"),
    ("cudnn_attn.engine.runtime", "create_handle", "  of which cuDNN handles"),
    ("cudnn", "create_handle", "  of which cudnn.create_handle"),
    ("cudnn.frost.device", "current_device", "  of which frontend device lookup"),
    ("cudnn_attn.core.support", "Environment.detect", "  of which Environment.detect"),
    ("cudnn_attn.core.support", "check_supported", "support check"),
    ("cudnn_attn.persist.store", "default_store", "plan store opened"),
    ("cudnn_attn.persist.store", "PlanStore.load", "plan store lookup (read + checksum)"),
    ("cudnn_attn.persist.build", "_load", "deserialize + verify"),
    ("cudnn_attn.persist.build", "_mismatch", "  of which our checks of the loaded plan"),
    ("cudnn_attn.persist.build", "build_graph", "build (store miss)"),
    ("cudnn_attn.engine.plan", "CallPlan.__init__", "call plan"),
    ("cudnn_attn.engine.plan", "CallPlan.launch", "launch (host)"),
    ("cudnn_attn.engine.runtime", "DeviceContext.workspace", "  of which workspace allocation"),
    ("cupy.cuda.compiler", "_compile_with_cache_cuda", "CuPy kernels loaded (disk cache or NVRTC)"),
    ("cupy.cuda.compiler", "compile_using_nvrtc", "  of which NVRTC compiles"),
)


class _Stopwatch:
    """Wraps the functions of :data:`_STAGES` with timers for one call; ``stop()`` puts them back."""

    def __init__(self):
        import importlib
        import inspect
        import types

        self.ms: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.missing: list[str] = []
        self._undo = []
        for module_name, path, label in _STAGES:
            try:
                owner = importlib.import_module(module_name)
                *parents, name = path.split(".")
                for parent in parents:
                    owner = getattr(owner, parent)
                # classes and modules: the attribute as stored; an instance: its bound method, set on it
                is_instance = not isinstance(owner, (type, types.ModuleType))
                raw = getattr(owner, name) if is_instance else inspect.getattr_static(owner, name)
                self._wrap(owner, name, raw, label, is_instance)
            except (ImportError, AttributeError):         # renamed, absent, or an instance with __slots__
                self.missing.append(f"{module_name}.{path}")

    def _wrap(self, owner, name, raw, label, is_instance: bool) -> None:
        import functools

        kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
        function = raw.__func__ if kind else raw

        @functools.wraps(function)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.ms[label] = self.ms.get(label, 0.0) + 1e3 * (time.perf_counter() - start)
                self.calls[label] = self.calls.get(label, 0) + 1

        setattr(owner, name, kind(timed) if kind else timed)
        self._undo.append((owner, name, None if is_instance else raw))

    def stop(self) -> dict:
        for owner, name, raw in reversed(self._undo):
            if raw is None:
                delattr(owner, name)              # the instance's class method shows through again
            else:
                setattr(owner, name, raw)
        order = [label for _, _, label in _STAGES]        # the table's order (a nested stage ends first)
        return {"stages_ms": {label: round(self.ms[label], 2) for label in sorted(self.ms, key=order.index)},
                "stage_calls": self.calls,
                "not_found": self.missing}


CALL_PATH_MODULES = ("cupy", "cudnn", "cudnn_attn.fronts.cupy", "cudnn_attn.engine.prepared", "cudnn_attn.engine.cache",
                     "cudnn_attn.engine.plan", "cudnn_attn.engine.launch", "cudnn_attn.core.values", "cudnn_attn.core.support",
                     "cudnn_attn.persist.store", "cudnn_attn.persist.build")


def call_path_imports() -> dict:
    """Import time of each module the CuPy path needs, in order, after ``import cudnn_attn`` (CPU-visible),
    and whether any of it imported JAX (it must not)."""
    import importlib

    result = {}
    for name in CALL_PATH_MODULES:
        start = time.perf_counter()
        importlib.import_module(name)
        result[name] = round(1e3 * (time.perf_counter() - start), 2)
    return {"imports_ms": result, "jax_imported": "jax" in sys.modules, "torch_imported": "torch" in sys.modules}


def breakdown(config, arrays) -> dict:
    """The public first call with its stages timed (:data:`_STAGES`), the modules it imported, and the
    imports it needs measured separately before it: ``import cudnn`` (the frontend module; cuDNN's
    libraries load with the first handle) and the library's call-path modules."""
    before = set(sys.modules)
    start = time.perf_counter()
    import cudnn  # noqa: F401

    import_cudnn_ms = 1e3 * (time.perf_counter() - start)
    start = time.perf_counter()
    watch = _Stopwatch()                  # imports the modules whose functions it times
    import_library_ms = 1e3 * (time.perf_counter() - start)
    imported_before = sorted({name.partition(".")[0] for name in set(sys.modules) - before})
    ready = set(sys.modules)
    start = time.perf_counter()
    facts = _api_call(config, arrays)
    total_ms = 1e3 * (time.perf_counter() - start)
    facts.update(watch.stop(), import_cudnn_ms=round(import_cudnn_ms, 2),
                 import_library_ms=round(import_library_ms, 2), call_ms=round(total_ms, 2))
    top = sum(ms for label, ms in facts["stages_ms"].items() if not label.startswith(" "))
    facts["stages_ms"]["other (sync, API glue, imports inside the call)"] = round(total_ms - top, 2)
    new = sorted({name.partition(".")[0] for name in set(sys.modules) - ready})
    facts.update(imported_before_call=imported_before, imported_during_call=new,
                 jax_imported="jax" in sys.modules)
    return facts


def child(spec: dict) -> dict:
    """One fresh-process measurement; ``spec``: path (api|graph), target (gpu|sm90), lengths, kernels."""
    start = time.perf_counter()
    import cudnn_attn  # noqa: F401

    result = {"import_s": time.perf_counter() - start, "jax_imported": "jax" in sys.modules}
    if spec["path"] == "import":
        return result
    if spec["path"] == "imports":
        return {**result, **call_path_imports()}
    if spec["target"] == "sm90":
        from cudnn_attn.graphs import driver_stub  # noqa: I001

        driver_stub.preload(Path(tempfile.gettempdir()) / "cudnn_attn_bench_stub")
    configs = [_config(n) for n in spec["lengths"]]
    setup = time.perf_counter()
    arrays = [None] * len(configs) if spec["target"] == "sm90" else [_inputs(c) for c in configs]
    result["setup_s"] = time.perf_counter() - setup
    from cudnn_attn.engine import preload

    result["cudnn_imported_at_call"] = "cudnn" in sys.modules and not preload.running()    # the thread's work done
    result["engines_s"] = preload.engines_seconds if not preload.running() else None
    if spec["path"] == "breakdown":
        result.update(breakdown(configs[0], arrays[0]))
        return result
    handle_start = time.perf_counter()
    call = _GraphPath(spec["target"], spec.get("kernels", False)) if spec["path"] == "graph" else _api_call
    result["graph_setup_s"] = time.perf_counter() - handle_start         # the graph path's own handle
    timings = []
    for config, inputs in zip(configs, arrays):
        t0 = time.perf_counter()
        facts = call(config, inputs)
        timings.append(time.perf_counter() - t0)
    result.update(facts, first_call_s=timings[-1], earlier_s=timings[:-1])
    return result


def dynamic_runtime() -> dict:
    """Device ms of the static and the dynamic-shape plan of one shape (CUDA events, median of rounds)."""
    import cudnn
    import cupy as cp

    from cudnn_attn.engine.launch import Launcher
    from cudnn_attn.graphs import TensorId, build_graph
    from cudnn_attn.persist.build import KernelCache

    stream = cp.cuda.Stream(non_blocking=True)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle, stream.ptr)
    kernels = KernelCache()
    shape = dict(B=4, N=16, K=16)
    for n in (2048, 3072):
        kernels.build(_config(n, **shape), "fwd", handle)
    config = _config(4096, **shape)
    graphs = {"static": build_graph(config, "fwd", handle), "dynamic": kernels.build(config, "fwd", handle)}
    q, k, v = _inputs(config)
    result = {name: {"plan": g.plan_name, "origin": g.origin} for name, g in graphs.items()}
    with stream:
        out = cp.empty(config.o_shape, q.dtype)
        workspace = cp.empty(max(max(g.workspace_size for g in graphs.values()), 1), cp.uint8)
    cp.cuda.runtime.deviceSynchronize()
    buffers = {TensorId.Q: q.data.ptr, TensorId.K: k.data.ptr, TensorId.V: v.data.ptr, TensorId.O: out.data.ptr}
    for name, graph in graphs.items():
        launch = Launcher(graph)
        for _ in range(3):
            launch(buffers, workspace.data.ptr, handle)
        rounds = []
        for _ in range(5):
            begin, end = cp.cuda.Event(), cp.cuda.Event()
            begin.record(stream)
            for _ in range(20):
                launch(buffers, workspace.data.ptr, handle)
            end.record(stream)
            end.synchronize()
            rounds.append(cp.cuda.get_elapsed_time(begin, end) / 20)
        result[name]["device_ms"] = statistics.median(rounds)
    result["dynamic_over_static"] = result["dynamic"]["device_ms"] / result["static"]["device_ms"]
    return result


# ---------------------------------------------------------------------------------------------------
# The parent: scenarios, each a series of fresh processes
# ---------------------------------------------------------------------------------------------------
def _spawn(spec: dict, store: str | None) -> dict:
    env = dict(os.environ, CUDNN_ATTN_CACHE_DIR=store or "off", **spec.get("env", {}))
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True,
                         text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"child {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _precompile(store: str, target: str) -> float:
    length = SHAPE["T"]
    shape = ",".join(str(SHAPE[k] if k not in "TS" else length) for k in "BTSNKH")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "cudnn_attn", "precompile", "--shape", shape, "--dtype", "bf16",
                          "--mask", "causal", "--dir", store] + (["--target", target] if target else []),
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"precompile failed:\n{out.stdout}\n{out.stderr[-3000:]}")
    return time.perf_counter() - start


class Row(dict):
    """One scenario x path: the samples and their median."""


def _series(name: str, path: str, spec_for_run, runs: int, store_for_run, key: str = "first_call_s") -> Row:
    """``runs`` fresh processes; run ``i`` measures ``spec_for_run(i)`` over the store ``store_for_run(i)``."""
    samples, totals, setups, facts = [], [], [], {}
    try:
        for i in range(runs):
            facts = _spawn(spec_for_run(i), store_for_run(i))
            samples.append(facts[key])
            if "setup_s" in facts and key == "first_call_s":
                setups.append(facts["setup_s"])
                totals.append(facts["import_s"] + facts["setup_s"] + sum(facts["earlier_s"]) + facts[key])
    except RuntimeError as exc:           # one scenario failing must not hide the others
        print(f"  {name:28s} {path:6s} FAILED: {str(exc).splitlines()[0]}", flush=True)
        return Row(scenario=name, path=path, median_ms=float("nan"), error=str(exc)[-3000:])
    row = Row(scenario=name, path=path, median_ms=1e3 * statistics.median(samples),
              samples_ms=[round(1e3 * s, 2) for s in samples], runs=runs,
              origin=facts.get("origin"), plan=facts.get("plan"), launch_path=facts.get("launch_path"),
              jax_imported=facts.get("jax_imported"), plan_ms=_ms(facts.get("plan_s")),
              cudnn_imported_at_call=facts.get("cudnn_imported_at_call"), engines_ms=_ms(facts.get("engines_s")))
    if path == "graph":
        row["handle_setup_ms"] = _ms(facts.get("graph_setup_s"))     # before the timed window
    if totals:                    # what the process waits for: import, the caller's setup, the call(s)
        row["to_result_ms"] = round(1e3 * statistics.median(totals), 1)
        row["setup_ms"] = round(1e3 * statistics.median(setups), 1)
    target = TARGETS_MS.get(name)
    if target is not None:
        row.update(target_ms=target, met=row["median_ms"] <= target)
    print(f"  {name:28s} {path:6s} {row['median_ms']:9.1f} ms  (origin {row['origin']}, runs {runs})", flush=True)
    return row


def scenarios(args: argparse.Namespace, work: Path) -> list[Row]:
    runs = 3 if args.quick else args.runs
    target = "sm90" if args.dry_run else "gpu"
    paths = ["graph"] if args.dry_run else ["api", "graph"]
    no_preload = {"CUDNN_ATTN_PRELOAD": "0"}          # stages measured whole, not overlapped with the preload
    with_preload = {"CUDNN_ATTN_PRELOAD": "1", "CUDNN_ATTN_PRELOAD_ENGINES": "1"}
    frontend_only = {"CUDNN_ATTN_PRELOAD": "1", "CUDNN_ATTN_PRELOAD_ENGINES": "0"}
    rows = [_series("import", "import", lambda i: {"path": "import", "env": with_preload}, max(runs, 5),
                    lambda i: None, key="import_s"),
            _series("import, preload off", "import", lambda i: {"path": "import", "env": no_preload}, max(runs, 5),
                    lambda i: None, key="import_s")]
    counter = iter(range(10 ** 6))

    def fresh(_: int) -> str:
        return str(work / f"empty-{next(counter)}")

    length = SHAPE["T"]
    rows.append(_stage_series("call-path imports", {"path": "imports", "env": no_preload}, max(runs, 5),
                              lambda i: None, "imports_ms"))
    for path in paths:
        base = {"path": path, "target": target, "lengths": [length]}
        rows.append(_series("cold", path, lambda i: base, runs, fresh))
        warm = str(work / f"warm-{path}")
        rows.append(_series("warm", path, lambda i: {**base, "env": with_preload}, runs, _primed(warm, base)))
        if path == "api":
            rows.append(_series("warm, engines not preloaded", path, lambda i: {**base, "env": frontend_only}, runs,
                                lambda i: warm))
            rows.append(_series("warm, preload off", path, lambda i: {**base, "env": no_preload}, runs,
                                lambda i: warm))
            rows.append(_stage_series("warm breakdown", {**base, "path": "breakdown", "env": no_preload}, runs,
                                      lambda i: warm, "stages_ms"))
            rows.append(_stage_series("warm breakdown, preloaded", {**base, "path": "breakdown", "env": with_preload},
                                      runs, lambda i: warm, "stages_ms"))
        three = {**base, "lengths": [length, length + 256, length + 512], "kernels": True}
        rows.append(_series("new length (same process)", path, lambda i: three, runs, fresh))
        known = str(work / f"known-{path}")
        family = {**base, "lengths": [length, length + 256], "kernels": True}        # static, then dynamic kernels
        rows.append(_series("new length (new process)", path,
                            lambda i: {**base, "kernels": True, "lengths": [length + 512 + 128 * i]}, runs,
                            _primed(known, family)))
    aot, note = args.aot_dir, "given (--aot-dir)"
    if aot is None:
        aot = str(work / "aot")
        try:
            note = f"built here by precompile --target sm90 in {_precompile(aot, 'sm90'):.1f} s"
        except RuntimeError as exc:
            note = f"precompile --target sm90 failed: {str(exc).splitlines()[0]}"
    for path in paths:
        row = _series("deviceless-built store", path, lambda i: {"path": path, "target": target, "lengths": [length]},
                      runs, lambda i: aot)
        row["note"] = note
        rows.append(row)
    if not args.dry_run:
        rows.append(_dynamic_runtime_row())
    return rows


def _stage_series(name: str, spec: dict, runs: int, store_for_run, key: str) -> Row:
    """``runs`` fresh processes of a child reporting named stages under ``key``: the median of each."""
    stages: dict[str, list[float]] = {}
    facts: dict = {}
    try:
        for i in range(runs):
            facts = _spawn(spec, store_for_run(i))
            for label, ms in facts[key].items():
                stages.setdefault(label, []).append(ms)
    except RuntimeError as exc:
        print(f"  {name:28s} FAILED: {str(exc).splitlines()[0]}", flush=True)
        return Row(scenario=name, path=spec["path"], median_ms=float("nan"), error=str(exc)[-3000:])
    medians = {label: round(statistics.median(values), 2) for label, values in stages.items()}
    total = sum(ms for label, ms in medians.items() if not label.startswith(" "))
    extra = {k: facts[k] for k in ("import_cudnn_ms", "import_library_ms", "call_ms", "imported_during_call",
                                   "imported_before_call", "stage_calls", "not_found", "origin") if k in facts}
    row = Row(scenario=name, path=spec["path"], median_ms=total, stages_ms=medians, runs=runs,
              jax_imported=facts.get("jax_imported"), **extra)
    print(f"  {name:28s} {spec['path']:6s} {total:9.1f} ms  " + ", ".join(f"{k.strip()} {v:.1f}"
                                                                      for k, v in medians.items()), flush=True)
    return row


def _primed(store: str, spec: dict):
    """A ``store_for_run`` that first fills ``store`` by one process running ``spec`` (not measured)."""
    def store_for_run(i: int) -> str:
        if i == 0:
            _spawn(spec, store)
        return store
    return store_for_run


def _dynamic_runtime_row() -> Row:
    try:
        result = _spawn({"path": "dynamic-runtime"}, None)
    except RuntimeError as exc:
        return Row(scenario="dynamic runtime", path="graph", median_ms=float("nan"), error=str(exc)[-3000:])
    return Row(scenario="dynamic runtime", path="graph", median_ms=result["dynamic"]["device_ms"],
               static_ms=result["static"]["device_ms"], ratio=result["dynamic_over_static"],
               plan=f"{result['static']['plan']} / {result['dynamic']['plan']}", origin=result["dynamic"]["origin"])


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 2)


def importtime() -> list[tuple[str, float]]:
    """The largest cumulative import times of ``import cudnn_attn`` (ms), from ``python -X importtime``."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import cudnn_attn"], capture_output=True,
                         text=True, timeout=300)
    entries = []
    for line in out.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = (part.strip() for part in line[len("import time:"):].split("|"))
            if cumulative.isdigit():
                entries.append((name, int(cumulative) / 1e3))
    return sorted(entries, key=lambda e: -e[1])[:15]


def table(rows: list[Row], imports: list[tuple[str, float]]) -> str:
    shape = ", ".join(f"{k}{v}" for k, v in SHAPE.items())
    lines = [f"== first call of a new process, bf16 {shape} causal fwd (ms, median of the processes; "
             f"run_all's summary starts here)",
             f"{'scenario':28s} {'path':6s} {'median ms':>10s} {'target':>7s}  {'origin':22s} plan / notes"]
    for r in rows:
        target = f"{r['target_ms']:.0f}" if "target_ms" in r else "-"
        verdict = "" if "met" not in r else ("  OK" if r["met"] else "  MISS")
        extra = r.get("plan") or ""
        if r.get("plan_ms") is not None:
            extra += f" (build/load {r['plan_ms']:.1f} ms)"
        if r.get("launch_path"):
            extra += f" launch {r['launch_path']}"
        if r.get("handle_setup_ms") is not None:
            extra += f" (+ own handle/stream {r['handle_setup_ms']:.1f} ms before the window)"
        if "ratio" in r:
            extra += f"  static {r['static_ms']:.3f} ms, dynamic/static {r['ratio']:.3f}"
        if r.get("note"):
            extra += f"  ({r['note']})"
        if r.get("to_result_ms") is not None and r["path"] == "api":
            extra += f"  (setup {r['setup_ms']:.0f} ms; import to result {r['to_result_ms']:.0f} ms"
            extra += f"; preload {'done' if r.get('cudnn_imported_at_call') else 'NOT done'} at the call"
            extra += f"; engine libraries loaded in {r['engines_ms']:.1f} ms)" if r.get("engines_ms") else ")"
        if r.get("jax_imported"):
            extra += "  JAX WAS IMPORTED"
        if r.get("error"):
            extra += f"  FAILED: {r['error'].strip().splitlines()[-1][:120]}"
        lines.append(f"{r['scenario']:28s} {r['path']:6s} {r['median_ms']:10.1f} {target:>7s}  "
                     f"{str(r.get('origin') or '-'):22s} {extra}{verdict}".rstrip())
        for label, ms in (r.get("stages_ms") or {}).items():
            lines.append(f"    {label:60s} {ms:9.2f} ms")
        if r.get("import_cudnn_ms") is not None:
            lines.append(f"    (before the call: import cudnn {r['import_cudnn_ms']:.1f} ms, call-path modules "
                         f"{r['import_library_ms']:.1f} ms; the call itself {r['call_ms']:.1f} ms; imported during "
                         f"the call: {', '.join(r.get('imported_during_call') or []) or 'nothing'})")
    lines.append("import cudnn_attn, largest cumulative entries: "
                 + ", ".join(f"{name} {ms:.0f} ms" for name, ms in imports[:8]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per measurement (median)")
    parser.add_argument("--quick", action="store_true", help="3 runs per measurement")
    parser.add_argument("--dry-run", action="store_true", help="only what a CPU can run (deviceless H200 target)")
    parser.add_argument("--aot-dir", help="a store filled by 'precompile --target sm90' elsewhere (a CPU machine)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        result = dynamic_runtime() if spec["path"] == "dynamic-runtime" else child(spec)
        print(json.dumps(result))
        return
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_first_call-") as work:
        rows = scenarios(args, Path(work))
    imports = importtime()
    with open(os.path.join(args.out, "bench_first_call.json"), "w") as f:
        json.dump({"shape": SHAPE, "dry_run": args.dry_run, "rows": rows, "importtime_ms": imports}, f, indent=1)
    print(table(rows, imports))


if __name__ == "__main__":
    main()
