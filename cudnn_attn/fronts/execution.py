"""Run attention on the GPU from CuPy arrays: the configuration and operands in, CuPy results out.

This is the native API under :mod:`cudnn_attn.fronts.cupy` (which adds the seed-compatible signatures, array
import and the per-signature fast path).  :func:`forward` and :func:`backward` take what
:func:`cudnn_attn.core.validation.validate_call` returns, plus where to run (``stream``), how to pick the plan
(``autotune``) and, optionally, preallocated results (``out=``-style keywords, e.g. for CUDA-graph
capture or tests).

A call: the :class:`~cudnn_attn.engine.plan.CallPlan` from the graph cache (a miss checks support before any
GPU work, then builds) -> the operands bound as graph tensors (:func:`cudnn_attn.engine.plan.graph_inputs`)
-> results allocated on the call's stream -> one launch (the plan zeroes what cuDNN leaves unwritten)
-> the logsumexp fixed up after it (the plan's fill policy) -> named results.

Results the plan's fill policy covers come back as zeros: rows ``t >= q_seqlen[b]`` of the output /
logsumexp / dq, keys ``s >= kv_seqlen[b]`` of dk / dv, tokens outside every packed segment.
Packed segments: cuDNN sees ``B * M`` ragged sequences (:mod:`cudnn_attn.graphs.packing`); the
logsumexp comes back as ``(B*M, N, T)``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Mapping

import numpy as np

from cudnn_attn.core import masked_rows, values
from cudnn_attn.core.config import AttentionConfig, AttentionOperands
from cudnn_attn.core.padded_call import lift, lifted_config
from cudnn_attn.core.settings import flag
from cudnn_attn.core.types import FP8_BWD_KEYS, FP8_FWD_KEYS, AttentionGrads, AttentionOutput
from cudnn_attn.engine import runtime
from cudnn_attn.engine.autotune import tuned_plan
from cudnn_attn.engine.cache import PlanChoice, graph_cache
from cudnn_attn.engine.plan import BWD, FWD, Fill, graph_inputs, host_scalar_values, zero_rows
from cudnn_attn.graphs import packing

AUTOTUNE_ENV_VAR = "CUDNN_ATTN_AUTOTUNE"


def autotune_from_environment(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``$CUDNN_ATTN_AUTOTUNE`` turns autotuning on for the whole program (``1``/``true``/``yes``/``on``):
    for a program whose calls cannot pass ``autotune=True`` (a training script, a third-party model)."""
    return flag(AUTOTUNE_ENV_VAR, default=False, environ=environ)


AUTOTUNE_DEFAULT = autotune_from_environment()
"""What ``autotune=None`` (the default of every call, :func:`cudnn_attn.bind` included) means: the environment
variable as it was when :mod:`cudnn_attn` was imported (read once, so that the per-signature fast paths need
no environment lookup)."""


def plan_choice(autotune: bool | None) -> PlanChoice:
    """``autotune`` (``None``: :data:`AUTOTUNE_DEFAULT`) as the graph cache's plan choice."""
    if autotune is None:
        autotune = AUTOTUNE_DEFAULT
    elif not isinstance(autotune, (bool, np.bool_)):
        raise ValueError(f"autotune: must be True, False or None (then ${AUTOTUNE_ENV_VAR} decides), got {autotune!r}")
    return PlanChoice.AUTOTUNED if autotune else PlanChoice.HEURISTIC


def named_arrays(config: AttentionConfig, kind: str, operands: AttentionOperands, **residuals: Any) -> dict:
    """The arrays of a call by operand name (those :func:`cudnn_attn.engine.plan.graph_inputs` reads)."""
    named = {name: getattr(operands, name) for name in (
        "query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "page_table_k",
        "page_table_v", "sink")}
    if config.fp8:
        named.update({name: operands.fp8_scales[name] for name in (FP8_FWD_KEYS if kind == FWD else FP8_BWD_KEYS)})
    named.update(residuals)
    return named


def plan_for(config: AttentionConfig, kind: str, device: int, autotune: bool | None = None,
             rng_dump: bool = False, tune_on: Any = None) -> Any:
    """The :class:`~cudnn_attn.engine.plan.CallPlan` of a call (built on a miss).  ``tune_on`` is a callable
    ``(candidate plan) -> launch arguments`` for autotuning on the call's own buffers."""
    choice = plan_choice(autotune)
    key = graph_cache.key(config, kind, device, plan=choice, rng_dump=rng_dump)
    if choice is PlanChoice.HEURISTIC:
        return graph_cache.entry(key).plan

    return graph_cache.entry(key, lambda key: tuned_plan(key, tune_on)).plan


def run(config: AttentionConfig, kind: str, named: Mapping[str, Any], *, seed: int = 42, stream: Any = None,
        autotune: bool | None = None, given: Mapping[str, Any] | None = None,
        score_mod_args: tuple = ()) -> dict[str, Any]:
    """One launch of ``config``'s ``kind`` graph on CuPy arrays; the results by name.

    ``named`` maps operand names to CuPy arrays (:func:`named_arrays`); ``given`` optional
    preallocated results by name (``rng_dump`` asks for cuDNN's dropout keep-mask, tests only).
    """
    cupy = _cupy()
    device = named["query"].device.id
    given = given or {}
    with runtime.on_device(device):
        stream_ptr = runtime.stream_pointer(stream, device)
        current = contextlib.nullcontext() if stream is None else \
            runtime.device_context(device).stream(stream_ptr)
        with current:
            inputs, segments = graph_inputs(cupy, config, kind, named)
            # Computed inputs (packed offsets, token-major statistics) are kept alive until the launch is
            # queued; their memory returns to CuPy's pool in this stream's order.
            inputs = {t: cupy.ascontiguousarray(x) for t, x in inputs.items()}
            rng_dump = given.get("rng_dump") is not None

            def operands_of(plan: Any) -> tuple[list[int], dict[str, Any]]:
                results = {spec.name: _result(cupy, spec, given.get(spec.name)) for spec in plan.results}
                return [inputs[t].data.ptr for t in plan.operand_ids] + \
                    [results[spec.name].data.ptr for spec in plan.results], results

            scalars = host_scalar_values(config, seed, [_host_float(a) for a in score_mod_args])
            plan = plan_for(config, kind, device, autotune, rng_dump,
                            tune_on=lambda candidate: (operands_of(candidate)[0], stream_ptr, scalars))
            pointers, results = operands_of(plan)
            plan.launch(pointers, stream_ptr, scalars=scalars)
            return finish(cupy, plan, results, named, segments, given)


def finish(cupy: Any, plan: Any, results: dict[str, Any], named: Mapping[str, Any], segments: Any,
           given: Mapping[str, Any]) -> dict[str, Any]:
    """Apply the after-launch part of the plan's fill policy; preallocated results receive the values."""
    for spec in plan.results:
        if spec.fill is Fill.ROWS_AFTER:
            results[spec.name][...] = zero_rows(cupy, results[spec.name], named["q_seqlen"])
        elif spec.fill is Fill.SEGMENTS:
            lse = packing.lse_from_tokens(cupy, results[spec.name], segments, plan.config.q_len)
            target = given.get(spec.name)
            if target is not None:
                _check_given(spec.name, target, lse.shape, lse.dtype)
                target[...] = lse
                lse = target
            results[spec.name] = lse
    if "logsumexp" in results and masked_rows.may_leave_rows_without_keys(plan.config):
        results["logsumexp"][...] = masked_rows.keyless_logsumexp(
            cupy, plan.config, results["logsumexp"], named["q_seqlen"], named["kv_seqlen"], segments)
    return results


def buffer_dtype(dtype: np.dtype) -> np.dtype:
    """The CuPy dtype of a buffer of ``dtype``: FP8 values travel as their bytes (CuPy has no float8)."""
    return np.dtype(np.uint8) if dtype.name.startswith("float8") else dtype


def _result(cupy: Any, spec: Any, given: Any) -> Any:
    """A result buffer: ``given`` (checked) or a new one on the current stream."""
    dtype = buffer_dtype(spec.dtype)
    if given is None or spec.fill is Fill.SEGMENTS:       # packed statistics: a token-major buffer of ours
        return cupy.empty(spec.shape, dtype)
    _check_given(spec.name, given, spec.shape, dtype)
    return given


def _check_given(name: str, given: Any, shape: tuple, dtype: Any) -> None:
    if tuple(given.shape) != tuple(shape) or given.dtype != np.dtype(dtype) or not given.flags.c_contiguous:
        raise ValueError(f"{name}: a preallocated result must be a C-contiguous {np.dtype(dtype).name}"
                         f"{list(shape)}, got {given.dtype}{list(given.shape)}")


def _host_float(x: Any) -> float:
    """A score_mod argument's value for by-value binding (a device scalar is read back: one sync)."""
    return float(x.get() if hasattr(x, "get") else x)


def forward(config: AttentionConfig, operands: AttentionOperands, *, seed: int = 42, stream: Any = None,
            autotune: bool | None = None, output: Any = None, logsumexp: Any = None,
            rng_dump: Any = None, check_values: bool | None = None) -> AttentionOutput:
    """cuDNN attention forward on CuPy ``operands`` (see the module doc).

    ``output`` / ``logsumexp`` are optional preallocated results (``config.o_shape`` in the io dtype;
    float32 ``config.lse_shape``, only with ``config.training``).  ``rng_dump`` (debug/tests) is a
    float32 ``(B*M, N, T, S)`` buffer that receives cuDNN's dropout keep-mask.  ``check_values``: the
    checked mode for lengths, offsets and page ids (:func:`guarded`).
    """
    operands = guarded(config, operands, check_values, stream)
    if logsumexp is not None and not config.training:
        raise ValueError("logsumexp: only produced when training (return_residual=True)")
    given = dict(output=output, logsumexp=logsumexp, rng_dump=rng_dump)
    lifted = _lift(config, operands, stream)
    if lifted is not None:          # a kernel limit lifted by padding (cudnn_attn.core.padded_call): run padded, slice back
        results = run(lifted.config, FWD, named_arrays(lifted.config, FWD, lifted.operands), seed=seed,
                      stream=stream, autotune=autotune, score_mod_args=operands.score_mod_args)
        result = _into(lifted.unpad(AttentionOutput(**{n: results.get(n) for n in AttentionOutput._fields})), given)
    else:
        results = run(config, FWD, named_arrays(config, FWD, operands), seed=seed, stream=stream,
                      autotune=autotune, given=given, score_mod_args=operands.score_mod_args)
        result = AttentionOutput(**{name: results.get(name) for name in AttentionOutput._fields})
    with _on_stream(operands, stream):
        masked_rows.set_forward(_cupy(), config, operands, result.output, result.logsumexp)
    return result


def backward(config: AttentionConfig, operands: AttentionOperands, output: Any, grad_output: Any,
             logsumexp: Any, *, seed: int = 42, stream: Any = None, autotune: bool | None = None,
             dq: Any = None, dk: Any = None, dv: Any = None, dbias: Any = None, dsink: Any = None,
             rng_dump: Any = None, check_values: bool | None = None) -> AttentionGrads:
    """cuDNN attention backward on CuPy arrays; ``seed`` must be the forward's (same dropout mask).

    ``output``/``logsumexp`` are the forward's results, ``grad_output`` the gradient of ``output``.
    ``dq``/``dk``/``dv``/``dbias``/``dsink`` are optional preallocated results.  ``dbias`` is returned
    when the bias is differentiable, ``dsink`` with a sink.
    """
    operands = guarded(config, operands, check_values, stream)
    given = dict(dq=dq, dk=dk, dv=dv, dbias=dbias, dsink=dsink, rng_dump=rng_dump)
    caller_grad_output = grad_output
    with _on_stream(operands, stream):
        grad_output, logsumexp = masked_rows.backward_residuals(_cupy(), config, operands, grad_output, logsumexp)
    grads = _backward(config, operands, output, grad_output, logsumexp, given, seed, stream, autotune)
    with _on_stream(operands, stream):
        masked_rows.add_dv(_cupy(), config, operands, caller_grad_output, grads.dv)
    return grads


def _backward(config: AttentionConfig, operands: AttentionOperands, output: Any, grad_output: Any, logsumexp: Any,
              given: Mapping[str, Any], seed: int, stream: Any, autotune: bool | None) -> AttentionGrads:
    lifted = _lift(config, operands, stream)
    if lifted is not None:          # a kernel limit lifted by padding (cudnn_attn.core.padded_call): run padded, slice back
        o, do, lse = lifted.residuals(output, grad_output, logsumexp)
        named = named_arrays(lifted.config, BWD, lifted.operands, output=o, grad_output=do, logsumexp=lse)
        results = run(lifted.config, BWD, named, seed=seed, stream=stream, autotune=autotune,
                      score_mod_args=operands.score_mod_args)
        return _into(lifted.unpad(AttentionGrads(**{n: results.get(n) for n in AttentionGrads._fields})), given)
    named = named_arrays(config, BWD, operands, output=output, grad_output=grad_output, logsumexp=logsumexp)
    results = run(config, BWD, named, seed=seed, stream=stream, autotune=autotune, given=given,
                  score_mod_args=operands.score_mod_args)
    return AttentionGrads(**{name: results.get(name) for name in AttentionGrads._fields})


def guarded(config: AttentionConfig, operands: AttentionOperands, check_values: bool | None, stream: Any) -> Any:
    """``operands`` whose lengths, offsets and page ids cannot make cuDNN leave the buffers
    (:mod:`cudnn_attn.core.values`): clamped on the device, on the call's stream; in the checked mode
    (``check_values=True`` or ``CUDNN_ATTN_CHECK_VALUES=1``) read on the host instead, a ValueError naming
    the argument, the row and the value.  Nothing to do (and no cost) without such arrays."""

    if not values.present(operands):
        return operands
    if values.checking(check_values):
        values.check(config, operands)
        return operands
    device = operands.query.device.id
    with runtime.on_device(device):
        current = contextlib.nullcontext() if stream is None else \
            runtime.device_context(device).stream(runtime.stream_pointer(stream, device))
        with current:
            return values.sanitize(config, operands, _cupy())


def _on_stream(operands: AttentionOperands, stream: Any) -> Any:
    """The query's device and the call's stream current (nothing to enter without a boolean mask)."""
    if operands.keep_mask is None:
        return contextlib.nullcontext()
    device = operands.query.device.id
    stack = contextlib.ExitStack()
    stack.enter_context(runtime.on_device(device))
    if stream is not None:
        stack.enter_context(runtime.device_context(device).stream(runtime.stream_pointer(stream, device)))
    return stack


def _lift(config: AttentionConfig, operands: AttentionOperands, stream: Any) -> Any:
    """:func:`cudnn_attn.core.padded_call.lift` with CuPy on the call's stream and device (``None``: nothing to lift)."""
    if lifted_config(config) is None:
        return None

    cupy = _cupy()
    device = operands.query.device.id
    with runtime.on_device(device):
        current = contextlib.nullcontext() if stream is None else \
            runtime.device_context(device).stream(runtime.stream_pointer(stream, device))
        with current:
            return lift(config, operands, cupy)


def _into(result: Any, given: Mapping[str, Any]) -> Any:
    """``result`` with its sliced (non-contiguous) members made contiguous, or copied into the given buffers."""
    cupy = _cupy()
    values = {}
    for name, x in zip(result._fields, result):
        target = given.get(name)
        if x is not None and target is not None:
            _check_given(name, target, x.shape, x.dtype)
            target[...] = x
            x = target
        values[name] = None if x is None else cupy.ascontiguousarray(x)
    return type(result)(**values)


def _cupy() -> Any:
    import cupy

    return cupy
