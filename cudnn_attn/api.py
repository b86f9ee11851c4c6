"""cuDNN fused attention on GPU arrays: the seed-compatible public functions.

``dot_product_attention``, ``paged_attention`` and ``dot_product_attention_bwd`` keep the argument
names, defaults and return forms of JAX's cuDNN attention module (and of :mod:`cudnn_attn.reference`),
and add keyword-only extensions after them:

* ``diagonal_alignment="top_left" | "bottom_right"`` - where the causal diagonal starts;
* ``sink`` - float32 ``(N,)`` attention-sink logits;
* ``deterministic`` (backward) - deterministic dQ accumulation, bit-identical reruns;
* ``stream`` - where to run (default: the current CuPy stream of the query's device; see
  :mod:`cudnn_attn.runtime`);
* ``autotune`` - time every cuDNN plan once per configuration and keep the fastest (``None``: the
  global :func:`set_autotune` setting, off by default);
* ``fp8_dtype`` (with ``use_fp8``) - the FP8 format of the uint8 operands: ``"float8_e4m3fn"``
  (default) or ``"float8_e5m2"``.

Inputs are CuPy arrays or any ``__dlpack__`` GPU array (torch tensors, JAX arrays), zero-copy; every
array of a call lives on the query's device.  Results are CuPy arrays (convert zero-copy with
``torch.from_dlpack`` / ``jax.dlpack.from_dlpack``).  bfloat16 is CuPy's ``ml_dtypes.bfloat16``.
Rows cuDNN does not compute (padding, tokens outside packed segments) are returned as zeros.

FP8 (``use_fp8=True``): CuPy has no float8 dtype, so FP8 Q/K/V (and, for the backward, O and dO)
are uint8 arrays holding the FP8 bytes (``x.view(ml_dtypes.float8_e4m3fn)`` on the host, or
``tensor.view(torch.uint8)`` before handing a torch FP8 tensor over), in the format ``fp8_dtype``
names; the FP8 results (output, dq, dk, dv) come back the same way.  The scales and amax values are
float32 arrays.

Errors, before any GPU work: :class:`ValueError` for invalid arguments,
:class:`~cudnn_attn.errors.UnsupportedConfigurationError` for valid calls this GPU / cuDNN cannot run,
:class:`~cudnn_attn.errors.NoGPUError` without a usable GPU.  The native API with named results
(:class:`~cudnn_attn.types.AttentionOutput` / ``AttentionGrads``) and preallocated outputs is
:mod:`cudnn_attn.execution`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from . import execution, runtime
from .execution import set_autotune
from .config import AttentionOperands
from .types import AttentionGrads, FP8Params, MaskType
from .validation import prepare, prepare_backward

__all__ = ["dot_product_attention", "dot_product_attention_bwd", "paged_attention", "set_autotune"]


def _gpu_arrays(stream: Any, **arrays: Any) -> dict[str, Any]:
    """Every array argument as a CuPy array on the query's device (``None`` stays ``None``).

    Raises :class:`~cudnn_attn.errors.NoGPUError` first when there is no GPU.
    """
    runtime.require_gpu()
    device = runtime.device_of("query", arrays["query"])
    on_stream = None if stream is None else runtime.context(device).stream(runtime.stream_pointer(stream, device))
    converted = {}
    for name, x in arrays.items():
        if x is None:
            converted[name] = None
        elif name == "fp8_params":
            converted[name] = {k: runtime.as_cupy(f"fp8_params[{k!r}]", v, device, on_stream) for k, v in x.items()}
        elif name == "score_mod_args":
            converted[name] = tuple(x)          # scalars, bound by value (see cudnn_attn.execution)
        else:
            converted[name] = runtime.as_cupy(name, x, device, on_stream)
    return converted


_OPERAND_FIELDS = ("query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets",
                   "page_table_k", "page_table_v", "sink")


class _ValidationMemo:
    """:func:`~cudnn_attn.validation.prepare` for repeated call signatures, without re-running it.

    ``prepare`` reads nothing but shapes, dtypes and the static arguments, so its verdict and its
    configuration hold for every call with the same signature (shape and dtype of every array plus
    every static argument).  When it passed the arrays through unchanged (no mask folded into the
    bias, no FP8 scales, no score_mod arguments), a repeated signature reuses the configuration *object*
    - which also lets the graph cache reuse its key - and only rebinds the new arrays.  It takes
    ``prepare`` tens of microseconds to check a call; a cache-hit call must stay under 20.
    """

    def __init__(self, maxsize: int = 256):
        self._maxsize = maxsize
        self._known: dict[tuple, tuple[Any, frozenset]] = {}

    def prepare(self, arrays: dict[str, Any], static: dict[str, Any]) -> tuple[Any, Any]:
        if arrays.get("mask") is not None or arrays.get("fp8_params") or arrays.get("score_mod_args"):
            return prepare(**arrays, **static, xp=_cupy())
        shapes = tuple(None if arrays.get(n) is None else (arrays[n].shape, arrays[n].dtype) for n in _OPERAND_FIELDS)
        signature = (shapes, tuple(static.items()))
        try:
            known = self._known.get(signature)
        except TypeError:                         # an unhashable argument: prepare explains what is wrong
            return prepare(**arrays, **static, xp=_cupy())
        if known is not None:
            config, kept = known
            return config, AttentionOperands(**{n: arrays[n] for n in kept})
        config, operands = prepare(**arrays, **static, xp=_cupy())
        kept = frozenset(n for n in _OPERAND_FIELDS if getattr(operands, n) is not None)
        if all(getattr(operands, n) is arrays.get(n) for n in kept):
            if len(self._known) >= self._maxsize:
                self._known.clear()
            self._known[signature] = (config, kept)
        return config, operands


_validated = _ValidationMemo()


FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")


class _FP8Operand(NamedTuple):
    """What validation reads of an FP8 operand held in a uint8 CuPy array: its shape and FP8 dtype."""

    shape: tuple[int, ...]
    dtype: np.dtype


def _fp8_described(x: Any, fp8_dtype: str) -> Any:
    """A uint8 array as the FP8 operand it holds (anything else unchanged: validation judges it)."""
    if x is None or np.dtype(x.dtype) != np.uint8:
        return x
    return _FP8Operand(tuple(x.shape), np.dtype(fp8_dtype))


def _check_fp8_dtype(fp8_dtype: str) -> None:
    import ml_dtypes  # noqa: F401  (registers the float8 names with NumPy)

    if fp8_dtype not in FP8_FORMATS:
        raise ValueError(f"fp8_dtype: the FP8 format of the uint8 operands must be one of {', '.join(FP8_FORMATS)}, "
                         f"got {fp8_dtype!r}")


def _prepared(arrays: dict[str, Any], static: dict[str, Any], fp8_dtype: str | None = None) -> tuple[Any, Any]:
    """Validate (through the memo) on the query's device.  The bias cuDNN reads must be dense and in
    the io dtype: a mask folded by ``prepare`` may be neither (CuPy 14's bfloat16 ``where`` computes in
    float32), so it is converted here.  With ``fp8_dtype``, uint8 Q/K/V are validated as that FP8
    format and bound as they are."""
    with runtime.on_device(arrays["query"].device.id):
        if fp8_dtype is None:
            config, operands = _validated.prepare(arrays, static)
        else:
            _check_fp8_dtype(fp8_dtype)
            qkv = {n: arrays[n] for n in ("query", "key", "value")}
            config, operands = _validated.prepare(
                {**arrays, **{n: _fp8_described(x, fp8_dtype) for n, x in qkv.items()}}, static)
            operands = operands.replace(**qkv)
        bias, io = operands.bias, operands.query.dtype
        if bias is not None and (bias.dtype != io or not bias.flags.c_contiguous):
            operands = operands.replace(bias=_cupy().ascontiguousarray(bias.astype(io, copy=False)))
    return config, operands




def dot_product_attention(
    query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, q_seqlen: Any = None,
    kv_seqlen: Any = None, q_offsets: Any = None, kv_offsets: Any = None, fp8_params: FP8Params | None = None,
    score_mod_args: Sequence[Any] = (), *, scale: float = 1.0, mask_type: MaskType = MaskType.NO_MASK,
    seed: int = 42, dropout_rate: float = 0.0, qkv_layout: str = "BTNH", sliding_window_length: int | None = None,
    score_mod: Callable[..., Any] | None = None, use_fp8: bool = False, return_residual: bool = False,
    diagonal_alignment: str = "top_left", sink: Any = None, stream: Any = None, autotune: bool | None = None,
    fp8_dtype: str = "float8_e4m3fn",
) -> Any:
    """cuDNN scaled dot-product attention (forward).

    Shapes: Q ``(B, T, N, H)`` / K, V ``(B, S, K, H)`` in BTNH (``(B, N, T, H)`` in BNTH); ``bias`` and
    ``mask`` broadcast to ``(B, N, T, S)`` (``mask`` True keeps); ``q_seqlen``/``kv_seqlen`` int32
    ``(B,)``, or ``(B, M)`` with packed segments given by ``q_offsets``/``kv_offsets`` ``(B, M + 1)``.

    Returns the output (the query's layout, ``v``'s head dim), ``(output, logsumexp)`` with
    ``return_residual`` (logsumexp float32 ``(B, N, T)``, ``(B*M, N, T)`` packed), or
    ``(output, amax_s, amax_o)`` with ``use_fp8`` (FP8 output as uint8 bytes, see the module doc).
    """
    arrays = _gpu_arrays(stream, query=query, key=key, value=value, bias=bias, mask=mask, q_seqlen=q_seqlen,
                         kv_seqlen=kv_seqlen, q_offsets=q_offsets, kv_offsets=kv_offsets, fp8_params=fp8_params,
                         score_mod_args=score_mod_args, sink=sink)
    config, operands = _prepared(arrays, dict(
        scale=scale, mask_type=mask_type, dropout_rate=dropout_rate, qkv_layout=qkv_layout,
        sliding_window_length=sliding_window_length, score_mod=score_mod, use_fp8=use_fp8,
        training=return_residual, diagonal_alignment=diagonal_alignment), fp8_dtype if use_fp8 else None)
    result = execution.forward(config, operands, seed=seed, stream=stream, autotune=autotune)
    return result.seed_form(use_fp8, return_residual)


def paged_attention(
    query: Any, key: Any, value: Any, q_seqlen: Any, kv_seqlen: Any, page_table_k: Any, page_table_v: Any,
    bias: Any = None, mask: Any = None, fp8_params: FP8Params | None = None, *, scale: float = 1.0,
    mask_type: MaskType = MaskType.NO_MASK, seed: int = 42, dropout_rate: float = 0.0, qkv_layout: str = "BTNH",
    sliding_window_length: int | None = None, use_fp8: bool = False, return_residual: bool = False,
    diagonal_alignment: str = "top_left", sink: Any = None, stream: Any = None, autotune: bool | None = None,
) -> Any:
    """cuDNN attention over paged K/V caches (forward only).

    K/V are caches of blocks ``(num_blocks, block_size, K, H)`` (BTNH) or ``(num_blocks, K, block_size, H)``
    (BNTH); ``page_table_k``/``page_table_v`` int32 ``(B, 1, blocks_per_seq, 1)`` map each sequence's
    logical blocks to cache blocks.  Returns the output, or ``(output, logsumexp)`` with ``return_residual``.
    """
    arrays = _gpu_arrays(stream, query=query, key=key, value=value, q_seqlen=q_seqlen, kv_seqlen=kv_seqlen,
                         page_table_k=page_table_k, page_table_v=page_table_v, bias=bias, mask=mask,
                         fp8_params=fp8_params, sink=sink)
    config, operands = _prepared(arrays, dict(
        scale=scale, mask_type=mask_type, dropout_rate=dropout_rate, qkv_layout=qkv_layout,
        sliding_window_length=sliding_window_length, use_fp8=use_fp8, training=return_residual,
        diagonal_alignment=diagonal_alignment))
    result = execution.forward(config, operands, seed=seed, stream=stream, autotune=autotune)
    return result.seed_form(use_fp8, return_residual)


def dot_product_attention_bwd(
    query: Any, key: Any, value: Any, output: Any, grad_output: Any, logsumexp: Any, bias: Any = None,
    mask: Any = None, q_seqlen: Any = None, kv_seqlen: Any = None, q_offsets: Any = None, kv_offsets: Any = None,
    fp8_params: FP8Params | None = None, score_mod_args: Sequence[Any] = (), *, scale: float = 1.0,
    mask_type: MaskType = MaskType.NO_MASK, seed: int = 42, dropout_rate: float = 0.0, qkv_layout: str = "BTNH",
    sliding_window_length: int | None = None, score_mod: Callable[..., Any] | None = None, use_fp8: bool = False,
    return_residual: bool = False, diagonal_alignment: str = "top_left", sink: Any = None,
    deterministic: bool = False, stream: Any = None, autotune: bool | None = None,
    fp8_dtype: str = "float8_e4m3fn",
) -> AttentionGrads:
    """Backward of :func:`dot_product_attention` called with the same arguments (and the same ``seed``).

    ``output`` and ``logsumexp`` are the forward's results (``return_residual=True``), ``grad_output``
    the gradient of the output.  Returns :class:`AttentionGrads` ``(dq, dk, dv, dbias, dsink, ...)``:
    ``dbias`` when the bias is differentiable (an explicit bias, or a non-boolean mask), reduced to the
    bias's own broadcast shape; ``dsink`` with a sink; with ``use_fp8`` the FP8 gradients (uint8 bytes,
    like ``output`` and ``grad_output``) and ``amax_dq/dk/dv/dp``.  ``return_residual`` is accepted
    for signature parity and ignored.
    """
    del return_residual
    arrays = _gpu_arrays(stream, query=query, key=key, value=value, bias=bias, mask=mask, q_seqlen=q_seqlen,
                         kv_seqlen=kv_seqlen, q_offsets=q_offsets, kv_offsets=kv_offsets, fp8_params=fp8_params,
                         score_mod_args=score_mod_args, sink=sink, output=output, grad_output=grad_output,
                         logsumexp=logsumexp)
    output, grad_output, logsumexp = (arrays.pop(n) for n in ("output", "grad_output", "logsumexp"))
    config, operands = _prepared(arrays, dict(
        scale=scale, mask_type=mask_type, dropout_rate=dropout_rate, qkv_layout=qkv_layout,
        sliding_window_length=sliding_window_length, score_mod=score_mod, use_fp8=use_fp8, training=True,
        diagonal_alignment=diagonal_alignment, deterministic=deterministic), fp8_dtype if use_fp8 else None)
    residuals = (output, grad_output)      # FP8 O and dO are uint8 bytes like Q/K/V
    prepare_backward(config, *(_fp8_described(x, config.dtype) if config.fp8 else x for x in residuals), logsumexp)
    return execution.backward(config, operands, output, grad_output, logsumexp,
                              seed=seed, stream=stream, autotune=autotune)


def _cupy() -> Any:
    import cupy

    return cupy
