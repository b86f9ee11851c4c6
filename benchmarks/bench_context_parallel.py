"""Context parallelism on 2 GPUs against one GPU: causal attention forward + backward (not a test).

    python benchmarks/bench_context_parallel.py [--out OUT_DIR] [--quick] [--dry-run] [--rounds 5]

Problem: bf16, BTNH, B=1, H=16, D=128, causal, T=S=32k and 64k (``--quick``: 32k only); one training
step of attention = forward with the logsumexp and backward (``jax.value_and_grad``).

Runs: ``1 GPU`` (the whole sequence on one device) and, with the sequence sharded over 2 GPUs, the
``ring`` and ``all_gather`` schemes, each in the natural and the load-balanced order
(``jax_bridge.load_balance``).

Method: after two warm-up calls, ``--calls`` jitted calls are dispatched back to back (pipelined) and
the host clock is read around ``block_until_ready`` of the last result; the time per call is that span
divided by the number of calls, the median of ``--rounds`` rounds.  Speed-up = one-GPU time / two-GPU
time for the same problem (ideal: 2).  TFLOP/s count ``3.5 * 4 B H T S D / 2`` (causal fwd + bwd) per
call.  Memory per GPU: XLA's compiled memory analysis of the program (arguments + outputs + temporaries,
per device), a measured property of the compiled program.  Longest sequence that fits: *derived* from
that measurement - bytes per token at the benchmarked length (attention memory is linear in T) against
the device's ``bytes_limit`` (``device.memory_stats()``), so ``T_max = bytes_limit / (bytes / token)``.  The
``1 GPU`` program is also compiled for the CPU (not run), whose analysis is what the CPU tests bound
(``tests/test_context_parallel_memory.py``): the two side by side.  On one GPU only the ``1 GPU`` row runs.

``--dry-run`` runs the same code on 2 fake CPU devices (the NumPy reference behind the same primitives)
at tiny shapes, to check the script.  Writes ``bench_context_parallel.json`` into OUT_DIR and prints the
table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="directory for bench_context_parallel.json")
    parser.add_argument("--quick", action="store_true", help="T=S=32k only")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on 2 fake CPU devices")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=4, help="pipelined calls per round")
    return parser.parse_args()


ARGS = _parse()
if ARGS.dry_run:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from cudnn_attn import MaskType  # noqa: E402
from cudnn_attn import jax_bridge as jb  # noqa: E402


@dataclass
class Row:
    length: int
    run: str
    gpus: int
    ms: float | None = None
    tflops: float | None = None
    speedup: float | None = None
    bytes_per_device: int | None = None
    max_length: int | None = None
    error: str | None = None
    notes: dict = field(default_factory=dict)


def _flops(B: int, H: int, T: int, D: int) -> float:
    return 3.5 * 4.0 * B * H * T * T * D / 2


def _step(context):
    def loss(q, k, v, dout):
        out = jb.dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask_type=MaskType.CAUSAL,
                                       context_parallel=context)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _time(fn, args) -> float:
    """Median seconds per call of ``ARGS.calls`` pipelined calls, after warm-up."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    rounds = []
    for _ in range(ARGS.rounds):
        start = time.perf_counter()
        for _ in range(ARGS.calls):
            result = fn(*args)
        jax.block_until_ready(result)
        rounds.append((time.perf_counter() - start) / ARGS.calls)
    return statistics.median(rounds)


def _bytes_per_device(fn, args) -> int | None:
    analysis = fn.lower(*args).compile().memory_analysis()
    if analysis is None:
        return None
    return int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes + analysis.temp_size_in_bytes
               - analysis.alias_size_in_bytes)


def _bytes_limit(device) -> int | None:
    stats = device.memory_stats() or {}
    return stats.get("bytes_limit")


def run_length(devices, B: int, H: int, T: int, D: int, dtype) -> list[Row]:
    keys = jax.random.split(jax.random.PRNGKey(T), 4)
    q, k, v, dout = (jax.random.normal(key, (B, T, H, D), dtype) for key in keys)
    rows = []
    runs = [("1 GPU", None, False)] + [(f"{scheme}{' +balance' if balanced else ''}", scheme, balanced)
                                       for scheme in ("ring", "all_gather") for balanced in (False, True)]
    if len(devices) < 2:
        runs = runs[:1]
    mesh = jax.make_mesh((2,), ("sp",), devices=devices[:2]) if len(devices) >= 2 else None
    limit = _bytes_limit(devices[0])
    for name, scheme, balanced in runs:
        gpus = 1 if scheme is None else 2
        row = Row(T, name, gpus)
        try:
            if scheme is None:
                args = [jax.device_put(x, devices[0]) for x in (q, k, v, dout)]
                fn = _step(None)
                if not ARGS.dry_run:         # the same program compiled for the CPU (never run), for comparison
                    cpu = jax.devices("cpu")[0]
                    row.notes["cpu_analysis_bytes"] = _bytes_per_device(fn, [jax.device_put(x, cpu) for x in args])
            else:
                context = jb.ContextParallel(scheme, load_balance=2 if balanced else None)
                order = (lambda x: jb.load_balance(x, 2)) if balanced else (lambda x: x)
                args = [jax.device_put(order(x), NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v, dout)]
                fn = _step(context)
            row.bytes_per_device = _bytes_per_device(fn, args)
            seconds = _time(fn, args)
            row.ms = seconds * 1e3
            row.tflops = _flops(B, H, T, D) / seconds / 1e12
            if row.bytes_per_device and limit:
                row.max_length = int(limit / (row.bytes_per_device / T))
                row.notes["max_length"] = "derived: bytes_limit / (bytes per device / T)"
            del args, fn
        except Exception as error:  # noqa: BLE001  (a benchmark row records its failure and goes on)
            row.error = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            traceback.print_exc()
        rows.append(row)
    base = next((r.ms for r in rows if r.gpus == 1 and r.ms), None)
    for row in rows:
        if base and row.ms:
            row.speedup = base / row.ms
    return rows


def _table(rows: list[Row]) -> str:
    lines = [f"{'T=S':>7} {'run':<20} {'GPUs':>4} {'ms':>9} {'TFLOP/s':>8} {'speed-up':>8} {'GiB/GPU':>8} "
             f"{'T max (derived)':>15}"]
    for r in rows:
        if r.error:
            lines.append(f"{r.length:>7} {r.run:<20} {r.gpus:>4} {r.error}")
            continue
        gib = f"{r.bytes_per_device / 2**30:.2f}" if r.bytes_per_device else "-"
        lines.append(f"{r.length:>7} {r.run:<20} {r.gpus:>4} {r.ms:9.2f} {r.tflops:8.1f} {r.speedup or 0:8.2f} "
                     f"{gib:>8} {r.max_length or '-':>15}")
        if r.notes.get("cpu_analysis_bytes"):
            lines.append(f"{'':>7} {'  same, compiled for CPU':<20} {'':>4} {'':>9} {'':>8} {'':>8} "
                         f"{r.notes['cpu_analysis_bytes'] / 2**30:8.2f}")
    return "\n".join(lines)


def main() -> int:
    if ARGS.dry_run:
        devices = jax.devices("cpu")
        B, H, D, lengths, dtype = 1, 2, 64, [64, 128], jnp.float16
    else:
        devices = jax.devices("gpu")
        B, H, D, dtype = 1, 16, 128, jnp.bfloat16
        lengths = [32768] if ARGS.quick else [32768, 65536]
    if len(devices) < 2:
        print(f"one device ({devices[0]}): the 1 GPU row alone (the schemes need 2)", file=sys.stderr)
    rows = []
    for T in lengths:
        rows += run_length(devices, B, H, T, D, dtype)
    result = {"device": devices[0].device_kind, "B": B, "H": H, "D": D, "dtype": jnp.dtype(dtype).name,
              "calls": ARGS.calls, "rounds": ARGS.rounds, "dry_run": ARGS.dry_run, "rows": [asdict(r) for r in rows]}
    os.makedirs(ARGS.out, exist_ok=True)
    path = os.path.join(ARGS.out, "bench_context_parallel.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    print(f"\ncontext parallelism, {result['device']}, B={B} H={H} D={D} {result['dtype']} causal fwd+bwd")
    print(_table(rows))
    return 0 if all(r.error is None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
