"""The JAX bridge against JAX's own cuDNN attention, under ``jax.jit`` on one GPU (not a test).

    python benchmarks/bench_jax.py [--out OUT_DIR] [--quick] [--chain 16] [--rounds 5]

Implementations (bf16, BTNH):

* ``ours``       - ``cudnn_attn.jax_bridge.dot_product_attention`` (the cuDNN graph on XLA's stream) with
                   its defaults: XLA may capture the call into its CUDA graphs (command buffers);
* ``ours-eager`` - the same with ``cuda_graph=False``: XLA runs the Python handler on every execution;
* ``jax``        - ``jax.nn.dot_product_attention(implementation="cudnn")``.

Shapes: B=4 H=16 D=128 at T=S=1k, 4k, 16k (``--quick``: 1k, 4k), causal and not; plus B=1 H=8 T=S=256
D=64 for the per-call overhead.  Modes: ``fwd`` (inference forward) and ``fwd+bwd`` (training forward
and backward through ``jax.vjp``).

Method (:func:`program`): one jitted program runs ``--chain`` dependent calls (each call's query is the previous
call's output; for fwd+bwd its q, k and v are the previous call's dq, dk and dv).  *Device time* per call is the GPU time between two CUDA events that
small FFI markers record on XLA's own stream before and after the chain, divided by the chain length:
it includes the gaps the host leaves between kernels, which is what the per-call overhead costs on
the device.  *Wall* per call is the host clock of the whole jitted call (dispatch included) divided
by the chain length.  Medians over ``--rounds`` runs after warm-up.  TFLOP/s count ``4 B H T S D``
for the forward (halved when causal) and 3.5x that for forward+backward.

Writes ``bench_jax.json`` into OUT_DIR and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import cupy as cp  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from cudnn_attn import MaskType  # noqa: E402
from cudnn_attn import jax_bridge as jb  # noqa: E402
from cudnn_attn.jax_bridge import ffi  # noqa: E402


@dataclass(frozen=True)
class Shape:
    B: int
    H: int
    T: int
    D: int
    causal: bool

    @property
    def name(self) -> str:
        return f"B{self.B} H{self.H} T=S={self.T} D{self.D}{' causal' if self.causal else ''}"

    def flops(self, mode: str) -> float:
        forward = 4.0 * self.B * self.H * self.T * self.T * self.D * (0.5 if self.causal else 1.0)
        return forward * (3.5 if mode == "fwd+bwd" else 1.0)


@dataclass
class Row:
    shape: str
    mode: str
    impl: str
    device_us: float | None = None
    wall_us: float | None = None
    tflops: float | None = None
    error: str | None = None
    notes: dict = field(default_factory=dict)


# -- CUDA events on XLA's stream -----------------------------------------------------------------------

class StreamEvents:
    """Two FFI markers that record CUDA events on XLA's stream, around a computation.

    A marker takes an array and returns it (aliased: no copy), so the computation can be made to depend
    on it; its handler records ``events[slot]`` on the stream XLA runs it on.
    """

    def __init__(self):
        self.events: list = [None, None]   # created by the handler, in the context of XLA's stream
        self._handler = ffi.make_handler("cudnn_attn_bench_event", self._record)
        ffi.register(self._handler, "CUDA")

    def _record(self, call: ffi.Call) -> None:
        slot = call.attributes()["slot"]
        if self.events[slot] is None:
            self.events[slot] = cp.cuda.Event()
        cp.cuda.runtime.eventRecord(self.events[slot].ptr, call.stream())

    def mark(self, x: jax.Array, slot: int) -> jax.Array:
        return jax.ffi.ffi_call("cudnn_attn_bench_event", jax.ShapeDtypeStruct(x.shape, x.dtype),
                                input_output_aliases={0: 0}, has_side_effect=True)(x, slot=np.int64(slot))

    def elapsed_ms(self) -> float:
        self.events[1].synchronize()
        return cp.cuda.get_elapsed_time(self.events[0], self.events[1])


# -- the timed programs ------------------------------------------------------------------------------

def attention(impl: str, shape: Shape):
    scale = 1.0 / math.sqrt(shape.D)
    if impl == "jax":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=shape.causal,
                                                            implementation="cudnn")
    mask = MaskType.CAUSAL if shape.causal else MaskType.NO_MASK
    if impl == "ours-eager":
        return lambda q, k, v: jb.dot_product_attention(q, k, v, scale=scale, mask_type=mask, cuda_graph=False)
    return lambda q, k, v: jb.dot_product_attention(q, k, v, scale=scale, mask_type=mask)


def program(attend, mode: str, chain: int, events: StreamEvents | None):
    """The jitted chain of ``chain`` dependent calls of ``attend(q, k, v)``, between the two stream markers.

    ``fwd``: each call's output is the next call's query.  ``fwd+bwd``: each call's dq, dk and dv are the next
    call's q, k and v, so every gradient is consumed: with the query's gradient alone, XLA removes the dK/dV
    work of an implementation that computes it apart from dQ (Tokamax's kernels), and times a backward that
    never ran.  The end marker waits for all three (``lax.optimization_barrier``).

    ``attend`` is wrapped in ``jax.jit``, so that the chain's calls share one lowered function (XLA inlines it
    again; nothing changes at run time).  Unwrapped, every call of the chain is lowered on its own, and a Pallas
    kernel is compiled once per call: Tokamax's Mosaic GPU kernel took 56 s to compile a 64-call forward chain
    at T=S=256 and 190 s its fwd+bwd chain (H200)."""
    attend = jax.jit(attend)

    def step(q, k, v, do):
        if mode == "fwd":
            return attend(q, k, v), k, v
        return jax.vjp(attend, q, k, v)[1](do)

    def run(q, k, v, do):
        q = events.mark(q, 0) if events else q
        for _ in range(chain):
            q, k, v = step(q, k, v, do)
        q, k, v = jax.lax.optimization_barrier((q, k, v))
        return (events.mark(q, 1) if events else q), k, v

    return jax.jit(run)


def measure(impl: str, shape: Shape, mode: str, inputs, args, events: StreamEvents | None) -> Row:
    """Device time from the stream events when they work, else the host clock of the whole chain
    (``row.notes["timer"]`` says which)."""
    row = Row(shape.name, mode, impl)
    for timer in ((events, None) if events is not None else (None,)):
        row.error = None
        try:
            fn = program(attention(impl, shape), mode, args.chain, timer)
            start = time.perf_counter()
            jax.block_until_ready(fn(*inputs))
            row.notes["compile_and_first_call_s"] = round(time.perf_counter() - start, 3)
            for _ in range(2):
                jax.block_until_ready(fn(*inputs))
            device, wall = [], []
            for _ in range(args.rounds):
                start = time.perf_counter()
                jax.block_until_ready(fn(*inputs))
                wall.append((time.perf_counter() - start) / args.chain * 1e6)
                if timer is not None:
                    device.append(timer.elapsed_ms() / args.chain * 1e3)
            row.wall_us = statistics.median(wall)
            row.device_us = statistics.median(device) if device else row.wall_us
            row.notes["timer"] = "cuda-events" if device else "host-clock"
            row.tflops = shape.flops(mode) / (row.device_us * 1e-6) / 1e12
            return row
        except Exception as exc:                 # one failing row must not hide the others
            row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            traceback.print_exc()
    return row


def inputs_for(shape: Shape, rng: np.random.Generator):
    dims = (shape.B, shape.T, shape.H, shape.D)
    return tuple(jnp.asarray(rng.standard_normal(dims, np.float32), jnp.bfloat16) for _ in range(4))


# -- report ------------------------------------------------------------------------------------------

def table(rows: list[Row]) -> str:
    by_key = {(r.shape, r.mode, r.impl): r for r in rows}
    lines = [f"{'shape':32s} {'mode':8s} {'impl':11s} {'device us':>10s} {'wall us':>9s} {'TFLOP/s':>8s} "
             f"{'vs jax':>7s}"]
    for r in rows:
        jax_row = by_key.get((r.shape, r.mode, "jax"))
        ratio = (f"{r.device_us / jax_row.device_us:7.2f}" if r.impl != "jax" and r.device_us and jax_row
                 and jax_row.device_us else "")
        if r.error:
            lines.append(f"{r.shape:32s} {r.mode:8s} {r.impl:11s} FAILED {r.error}")
            continue
        clock = "*" if r.notes.get("timer") == "host-clock" else " "
        lines.append(f"{r.shape:32s} {r.mode:8s} {r.impl:11s} {r.device_us:9.1f}{clock} {r.wall_us:9.1f} "
                     f"{r.tflops:8.1f} {ratio:>7s}")
    lines.append("*: the stream-event markers failed; host clock of the chain instead")
    lines.append("vs jax: our device time / jax.nn.dot_product_attention(implementation='cudnn') device time "
                 "(< 1 is faster)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out", help="directory for bench_jax.json")
    parser.add_argument("--quick", action="store_true", help="T=S in {1k, 4k} only")
    parser.add_argument("--chain", type=int, default=16, help="dependent calls per jitted program")
    parser.add_argument("--rounds", type=int, default=5, help="timed runs per row (median)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = jax.devices("gpu")[0]
    events = StreamEvents()
    rng = np.random.default_rng(0)
    rows: list[Row] = []
    lengths = (1024, 4096) if args.quick else (1024, 4096, 16384)
    impls = ("ours", "ours-eager", "jax")
    plan = [(Shape(1, 8, 256, 64, causal), impls) for causal in (False, True)]
    plan += [(Shape(4, 16, t, 128, causal), impls) for t in lengths for causal in (False, True)]
    for shape, impls in plan:
        inputs = inputs_for(shape, rng)
        for mode in ("fwd", "fwd+bwd"):
            for impl in impls:
                row = measure(impl, shape, mode, inputs, args, events)
                rows.append(row)
                print(f"{row.shape:32s} {mode:8s} {impl:11s} device {row.device_us} us  wall {row.wall_us} us"
                      + (f"  {row.error}" if row.error else ""), flush=True)
        del inputs
    report = {
        "device": device.device_kind, "jax": jax.__version__, "cudnn": _cudnn_version(), "chain": args.chain,
        "rounds": args.rounds, "rows": [asdict(r) for r in rows],
    }
    with open(os.path.join(args.out, "bench_jax.json"), "w") as f:
        json.dump(report, f, indent=2)
    print()
    print(f"== JAX bridge vs jax.nn cuDNN attention on {device.device_kind} (jax {jax.__version__}, cuDNN "
          f"{report['cudnn']}, chain of {args.chain} calls per program)")
    print(table(rows))
    return 1 if any(r.error for r in rows) else 0


def _cudnn_version() -> int | None:
    try:
        import cudnn

        return int(cudnn.backend_version())
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
