"""Shared helpers of the GPU tier: configurations, GPU copies of reference operands, poisoned
results and the tolerances.

Tolerances.  cuDNN computes in float32 with the io dtype's rounding of P before P·V, the reference
in float64 on the same (io-dtype) inputs.  Every tensor is compared by its relative Frobenius error
``||gpu - ref|| / ||ref||`` with the bounds below, which sit about 4x above the errors measured on
the H200 for these shapes (research §9: max-relative errors <= 6e-4 fp16, <= 5e-3 bf16) - wide enough
for the stated arithmetic, tight enough that a wrong mask, a missed scale, a misplaced row or a
transposed layout (errors of order 1) cannot pass.  The float32 logsumexp is compared per element:
``|gpu - ref| <= 1e-3 * max(1, |ref|)``.  Before any comparison every result must be finite: results
are pre-filled with NaN, so an element cuDNN (or our zero-fill) did not write shows up.
"""

from __future__ import annotations

import numpy as np

from cudnn_attn.tools.selftest import call_config, io_dtype  # noqa: F401  (io_dtype: used by the GPU tests)

RELATIVE_TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}
LSE_TOLERANCE = 1e-3


def make_config(*, scale: float = 1.0, **shapes_and_call):
    """The AttentionConfig ``prepare`` builds for a call of these shapes (values are never read): the
    library's own :func:`cudnn_attn.tools.selftest.call_config`, with ``prepare``'s default scale."""
    return call_config(scale=scale, **shapes_and_call)


def to_gpu(operands):
    """The reference operands as CuPy arrays (``None`` and tuples kept)."""
    import cupy as cp

    def move(x):
        return cp.asarray(x) if isinstance(x, np.ndarray) else x
    return operands.replace(**{name: move(getattr(operands, name)) for name in (
        "query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "page_table_k",
        "page_table_v", "sink")},
        fp8_scales=None if operands.fp8_scales is None else {k: move(v) for k, v in operands.fp8_scales.items()})


def replace_nan(x: np.ndarray, value: float) -> np.ndarray:
    """``x`` with NaN replaced by ``value``, in ``x``'s dtype (``np.nan_to_num`` ignores bfloat16)."""
    return np.where(np.isnan(x.astype(np.float32)), value, x).astype(x.dtype)


def poisoned(shape, dtype):
    import cupy as cp

    return cp.full(shape, np.nan, dtype)


def _host(x) -> np.ndarray:
    import cupy as cp

    return cp.asnumpy(x).astype(np.float64) if isinstance(x, cp.ndarray) else np.asarray(x, np.float64)


def assert_close(name: str, got, want, dtype: str, *, scale: float = 1.0) -> float:
    """Relative Frobenius error within ``scale * RELATIVE_TOLERANCE[dtype]``; returns the error."""
    got, want = _host(got), _host(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != reference {want.shape}"
    bad = ~np.isfinite(got)
    assert not bad.any(), f"{name}: {int(bad.sum())} of {got.size} elements not finite (unwritten or NaN)"
    error = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    bound = scale * RELATIVE_TOLERANCE[dtype]
    assert error <= bound, f"{name}: relative error {error:.2e} > {bound:.1e} ({dtype})"
    return error


def assert_lse_close(got, want) -> None:
    """Within ``LSE_TOLERANCE`` wherever the reference is finite.  A row with no admissible key inside the
    lengths (a window past the key length) has the reference's ``-inf``; cuDNN must not put a finite
    number there either (what it writes is reported on failure)."""
    got, want = _host(got), _host(want)
    assert got.shape == want.shape, f"logsumexp: shape {got.shape} != reference {want.shape}"
    empty = np.isneginf(want)
    assert not np.isfinite(got[empty]).any(), (
        f"logsumexp: finite values {np.unique(got[empty][np.isfinite(got[empty])])[:5]} in rows with no admissible key")
    got, want = got[~empty], want[~empty]
    assert np.isfinite(got).all(), f"logsumexp: {int((~np.isfinite(got)).sum())} elements not finite"
    error = np.abs(got - want) / np.maximum(1.0, np.abs(want))
    assert error.max() <= LSE_TOLERANCE, f"logsumexp: error {error.max():.2e} > {LSE_TOLERANCE}"


def raw_launch(config, kind: str, named: dict) -> list:
    """One launch of the cached plan of ``config``'s ``kind`` on GPU 0 with no fill policy, into NaN-poisoned
    results (in the plan's result order): what cuDNN itself writes.  ``named``: the call's arrays by operand name
    (``call_steps.named_operands``)."""
    import cupy as cp

    from cudnn_attn.engine.cache import graph_cache
    from cudnn_attn.engine.call import CallSpec

    plan = graph_cache.plan(config, kind, 0)
    inputs, _ = CallSpec.of(config, kind).bind(cp, named)
    inputs = {t: cp.ascontiguousarray(x) for t, x in inputs.items()}
    results = [poisoned(spec.shape, spec.dtype) for spec in plan.results]
    context, stream = plan.context, cp.cuda.get_current_stream().ptr
    with context.lock:
        context.bind_stream(stream)
        plan.launcher([inputs[t].data.ptr for t in plan.operand_ids] + [r.data.ptr for r in results],
                      context.workspace(stream, plan.workspace_size), context.handle)
    cp.cuda.get_current_stream().synchronize()
    return list(zip(plan.results, results))

