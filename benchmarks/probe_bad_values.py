"""What cuDNN 9.19 does with out-of-range lengths, offsets and page ids (issue #11.1) - a GPU probe, not a test.

Each case runs the library's cuDNN graph *raw* (built by :func:`cudnn_attn.graphs.build_graph`, bound and
executed here, no clamping) on one kind of bad value, in its own subprocess (a corrupted context or an
illegal address then ends only that case), and again after :func:`cudnn_attn.core.values.sanitize`.  Every
tensor sits inside a guarded allocation ``[guard | tensor | guard]`` whose guards hold NaN bytes (0xFF):
afterwards the guards must be intact (no write outside the tensor) and the results finite (no read of a
guard: a NaN read outside K/V or a table propagates into the output).  Result tensors start as zeros.

Run on the GPU machine::

    python benchmarks/probe_bad_values.py --out probe.json            # guards: adjacent reads/writes
    compute-sanitizer --tool memcheck --target-processes all \\
        python benchmarks/probe_bad_values.py --guard-bytes 0 --out probe-memcheck.json

With ``--guard-bytes 0`` every tensor is its own ``cudaMalloc`` allocation (CuPy's pool is switched off
in the case processes), so compute-sanitizer reports any access outside a tensor; its report names the
kernel and the address.  A case "passes" when it neither errs nor touches a guard nor produces NaN; the
table says what happened for each case, raw and sanitized.  ``--cases a,b`` runs a subset, ``--list``
names them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

B, T, S, N, H = 2, 64, 64, 4, 64
BLOCK, BLOCKS_PER_SEQ, NUM_BLOCKS = 16, 4, 8
M = 3
GUARD_BYTE = 0xFF          # NaN in float16 and float32; -1 in int32


@dataclass(frozen=True)
class Case:
    """One kind of bad value: the call's arrays (NumPy) and whether the backward runs too."""

    name: str
    kind: str                                       # "padded", "packed" or "paged"
    arrays: dict = field(default_factory=dict)
    backward: bool = False


def _padded(name: str, q_seqlen: list, kv_seqlen: list, backward: bool = False) -> Case:
    return Case(name, "padded", dict(q_seqlen=q_seqlen, kv_seqlen=kv_seqlen), backward)


def _packed(name: str, q_seqlen: list, q_offsets: list, backward: bool = False) -> Case:
    return Case(name, "packed", dict(q_seqlen=q_seqlen, kv_seqlen=q_seqlen, q_offsets=q_offsets, kv_offsets=q_offsets),
                backward)


def _paged(name: str, kv_seqlen: list, table: list) -> Case:
    return Case(name, "paged", dict(q_seqlen=[T, T], kv_seqlen=kv_seqlen, page_table_k=table, page_table_v=table))


GOOD_TABLE = [[0, 1, 2, 3], [4, 5, 6, 7]]
CASES = {case.name: case for case in (
    _padded("control-padded", [40, 64], [50, 64], backward=True),
    _padded("kv_seqlen=999", [64, 64], [999, 64]),
    _padded("kv_seqlen=999-bwd", [64, 64], [999, 64], backward=True),
    _padded("kv_seqlen=-5", [64, 64], [-5, 64]),
    _padded("q_seqlen=999", [999, 64], [64, 64]),
    _padded("q_seqlen=999-bwd", [999, 64], [64, 64], backward=True),
    _padded("q_seqlen=-1", [-1, 64], [64, 64]),
    _padded("int32-max", [2 ** 31 - 1, 64], [2 ** 31 - 1, 64]),
    _packed("control-packed", [[20, 30, -1], [64, -1, -1]], [[0, 20, -1, -1], [0, -1, -1, -1]], backward=True),
    _packed("packed-offset-past-row", [[20, 30, -1], [64, -1, -1]], [[0, 50, -1, -1], [0, -1, -1, -1]]),
    _packed("packed-offset-past-row-bwd", [[20, 30, -1], [64, -1, -1]], [[0, 50, -1, -1], [0, -1, -1, -1]],
            backward=True),
    _packed("packed-length-999", [[20, 999, -1], [64, -1, -1]], [[0, 20, -1, -1], [0, -1, -1, -1]]),
    _packed("packed-offset-999", [[20, 30, -1], [64, -1, -1]], [[0, 999, -1, -1], [0, -1, -1, -1]]),
    _packed("packed-out-of-order", [[20, 30, -1], [64, -1, -1]], [[30, 0, -1, -1], [0, -1, -1, -1]]),
    _paged("control-paged", [64, 40], GOOD_TABLE),
    _paged("page-id-999", [64, 64], [[0, 1, 999, 3], [4, 5, 6, 7]]),
    _paged("page-id-negative", [64, 64], [[0, 1, -3, 3], [4, 5, 6, 7]]),
    _paged("paged-kv_seqlen-999", [999, 64], GOOD_TABLE),
)}


# -- one case, in a subprocess ----------------------------------------------------------------------------

def _config(case: Case) -> tuple[Any, Any]:
    """The configuration and host operands of ``case`` (values as given: nothing is checked)."""
    from cudnn_attn import MaskType
    from cudnn_attn.core.validation import validate_call

    rng = np.random.default_rng(0)
    arrays = {n: np.asarray(v, np.int32) for n, v in case.arrays.items()}
    if case.kind == "paged":
        arrays = {n: x.reshape(B, 1, BLOCKS_PER_SEQ, 1) if n.startswith("page") else x for n, x in arrays.items()}
        k = rng.standard_normal((NUM_BLOCKS, BLOCK, N, H)).astype(np.float16)
    else:
        k = rng.standard_normal((B, S, N, H)).astype(np.float16)
    q = rng.standard_normal((B, T, N, H)).astype(np.float16)
    mask_type = MaskType.PADDING if case.kind != "packed" else MaskType.NO_MASK
    return validate_call(q, k, k.copy(), **arrays, mask_type=mask_type, training=case.backward, scale=H ** -0.5,
                         xp=np)


def _unmasked_logsumexp(config: Any, operands: Any) -> np.ndarray:
    """The backward's logsumexp input, ``(B, N, T)``: that of the unmasked scores, an upper bound of the
    masked one, so every probability the backward recomputes is at most 1.  (A constant logsumexp made
    exp(S - lse) overflow float16 and dQ/dK/dV non-finite in every case, the controls included.)"""
    q, k = (x.astype(np.float64) for x in (operands.query, operands.key))
    scores = config.scale * np.einsum("btnh,bsnh->bnts", q, k)
    top = scores.max(axis=-1, keepdims=True)
    return (top + np.log(np.exp(scores - top).sum(axis=-1, keepdims=True)))[..., 0].astype(np.float32)


class _Guarded:
    """Device tensors inside ``[guard | tensor | guard]`` allocations (one cudaMalloc each)."""

    def __init__(self, cupy: Any, guard: int):
        self.cupy, self.guard, self.raw = cupy, guard, {}

    def put(self, tid: Any, value: np.ndarray) -> Any:
        cp = self.cupy
        value = np.ascontiguousarray(value)
        raw = cp.full(value.nbytes + 2 * self.guard, GUARD_BYTE, cp.uint8)
        view = raw[self.guard:self.guard + value.nbytes].view(value.dtype).reshape(value.shape)
        view[...] = cp.asarray(value)
        self.raw[tid] = (raw, view)
        return view

    def pointers(self) -> dict:
        return {tid: view.data.ptr for tid, (_, view) in self.raw.items()}

    def touched_guards(self) -> list[str]:
        if not self.guard:
            return []
        bad = []
        for tid, (raw, _) in self.raw.items():
            if bool((raw[:self.guard] != GUARD_BYTE).any()) or bool((raw[-self.guard:] != GUARD_BYTE).any()):
                bad.append(tid.name)
        return bad


def _tensors(config: Any, operands: Any, kind: str) -> dict:
    """Host values of every tensor the ``kind`` graph binds (results: zeros)."""
    from cudnn_attn.graphs import packing
    from cudnn_attn.graphs.tensors import TensorId as T_

    rng = np.random.default_rng(1)
    io = np.float16
    found = {T_.Q: operands.query, T_.K: operands.key, T_.V: operands.value, T_.O: np.zeros(config.o_shape, io)}
    stats_shape = (config.batch * config.q_len, config.q_heads) if config.packing else config.lse_shape
    if config.packing is not None:
        segments = packing.segments(np, operands.q_seqlen, operands.kv_seqlen, operands.q_offsets, operands.kv_offsets,
                                    config.q_len, config.kv_len)
        found.update(packing.cudnn_buffers(np, config, segments))
    elif config.mask.padding:
        found.update({T_.SEQ_LEN_Q: operands.q_seqlen, T_.SEQ_LEN_KV: operands.kv_seqlen})
    if config.paging is not None:
        found.update({T_.PAGE_TABLE_K: operands.page_table_k, T_.PAGE_TABLE_V: operands.page_table_v})
    if kind == "bwd":
        lse = _unmasked_logsumexp(config, operands)
        if config.packing:                           # token-major rows (b, t), then heads
            lse = lse.transpose(0, 2, 1).reshape(stats_shape)
        found.update({T_.O: rng.standard_normal(config.o_shape).astype(io),
                      T_.DO: rng.standard_normal(config.o_shape).astype(io),
                      T_.STATS: lse.reshape(stats_shape),
                      T_.DQ: np.zeros(config.q_shape, io), T_.DK: np.zeros(config.k_shape, io),
                      T_.DV: np.zeros(config.v_shape, io)})
    elif config.training:
        found[T_.STATS] = np.zeros(stats_shape, np.float32)
    return found


RESULTS = ("O", "STATS", "DQ", "DK", "DV")


def run_case(case: Case, sanitized: bool, guard: int) -> dict:
    """Build, bind and execute the raw graph(s) of ``case``; what happened."""
    import cudnn
    import cupy as cp

    from cudnn_attn.core import values
    from cudnn_attn.graphs import build_graph

    cp.cuda.set_allocator(None)               # one cudaMalloc per array: compute-sanitizer sees each tensor
    config, operands = _config(case)
    if sanitized:
        operands = values.sanitize(config, operands, np)
    handle = cudnn.create_handle()
    report: dict = {"case": case.name, "sanitized": sanitized}
    for kind in ("fwd", "bwd") if case.backward else ("fwd",):
        graph = build_graph(config, kind, handle)
        tensors = _tensors(config, operands, kind)
        missing = set(graph.uids) - set(tensors)
        if missing:
            raise RuntimeError(f"the probe does not bind {sorted(t.name for t in missing)} of the {kind} graph")
        guarded = _Guarded(cp, guard)
        views = {tid: guarded.put(tid, np.asarray(tensors[tid])) for tid in graph.uids}
        workspace = cp.zeros(max(graph.workspace_size, 1), cp.uint8)
        graph.execute(guarded.pointers(), workspace.data.ptr, handle)
        cp.cuda.runtime.deviceSynchronize()
        # cuDNN writes non-finite logsumexp rows for padded queries (documented; the library zeroes them):
        # with padding only O/dQ/dK/dV say whether something outside the buffers was read.
        judged = RESULTS if not config.mask.padding else tuple(r for r in RESULTS if r != "STATS")
        nonfinite = {tid.name: int((~cp.isfinite(views[tid].astype(cp.float32))).sum())
                     for tid in views if tid.name in judged}
        report[kind] = {"touched_guards": guarded.touched_guards(),
                        "nonfinite": {k: v for k, v in nonfinite.items() if v}}
    return report


# -- the driver --------------------------------------------------------------------------------------------

def _in_subprocess(name: str, sanitized: bool, guard: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "case.json"
        command = [sys.executable, __file__, "--run-case", name, "--guard-bytes", str(guard), "--case-out", str(out)]
        if sanitized:
            command.append("--sanitized")
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"case": name, "sanitized": sanitized, "error": f"hung (> {timeout:.0f} s)"}
        # compute-sanitizer (when the probe runs under it) reports in the case process's output
        memcheck = [line.strip("= ").strip() for line in (done.stderr + done.stdout).splitlines()
                    if "Invalid __" in line or "out of bounds" in line or "ERROR SUMMARY" in line]
        if out.exists():
            return {**json.loads(out.read_text()), "memcheck": memcheck[:4]}
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"case": name, "sanitized": sanitized, "memcheck": memcheck[:4],
                "error": f"exit {done.returncode}: " + " | ".join(tail)}


def _verdict(report: dict) -> str:
    memory = [line for line in report.get("memcheck", []) if "ERROR SUMMARY: 0 errors" not in line]
    if "error" in report:
        return "ERROR " + report["error"][:90] + (f"; memcheck: {memory[0][:120]}" if memory else "")
    found = [f"memcheck: {memory[0][:120]}"] if memory else []
    for kind in ("fwd", "bwd"):
        if kind in report:
            if report[kind]["touched_guards"]:
                found.append(f"{kind}: wrote outside {report[kind]['touched_guards']}")
            if report[kind]["nonfinite"]:
                found.append(f"{kind}: non-finite {report[kind]['nonfinite']}")
    return "; ".join(found) or "clean"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", help="comma-separated subset (default: all)")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--guard-bytes", type=int, default=4 << 20, help="guard size around each tensor (0: none)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    parser.add_argument("--out", help="write the reports as JSON here")
    parser.add_argument("--run-case", help=argparse.SUPPRESS)
    parser.add_argument("--case-out", help=argparse.SUPPRESS)
    parser.add_argument("--sanitized", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(CASES))
        return 0
    if args.run_case:
        report = run_case(CASES[args.run_case], args.sanitized, args.guard_bytes)
        Path(args.case_out).write_text(json.dumps(report))
        return 0
    names = args.cases.split(",") if args.cases else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; --list names them")
    reports = []
    for name in names:
        for sanitized in (False, True):
            reports.append(_in_subprocess(name, sanitized, args.guard_bytes, args.timeout))
            print(f"{name:32s} {'sanitized' if sanitized else 'raw':9s} {_verdict(reports[-1])}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"guard_bytes": args.guard_bytes, "reports": reports}, indent=1))
    bad_sanitized = [r["case"] for r in reports if r["sanitized"] and _verdict(r) != "clean"]
    print(f"\nsanitized cases not clean: {bad_sanitized or 'none'}; environment CUDA_VISIBLE_DEVICES="
          f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(all)')}")
    return 1 if bad_sanitized else 0


if __name__ == "__main__":
    sys.exit(main())
