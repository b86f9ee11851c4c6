"""``python -m cudnn_attn check``: about twenty configurations on this GPU against the NumPy reference.

Each case runs the forward (and, where cuDNN has one, the backward) through
:func:`cudnn_attn.engine.prepared.forward` / :func:`~cudnn_attn.engine.prepared.backward` on fresh random inputs
(seeded: a failing row prints its seed) and compares every result with :mod:`cudnn_attn.reference`:

* fp16/bf16 tensors: relative Frobenius error ``||gpu - ref|| / ||ref||`` at most 2e-3 (fp16) or 1e-2
  (bf16), about 4x the errors measured on the H200 (the GPU tier's bounds, ``tests/gpu/_checks.py``);
  the float32 logsumexp per element within ``1e-3 * max(1, |ref|)``;
* FP8: FlashAttention's rule against exact float64 on the dequantised inputs: at most twice the error
  of the reference's FP8 emulation plus 0.01;
* dropout: the reference is given cuDNN's own keep-mask (``rng_dump``).

A row reports the worst error as a fraction of its bound (``<= 1`` passes), ``MISMATCH`` or the error
raised.  Nothing here runs without a GPU.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from cudnn_attn import reference
from cudnn_attn.core.errors import UnsupportedConfigurationError
from cudnn_attn.core.types import FP8_PARAM_KEYS, MaskType
from cudnn_attn.core.validation import validate_call
from cudnn_attn.engine import prepared
from cudnn_attn.reference.inputs import random_operands

RELATIVE_TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}
LSE_TOLERANCE = 1e-3
FP8_MARGIN = 0.01


def io_dtype(name: str) -> np.dtype:
    import ml_dtypes

    extended = ("bfloat16", "float8_e4m3fn", "float8_e5m2")          # ml_dtypes' types, by NumPy name
    return np.dtype(getattr(ml_dtypes, name)) if name in extended else np.dtype(name)


def call_config(*, B: int = 2, T: int = 128, S: int = 128, N: int = 4, K: int | None = None, H: int = 64,
                Hv: int | None = None, dtype: str = "float16", layout: str = "BTNH", bias_shape: Any = None,
                segments: int | None = None, paged: dict | None = None, training: bool = True,
                scale: float | None = None, **call: Any):
    """The :class:`~cudnn_attn.core.config.AttentionConfig` that :func:`cudnn_attn.core.validation.validate_call` makes of
    a call with these shapes (only shapes and dtypes are read).  ``paged=dict(block=, blocks=, spare=)``
    describes K/V caches; an FP8 ``dtype`` means ``use_fp8=True``; other keywords go to ``prepare``."""

    K, Hv = K or N, Hv or H
    dt = io_dtype(dtype)
    fp8 = dtype.startswith("float8")

    def physical(length, heads, dim):
        return np.empty((B, length, heads, dim) if layout == "BTNH" else (B, heads, length, dim), dt)

    arrays: dict[str, Any] = {}
    key, value = physical(S, K, H), physical(S, K, Hv)
    if paged:
        blocks = B * paged["blocks"] + paged.get("spare", 0)
        block = paged["block"]
        key, value = (np.empty((blocks, block, K, d) if layout == "BTNH" else (blocks, K, block, d), dt)
                      for d in (H, Hv))
        table = np.empty((B, 1, paged["blocks"], 1), np.int32)
        arrays.update(page_table_k=table, page_table_v=table, q_seqlen=np.empty((B,), np.int32),
                      kv_seqlen=np.empty((B,), np.int32))
    elif segments:
        arrays.update(q_seqlen=np.empty((B, segments), np.int32), kv_seqlen=np.empty((B, segments), np.int32),
                      q_offsets=np.empty((B, segments + 1), np.int32), kv_offsets=np.empty((B, segments + 1), np.int32))
    elif call.get("mask_type") in (MaskType.PADDING, MaskType.PADDING_CAUSAL):
        arrays.update(q_seqlen=np.empty((B,), np.int32), kv_seqlen=np.empty((B,), np.int32))
    if bias_shape:
        arrays["bias"] = np.empty(bias_shape, dt)
    if fp8:
        call.update(use_fp8=True, fp8_params={name: np.ones((1, 1, 1, 1), np.float32) for name in FP8_PARAM_KEYS})
    config, _ = validate_call(physical(T, N, H), key, value, **arrays, qkv_layout=layout, training=training,
                              scale=1 / math.sqrt(H) if scale is None else scale, xp=np, **call)
    return config


# name: (call_config keywords, check the backward too)
CASES: dict[str, tuple[dict, bool]] = {
    "fp16 BTNH": (dict(), True),
    "bf16 BNTH causal": (dict(dtype="bfloat16", layout="BNTH", mask_type=MaskType.CAUSAL), True),
    "bf16 padding": (dict(dtype="bfloat16", mask_type=MaskType.PADDING), True),
    "fp16 padding+causal": (dict(mask_type=MaskType.PADDING_CAUSAL), True),
    "fp16 alibi": (dict(N=8, mask_type=MaskType.ALIBI), True),
    "fp16 causal bottom-right T<S": (dict(T=64, S=192, mask_type=MaskType.CAUSAL,
                                          diagonal_alignment="bottom_right"), True),
    "fp16 window 16": (dict(mask_type=MaskType.CAUSAL, sliding_window_length=16), True),
    "bf16 GQA 8:2 causal": (dict(dtype="bfloat16", N=8, K=2, mask_type=MaskType.CAUSAL), True),
    "fp16 MQA 8:1": (dict(N=8, K=1), True),
    "fp16 bias 1NTS": (dict(bias_shape=(1, 4, 128, 128)), True),
    "bf16 bias B1TS padding+causal": (dict(dtype="bfloat16", bias_shape=(2, 1, 128, 128),
                                           mask_type=MaskType.PADDING_CAUSAL), True),
    "fp16 dropout 0.1": (dict(dropout_rate=0.1), True),
    "fp16 packed 3 segments": (dict(segments=3), True),
    "bf16 packed 2 causal": (dict(dtype="bfloat16", segments=2, mask_type=MaskType.CAUSAL), True),
    "bf16 MLA 192:128 causal": (dict(dtype="bfloat16", H=192, Hv=128, mask_type=MaskType.CAUSAL), True),
    "bf16 d256": (dict(dtype="bfloat16", H=256), True),
    "fp16 sink causal": (dict(sink=np.empty((4,), np.float32), mask_type=MaskType.CAUSAL), True),
    "fp8 e4m3 d128 causal": (dict(dtype="float8_e4m3fn", H=128, T=256, S=256, mask_type=MaskType.CAUSAL,
                                  training=False), False),
    "fp8 e5m2 d128": (dict(dtype="float8_e5m2", H=128, T=256, S=256, training=False), False),
    "bf16 paged decode GQA 32:8": (dict(dtype="bfloat16", B=4, T=1, N=32, K=8, H=128, training=False,
                                        paged=dict(block=64, blocks=4, spare=3), mask_type=MaskType.PADDING), False),
    "fp16 paged prefill causal": (dict(B=2, T=64, N=8, K=2, H=128, training=False,
                                       paged=dict(block=32, blocks=6, spare=2), mask_type=MaskType.PADDING_CAUSAL,
                                       diagonal_alignment="bottom_right"), False),
}


class CheckRow(NamedTuple):
    name: str
    kinds: str
    status: str            # "ok", "MISMATCH", "ERROR", "unsupported"
    worst: float | None    # the worst error as a fraction of its bound
    detail: str
    seconds: float
    seed: int              # the base seed: ``python -m cudnn_attn check --only NAME --seed SEED`` repeats it


class _Mismatch(AssertionError):
    pass


def _host(x: Any) -> np.ndarray:
    import cupy

    return (cupy.asnumpy(x) if isinstance(x, cupy.ndarray) else np.asarray(x)).astype(np.float64)


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


class _Comparison:
    """The worst error of one case as a fraction of its bound, and the first failure."""
    def __init__(self):
        self.worst = 0.0
        self.failures: list[str] = []

    def ratio(self, name: str, error: float, bound: float) -> None:
        self.worst = max(self.worst, error / bound)
        if not error <= bound:
            self.failures.append(f"{name}: error {error:.2e} > {bound:.1e}")

    def tensor(self, name: str, got: Any, want: Any, dtype: str) -> None:
        got, want = _host(got), _host(want)
        if got.shape != want.shape:
            raise _Mismatch(f"{name}: shape {got.shape} != reference {want.shape}")
        if not np.isfinite(got).all():
            raise _Mismatch(f"{name}: {int((~np.isfinite(got)).sum())} elements not finite")
        self.ratio(name, _relative(got, want), RELATIVE_TOLERANCE[dtype])

    def lse(self, got: Any, want: Any) -> None:
        got, want = _host(got), _host(want)
        if not np.isfinite(got).all():
            raise _Mismatch(f"logsumexp: {int((~np.isfinite(got)).sum())} elements not finite")
        self.ratio("logsumexp", float((np.abs(got - want) / np.maximum(1.0, np.abs(want))).max()), LSE_TOLERANCE)


def _operands(config: Any, rng: np.random.Generator) -> Any:
    operands = random_operands(config, rng, poison=False)
    if config.mask.alignment.value == "bottom_right" and operands.q_seqlen is not None and config.paging is None:
        operands = operands.replace(kv_seqlen=np.maximum(operands.kv_seqlen, operands.q_seqlen))
    if config.paging is not None:
        operands = operands.replace(q_seqlen=np.minimum(operands.q_seqlen, operands.kv_seqlen))
    return operands


def _to_gpu(operands: Any) -> Any:
    import cupy

    def move(x):               # FP8 data crosses as uint8 bytes (CuPy has no float8 dtype)
        if not isinstance(x, np.ndarray):
            return x
        return cupy.asarray(np.ascontiguousarray(x).view(np.uint8) if x.dtype.name.startswith("float8") else x)
    names = ("query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "page_table_k",
             "page_table_v", "sink")
    scales = None if operands.fp8_scales is None else {k: cupy.asarray(v) for k, v in operands.fp8_scales.items()}
    return operands.replace(**{n: move(getattr(operands, n)) for n in names}, fp8_scales=scales)


def _check_fp16(config: Any, operands: Any, backward: bool, rng: np.random.Generator, seed: int) -> _Comparison:
    import cupy


    gpu = _to_gpu(operands)
    io = io_dtype(config.dtype)
    rng_dump = None
    if config.has_dropout:
        rng_dump = cupy.zeros((config.segments, config.q_heads, config.q_len, config.kv_len), cupy.float32)
    result = prepared.forward(config, gpu, seed=seed, rng_dump=rng_dump)
    keep = None if rng_dump is None else cupy.asnumpy(rng_dump)
    expected = reference.forward(config, operands, dropout_mask=keep)
    compare = _Comparison()
    compare.tensor("output", result.output, expected.output, config.dtype)
    if config.training:
        compare.lse(result.logsumexp, expected.logsumexp)
    if backward:
        d_out = rng.standard_normal(config.o_shape).astype(io)
        grads = prepared.backward(config, gpu, result.output, cupy.asarray(d_out), result.logsumexp, seed=seed)
        want = reference.backward(config, operands, expected.output, d_out, expected.logsumexp, dropout_mask=keep)
        for name in ("dq", "dk", "dv") + (("dbias",) if config.has_dbias else ()) + (("dsink",) if config.sink else ()):
            compare.tensor(name, getattr(grads, name), getattr(want, name), config.dtype)
    return compare


def _check_fp8(config: Any, operands: Any) -> _Comparison:
    import cupy


    scales = {k: float(np.asarray(v).reshape(())) for k, v in operands.fp8_scales.items()}
    result = prepared.forward(config, _to_gpu(operands))
    got = cupy.asnumpy(result.output).view(io_dtype(config.dtype)).astype(np.float64) / scales["scale_o"]
    emulated = reference.forward(config, operands).output.astype(np.float64) / scales["scale_o"]
    exact_config = config.replace(dtype="float64")
    exact = reference.forward(exact_config, operands.replace(
        query=operands.query.astype(np.float64) * scales["descale_q"],
        key=operands.key.astype(np.float64) * scales["descale_k"],
        value=operands.value.astype(np.float64) * scales["descale_v"], fp8_scales=None)).output
    compare = _Comparison()
    if not np.isfinite(got).all():
        raise _Mismatch(f"output: {int((~np.isfinite(got)).sum())} elements not finite")
    compare.ratio("output (vs float64)", _relative(got, exact), 2 * _relative(emulated, exact) + FP8_MARGIN)
    return compare


def run(*, seed: int = 0, only: list[str] | None = None,
        progress: Callable[[str], None] = lambda _: None) -> list[CheckRow]:
    """Run the cases (all, or the names in ``only``) on the current GPU; one row per case."""
    rows = []
    for index, (name, (shape, backward)) in enumerate(CASES.items()):
        if only and name not in only:
            continue
        progress(name)
        case_seed = seed * 1000 + index
        start = time.perf_counter()
        kinds = "fwd+bwd" if backward else "fwd"
        try:
            rng = np.random.default_rng(case_seed)
            config = call_config(**shape)
            operands = _operands(config, rng)
            compare = _check_fp8(config, operands) if config.fp8 else _check_fp16(config, operands, backward, rng,
                                                                                  case_seed)
            status = "ok" if not compare.failures else "MISMATCH"
            row = CheckRow(name, kinds, status, compare.worst, "; ".join(compare.failures), 0.0, seed)
        except UnsupportedConfigurationError as exc:
            row = CheckRow(name, kinds, "unsupported", None, "; ".join(exc.reasons), 0.0, seed)
        except _Mismatch as exc:
            row = CheckRow(name, kinds, "MISMATCH", None, str(exc), 0.0, seed)
        except Exception as exc:  # noqa: BLE001 -- a self-test reports every failure and goes on
            row = CheckRow(name, kinds, "ERROR", None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                           0.0, seed)
        rows.append(row._replace(seconds=time.perf_counter() - start))
    return rows


def table(rows: list[CheckRow]) -> str:
    """The rows as a plain-text table (worst error as a fraction of its bound)."""
    lines = [f"{'configuration':32s} {'graphs':8s} {'result':11s} {'worst/bound':>11s} {'s':>6s}  detail"]
    for r in rows:
        worst = "-" if r.worst is None else f"{r.worst:.3f}"
        detail = r.detail + (f"  (reproduce: python -m cudnn_attn check --only '{r.name}' --seed {r.seed})"
                             if r.status in ("MISMATCH", "ERROR") else "")
        lines.append(f"{r.name:32s} {r.kinds:8s} {r.status:11s} {worst:>11s} {r.seconds:6.2f}  {detail}".rstrip())
    return "\n".join(lines)
