"""This library's JAX bridge against the fastest attention peers, under one ``jax.jit`` on one GPU (not a test).

    python benchmarks/bench_peers.py [--out OUT_DIR] [--quick] [--dry-run] [--max-seconds 280]

Implementations (bf16, BTNH, ``scale = 1/sqrt(D)``):

* ``ours``           - ``cudnn_attn.jax_bridge.dot_product_attention`` with its defaults;
* ``jax.nn cudnn``   - ``jax.nn.dot_product_attention(implementation="cudnn")``;
* ``jax.nn xla``     - ``jax.nn.dot_product_attention(implementation="xla")`` (the logits materialised);
* ``tokamax mosaic`` - ``tokamax.dot_product_attention(implementation="mosaic")``: the Pallas Mosaic GPU kernel;
* ``tokamax triton`` - ``tokamax.dot_product_attention(implementation="triton")``: the Pallas Triton kernel.

Tokamax imports ``xprof`` at module level for its profiler timers only; when ``xprof`` is not installed a
stub package is written to a temporary directory and put on ``sys.path`` before ``import tokamax``.  A peer
that fails to import, trace, compile or run is a row with its reason; it never stops the run.

Shapes: T=S=256 B1 N8 D64; T=S=1k, 4k (B4 N16 D128) and 16k (B1 N16 D128); causal and not (``--quick``:
256 and 4k, not causal).  Modes: ``fwd`` (inference forward) and ``fwd+bwd`` (``jax.vjp``, the gradients
of q, k and v).  The shapes of the issue's table come first, so that they survive a phase cut short.

Method (``bench_jax.program``): one jitted program runs a chain of dependent calls (each call's query is the
previous call's output; or its q, k and v are the previous call's dq, dk and dv, so that XLA removes no
gradient's work), so the chain is device-bound.  *Device time* per call is the GPU time
between two CUDA events that FFI markers record on XLA's stream before and after the chain, divided by the
chain's length (the host clock of the whole program when the markers fail: ``timer`` in the JSON); *wall* is
the host clock of the jitted call over the chain's length.  Medians over ``--rounds`` runs after warm-up.
TFLOP/s: forward ``4 B N T S D``, halved when causal; backward 2.5x that, so fwd+bwd 3.5x; the backward
alone is derived as fwd+bwd minus fwd (``bwd TF/s``).

FP8 (full mode): ``bench_fp8.run`` at T=S=4k B4 N16 D128, causal and not - the CuPy front with bf16 and with
FP8 E4M3 operands, forward and backward apart, CUDA events (the JAX bridge's FP8 path is not timed here).

Writes ``bench_peers.json`` and ``bench_peers.png`` into OUT_DIR, prints ratios to ours and a short table last.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_jax import StreamEvents, program  # noqa: E402  (the chain and its CUDA-event markers, shared)

from cudnn_attn import MaskType  # noqa: E402
from cudnn_attn import jax_bridge as jb  # noqa: E402

IMPLEMENTATIONS = ("ours", "jax.nn cudnn", "jax.nn xla", "tokamax mosaic", "tokamax triton")
MODES = ("fwd", "fwd+bwd")
TARGET_CHAIN_MS = 20.0           # a chain long enough that the host's dispatch hides behind the device
ASSUMED_TFLOPS = 400.0           # only to size the chain of each shape


@dataclass(frozen=True)
class Shape:
    B: int
    N: int
    T: int
    D: int
    causal: bool

    @property
    def name(self) -> str:
        length = f"{self.T // 1024}k" if self.T >= 1024 else str(self.T)
        return f"B{self.B} N{self.N} T=S={length} D{self.D}{' causal' if self.causal else ''}"

    def flops(self, mode: str) -> float:
        forward = 4.0 * self.B * self.N * self.T * self.T * self.D * (0.5 if self.causal else 1.0)
        return forward * (3.5 if mode == "fwd+bwd" else 1.0)

    def chain(self, mode: str) -> int:
        per_call_ms = self.flops(mode) / (ASSUMED_TFLOPS * 1e12) * 1e3
        return int(min(64, max(4, TARGET_CHAIN_MS / per_call_ms)))


@dataclass
class Row:
    shape: str
    mode: str
    impl: str
    chain: int = 0
    device_us: float | None = None
    wall_us: float | None = None
    tflops: float | None = None
    vs_ours: float | None = None          # device time / ours (< 1: faster than ours)
    error: str | None = None
    notes: dict = field(default_factory=dict)


def shapes(quick: bool) -> list[Shape]:
    issue = [Shape(1, 8, 256, 64, False), Shape(1, 16, 16384, 128, True), Shape(4, 16, 4096, 128, False)]
    if quick:
        return [issue[0], issue[2]]
    rest = [Shape(1, 8, 256, 64, True), Shape(4, 16, 1024, 128, False), Shape(4, 16, 1024, 128, True),
            Shape(4, 16, 4096, 128, True), Shape(1, 16, 16384, 128, False)]
    return issue + rest


# -- peers ---------------------------------------------------------------------------------------------

XPROF_STUB = {"xprof/__init__.py": "", "xprof/cli/__init__.py": "",
              "xprof/cli/tools.py": "get_kernel_stats_tool = None  # stub: tokamax's profiler timers are not used\n"}


def import_tokamax():
    """``import tokamax``, with a stub ``xprof`` on ``sys.path`` when the real one is not installed."""
    try:
        import xprof  # noqa: F401
    except ImportError:
        root = tempfile.mkdtemp(prefix="xprof_stub_")
        for path, text in XPROF_STUB.items():
            os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
            with open(os.path.join(root, path), "w") as f:
                f.write(text)
        sys.path.insert(0, root)
    import tokamax

    return tokamax


TOKAMAX_KERNELS = {"mosaic": ("pallas_mosaic_gpu", "mosaic_gpu"), "triton": ("pallas_triton", "triton")}


def tokamax_kernels() -> tuple[str, ...]:
    """The attention kernels tokamax registered (``implementation=`` names, "mosaic" as "mosaic_gpu")."""
    from tokamax._src.ops.attention import api

    return tuple(api.IMPLEMENTATIONS)


def attention(impl: str, shape: Shape):
    """``attend(q, k, v)`` of one implementation; raises when the peer cannot be imported."""
    scale = 1.0 / math.sqrt(shape.D)
    if impl.startswith("ours"):                 # "ours eager": XLA runs the handler on every execution
        mask, graph = MaskType.CAUSAL if shape.causal else MaskType.NO_MASK, None if impl == "ours" else False
        return lambda q, k, v: jb.dot_product_attention(q, k, v, scale=scale, mask_type=mask, cuda_graph=graph)
    if impl.startswith("jax.nn"):
        name = impl.split()[1]
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=shape.causal,
                                                            implementation=name)
    if impl.startswith("tokamax"):
        tokamax, name = import_tokamax(), impl.split()[1]
        kernel = TOKAMAX_KERNELS[name]
        if kernel[1] not in tokamax_kernels():      # tokamax drops a kernel whose import fails: say why
            importlib.import_module(f"tokamax._src.ops.attention.{kernel[0]}")
            raise RuntimeError(f"tokamax lists no {kernel[1]!r} kernel")
        return lambda q, k, v: tokamax.dot_product_attention(q, k, v, scale=scale, is_causal=shape.causal,
                                                             implementation=name)
    raise ValueError(f"unknown implementation {impl!r}")


def measure(row: Row, shape: Shape, inputs, rounds: int, events) -> None:
    """Device time from the stream events when they work, else the host clock (``notes["timer"]``)."""
    for timer in ((events, None) if events is not None else (None,)):
        row.error = None
        try:
            fn = program(attention(row.impl, shape), row.mode, row.chain, timer)
            start = time.perf_counter()
            out = jax.block_until_ready(fn(*inputs))
            row.notes["compile_and_first_call_s"] = round(time.perf_counter() - start, 3)
            row.notes["finite"] = all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in out)
            for _ in range(2):                   # XLA may capture its command buffers on a later run
                jax.block_until_ready(fn(*inputs))
            device, wall = [], []
            for _ in range(rounds):
                start = time.perf_counter()
                jax.block_until_ready(fn(*inputs))
                wall.append((time.perf_counter() - start) / row.chain * 1e6)
                if timer is not None:
                    device.append(timer.elapsed_ms() / row.chain * 1e3)
            row.wall_us = statistics.median(wall)
            row.device_us = statistics.median(device) if device else row.wall_us
            row.notes["timer"] = "cuda-events" if device else "host-clock"
            row.tflops = shape.flops(row.mode) / (row.device_us * 1e-6) / 1e12
            return
        except Exception as exc:                 # one failing peer must not hide the others
            row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            row.notes["traceback"] = traceback.format_exc()[-3000:]


def inputs_for(shape: Shape, rng: np.random.Generator):
    dims = (shape.B, shape.T, shape.N, shape.D)
    return tuple(jnp.asarray(rng.standard_normal(dims, np.float32), jnp.bfloat16) for _ in range(4))


def run(quick: bool, dry_run: bool, rounds: int, max_seconds: float) -> list[Row]:
    deadline = time.monotonic() + max_seconds
    events = None
    if not dry_run:
        events = StreamEvents()
    rng = np.random.default_rng(0)
    rows: list[Row] = []
    for shape in shapes(quick):
        inputs = None if dry_run else inputs_for(shape, rng)
        for mode in MODES:
            for impl in IMPLEMENTATIONS:
                row = Row(shape.name, mode, impl, chain=shape.chain(mode))
                rows.append(row)
                if dry_run:
                    row.error = "not run (--dry-run)"
                elif time.monotonic() > deadline:
                    row.error = f"skipped: past the phase's {max_seconds:.0f} s"
                else:
                    measure(row, shape, inputs, rounds, events)
                    print(f"  {row.shape:30s} {mode:8s} {impl:15s} device {_f(row.device_us, 1)} us  wall "
                          f"{_f(row.wall_us, 1)} us" + (f"  ERROR {row.error}" if row.error else ""), flush=True)
        del inputs
        jax.clear_caches()
    ratios(rows)
    return rows


def ratios(rows: list[Row]) -> None:
    ours = {(r.shape, r.mode): r.device_us for r in rows if r.impl == "ours" and r.device_us}
    for r in rows:
        base = ours.get((r.shape, r.mode))
        r.vs_ours = r.device_us / base if r.device_us and base else None


def fp8_rows(quick: bool, dry_run: bool) -> list[dict]:
    """bf16 and FP8 E4M3 forward/backward through the CuPy front at T=S=4k B4 N16 D128 (``bench_fp8``)."""
    if quick:
        return []
    try:
        import bench_fp8

        return [asdict(r) for r in bench_fp8.run(True, dry_run)]
    except Exception as exc:
        return [{"shape": "T=S=4k B=4", "impl": "fp8", "error": f"{type(exc).__name__}: {exc}"[:300]}]


# -- report --------------------------------------------------------------------------------------------

def _f(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _time(us: float | None) -> str:
    if us is None:
        return "-"
    return f"{us / 1e3:.3f} ms" if us >= 1000 else f"{us:.1f} us"


def table(rows: list[Row], fp8: list[dict]) -> str:
    by = {(r.shape, r.mode, r.impl): r for r in rows}
    lines = [f"{'shape (bf16)':30s} {'impl':15s} {'fwd':>10s} {'x ours':>6s} {'fwd+bwd':>10s} {'x ours':>6s} "
             f"{'fwd TF/s':>8s} {'bwd TF/s':>8s}"]
    for shape in dict.fromkeys(r.shape for r in rows):
        for impl in IMPLEMENTATIONS:
            fwd, both = by.get((shape, "fwd", impl)), by.get((shape, "fwd+bwd", impl))
            backward = None
            if fwd and both and fwd.device_us and both.device_us and both.device_us > fwd.device_us:
                backward = 2.5 * fwd.tflops * fwd.device_us / (both.device_us - fwd.device_us)
            errors = "; ".join(f"{r.mode}: {r.error}" for r in (fwd, both) if r and r.error)
            lines.append(f"{shape:30s} {impl:15s} {_time(fwd and fwd.device_us):>10s} {_f(fwd and fwd.vs_ours):>6s} "
                         f"{_time(both and both.device_us):>10s} {_f(both and both.vs_ours):>6s} "
                         f"{_f(fwd and fwd.tflops, 0):>8s} {_f(backward, 0):>8s}" + (f"  {errors[:160]}" if errors else ""))
    for r in fp8:
        lines.append(f"FP8 table, {r.get('shape')} {r.get('impl')}: fwd {_f(r.get('fwd_tflops'), 0)} TF/s, bwd "
                     f"{_f(r.get('bwd_tflops'), 0)} TF/s" + (f"  {r['error']}" if r.get("error") else ""))
    lines.append("device time per call in a jitted chain (CUDA events on XLA's stream); x ours: time / ours' time "
                 "(< 1: faster than ours); bwd TF/s from fwd+bwd minus fwd")
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(16, 5.5))
    names = list(dict.fromkeys(r.shape for r in rows))
    width = 0.8 / len(IMPLEMENTATIONS)
    for ax, mode in zip(axes, MODES):
        for i, impl in enumerate(IMPLEMENTATIONS):
            values = [next((r.vs_ours or 0 for r in rows if (r.shape, r.mode, r.impl) == (n, mode, impl)), 0)
                      for n in names]
            ax.bar(np.arange(len(names)) + i * width, values, width, label=impl)
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel("device time / ours (lower is faster)")
        ax.set_title(f"bf16 attention, {mode}, jitted chain")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out", help="directory for bench_peers.json / .png")
    parser.add_argument("--quick", action="store_true", help="T=S=256 and 4k, not causal; no FP8 rows")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: the rows it would run, not run")
    parser.add_argument("--rounds", type=int, default=5, help="timed runs per row (median)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="rows after this are reported skipped (default 100 quick, 220 full)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    max_seconds = args.max_seconds or (100.0 if args.quick else 220.0)
    rows = run(args.quick, args.dry_run, args.rounds, max_seconds)
    fp8 = fp8_rows(args.quick, args.dry_run)
    device = None if args.dry_run else jax.devices()[0].device_kind
    with open(os.path.join(args.out, "bench_peers.json"), "w") as f:
        json.dump({"device": device, "jax": jax.__version__, "dry_run": args.dry_run, "rounds": args.rounds,
                   "rows": [asdict(r) for r in rows], "fp8": fp8}, f, indent=1)
    try:
        plot(rows, os.path.join(args.out, "bench_peers.png"))
    except Exception as exc:            # matplotlib missing: the JSON and the table still stand
        print(f"plot skipped: {type(exc).__name__}: {exc}")
    print(f"\n== attention peers on {device} (jax {jax.__version__}): ours = cudnn_attn.jax_bridge")
    print(table(rows, fp8))
    return 0


if __name__ == "__main__":
    sys.exit(main())
