"""Decode attention over a paged K/V cache on one GPU (not a test).

    python benchmarks/bench_decode.py --out bench_out [--quick] [--dry-run]

B=64 sequences of one query token, 32 query heads over 8 K/V heads, head dim 128, bf16; every
sequence holds ``kv_len`` cached tokens (4k, 8k, 16k, 32k; ``--quick``: 4k and 16k) in blocks of 64
tokens scattered through the cache in a shuffled order.

* ``paged``  - ``cudnn_attn.paged_attention`` over the shuffled cache (padding mask, full lengths);
* ``contig`` - ``cudnn_attn.dot_product_attention`` on the same keys and values gathered into a
  contiguous ``(B, S, 8, 128)`` cache;
* ``torch``  - ``torch.nn.functional.scaled_dot_product_attention(enable_gqa=True)`` on the gathered
  cache in torch's ``(B, 8, S, 128)`` layout, with torch's own backend choice;
* ``copy``   - a device-to-device copy of the K cache: this GPU's copy bandwidth, measured here.

Decode reads every cached byte once, so the figure of merit is bandwidth: bytes per call (K and V read,
Q read, O written) over device time, against the H200's measured copy bandwidth (about 4.3 TB/s).
Outputs of the three attention paths are cross-checked (``notes``).  Timing is
``bench_attention.event_ms`` (CUDA events around back-to-back calls, median of rounds).  ``--dry-run``
needs no GPU: it prints the table of the lengths it would run.

Decode through a growing cache (``--part growing``; :mod:`decode_growing`): one query against S keys, S one
more every call (B=4, 16 query / 4 K/V heads, d=64, bf16, S from 128), so every call is a new signature; per
call host time of ours, torch SDPA and a repeated call of one signature, and where a new-signature call's time
goes.  Writes ``bench_decode.json`` (and ``bench_decode_growing.json``) into ``--out`` and prints the
growing-cache table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import traceback
from dataclasses import asdict, dataclass, field

import decode_growing
import ml_dtypes
import numpy as np
from bench_attention import _f, event_ms

BATCH, Q_HEADS, KV_HEADS, DIM, BLOCK = 64, 32, 8, 128, 64
BF16 = np.dtype(ml_dtypes.bfloat16)
H200_COPY_TBPS = 4.3
IMPLEMENTATIONS = ("paged", "contig", "torch")


@dataclass
class Row:
    kv_len: int
    bytes: int
    us: dict = field(default_factory=dict)          # implementation -> device microseconds per call
    copy_tbps: float | None = None
    errors: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)

    def tbps(self, impl: str) -> float | None:
        us = self.us.get(impl)
        return self.bytes / (us * 1e-6) / 1e12 if us else None


def bytes_per_call(kv_len: int) -> int:
    """K and V read once, Q read, O written (bf16); the page table's few bytes are left out."""
    return 2 * (2 * BATCH * kv_len * KV_HEADS * DIM + 2 * BATCH * Q_HEADS * DIM)


def lengths(quick: bool) -> tuple[int, ...]:
    return (4096, 16384) if quick else (4096, 8192, 16384, 32768)


# -- one length ----------------------------------------------------------------------------------------
def measure(row: Row) -> None:
    import cupy as cp

    import cudnn_attn
    from cudnn_attn import MaskType

    S, blocks = row.kv_len, BATCH * row.kv_len // BLOCK
    scale = 1 / math.sqrt(DIM)

    def normal(*dims):
        return cp.random.standard_normal(dims, dtype=cp.float32).astype(BF16)

    q = normal(BATCH, 1, Q_HEADS, DIM)
    keys, values = normal(BATCH, S, KV_HEADS, DIM), normal(BATCH, S, KV_HEADS, DIM)   # the gathered cache
    order = cp.random.permutation(blocks)         # logical block i of the batch lives in cache block order[i]
    table = order.reshape(BATCH, 1, S // BLOCK, 1).astype(cp.int32)
    k_cache, v_cache = (cp.empty((blocks, BLOCK, KV_HEADS, DIM), BF16) for _ in range(2))
    k_cache[order] = keys.reshape(blocks, BLOCK, KV_HEADS, DIM)
    v_cache[order] = values.reshape(blocks, BLOCK, KV_HEADS, DIM)
    q_seqlen, kv_seqlen = cp.ones(BATCH, cp.int32), cp.full(BATCH, S, cp.int32)

    def paged():
        return cudnn_attn.paged_attention(q, k_cache, v_cache, q_seqlen, kv_seqlen, table, table, scale=scale,
                                          mask_type=MaskType.PADDING)

    def contig():
        return cudnn_attn.dot_product_attention(q, keys, values, scale=scale)

    outputs = {}
    for impl, fn in (("paged", paged), ("contig", contig)):
        try:
            outputs[impl] = fn()
            row.us[impl] = event_ms(fn) * 1e3
        except Exception as exc:  # one path failing must not hide the others
            _record(row, impl, exc)
    try:
        outputs["torch"] = _bench_torch(row, q, keys, values, scale)
    except Exception as exc:
        _record(row, "torch", exc)
    copy = cp.empty_like(k_cache)
    row.copy_tbps = 2 * copy.nbytes / (event_ms(lambda: cp.copyto(copy, k_cache)) * 1e-3) / 1e12
    reference = outputs.get("contig")
    for impl in ("paged", "torch"):
        if reference is not None and outputs.get(impl) is not None:
            got, want = outputs[impl].astype(cp.float32), reference.astype(cp.float32)
            row.notes[f"max_abs_diff_{impl}_vs_contig"] = float(cp.abs(got - want).max())


def _bench_torch(row: Row, q, keys, values, scale: float):
    """torch SDPA on the gathered cache; returns its output in our (B, 1, N, D) layout."""
    import cupy as cp
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch has no CUDA device")
    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2).contiguous() for x in (q, keys, values))   # (B, N, S, D)

    def attend():
        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, scale=scale, enable_gqa=True)

    with torch.no_grad():
        out = attend()
        row.us["torch"] = event_ms(attend, torch.cuda.current_stream().cuda_stream) * 1e3
    return cp.from_dlpack(out.transpose(1, 2).contiguous())


def _record(row: Row, impl: str, exc: Exception) -> None:
    row.errors[impl] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    row.notes[f"traceback_{impl}"] = traceback.format_exc()[-2000:]


# -- run, table ----------------------------------------------------------------------------------------
def run(quick: bool, dry_run: bool) -> list[Row]:
    rows = []
    for kv_len in lengths(quick):
        row = Row(kv_len, bytes_per_call(kv_len))
        rows.append(row)
        if dry_run:
            continue
        import cupy as cp

        measure(row)
        print(f"  kv {kv_len:6d}: " + "  ".join(f"{impl} {_f(row.us.get(impl), 1)} us" for impl in IMPLEMENTATIONS)
              + "".join(f"  {impl} ERROR {e}" for impl, e in row.errors.items()), flush=True)
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def table(rows: list[Row]) -> str:
    lines = [f"== decode: B={BATCH}, {Q_HEADS} q / {KV_HEADS} kv heads, d={DIM}, bf16, paged blocks of {BLOCK} "
             f"(bandwidth in TB/s; H200 copy ~{H200_COPY_TBPS} TB/s)",
             f"{'kv len':>6s} {'GB/call':>7s} {'paged us':>9s} {'TB/s':>5s} {'%copy':>5s} {'contig us':>9s} "
             f"{'TB/s':>5s} {'torch us':>9s} {'TB/s':>5s} {'copy TB/s':>9s}"]
    for r in rows:
        paged = r.tbps("paged")
        share = None if paged is None else 100 * paged / H200_COPY_TBPS
        lines.append(f"{r.kv_len // 1024:>5d}k {r.bytes / 1e9:7.2f} {_f(r.us.get('paged'), 1):>9s} {_f(paged, 2):>5s} "
                     f"{_f(share, 0):>5s} {_f(r.us.get('contig'), 1):>9s} {_f(r.tbps('contig'), 2):>5s} "
                     f"{_f(r.us.get('torch'), 1):>9s} {_f(r.tbps('torch'), 2):>5s} {_f(r.copy_tbps, 2):>9s}"
                     + "".join(f"  {impl}: {e}" for impl, e in r.errors.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--quick", action="store_true", help="only kv lengths 4k and 16k")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: print the table of the lengths")
    parser.add_argument("--part", nargs="*", choices=("paged", "growing"), default=["paged", "growing"],
                        help="the paged-cache bandwidth table, the growing-cache host table (default: both)")
    parser.add_argument("--steps", type=int, default=None, help="growing cache: calls per pass (default 48, "
                        "quick 16)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if "paged" in args.part:
        rows = run(args.quick, args.dry_run)
        with open(os.path.join(args.out, "bench_decode.json"), "w") as f:
            json.dump({"dry_run": args.dry_run, "batch": BATCH, "q_heads": Q_HEADS, "kv_heads": KV_HEADS, "dim": DIM,
                       "block": BLOCK, "rows": [asdict(r) for r in rows]}, f, indent=1)
        print(table(rows))
    if "growing" in args.part:
        print()
        decode_growing.main(args.out, args.steps or (16 if args.quick else 48), args.dry_run)


if __name__ == "__main__":
    main()
