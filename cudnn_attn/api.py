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
  global :func:`set_autotune` setting, off by default).

Inputs are CuPy arrays or any ``__dlpack__`` GPU array (torch tensors, JAX arrays), zero-copy; every
array of a call lives on the query's device.  Results are CuPy arrays (convert zero-copy with
``torch.from_dlpack`` / ``jax.dlpack.from_dlpack``).  bfloat16 is CuPy's ``ml_dtypes.bfloat16``.
Rows cuDNN does not compute (padding, tokens outside packed segments) are returned as zeros.

Errors, before any GPU work: :class:`ValueError` for invalid arguments,
:class:`~cudnn_attn.errors.UnsupportedConfigurationError` for valid calls this GPU / cuDNN cannot run,
:class:`~cudnn_attn.errors.NoGPUError` without a usable GPU.  The native API with named results
(:class:`~cudnn_attn.types.AttentionOutput` / ``AttentionGrads``) and preallocated outputs is
:mod:`cudnn_attn.execution`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

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


def _prepared(arrays: dict[str, Any], static: dict[str, Any]) -> tuple[Any, Any]:
    """Validate (through the memo) on the query's device.  The bias cuDNN reads must be dense and in
    the io dtype: a mask folded by ``prepare`` may be neither (CuPy 14's bfloat16 ``where`` computes in
    float32), so it is converted here."""
    with runtime.on_device(arrays["query"].device.id):
        config, operands = _validated.prepare(arrays, static)
        bias, io = operands.bias, operands.query.dtype
        if bias is not None and (bias.dtype != io or not bias.flags.c_contiguous):
            operands = operands.replace(bias=_cupy().ascontiguousarray(bias.astype(io, copy=False)))
    return config, operands


def _seed_result(result: Any, use_fp8: bool, return_residual: bool) -> Any:
    if use_fp8:
        return result.output, result.amax_s, result.amax_o
    if return_residual:
        return result.output, result.logsumexp
    return result.output


def dot_product_attention(
    query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, q_seqlen: Any = None,
    kv_seqlen: Any = None, q_offsets: Any = None, kv_offsets: Any = None, fp8_params: FP8Params | None = None,
    score_mod_args: Sequence[Any] = (), *, scale: float = 1.0, mask_type: MaskType = MaskType.NO_MASK,
    seed: int = 42, dropout_rate: float = 0.0, qkv_layout: str = "BTNH", sliding_window_length: int | None = None,
    score_mod: Callable[..., Any] | None = None, use_fp8: bool = False, return_residual: bool = False,
    diagonal_alignment: str = "top_left", sink: Any = None, stream: Any = None, autotune: bool | None = None,
) -> Any:
    """cuDNN scaled dot-product attention (forward).

    Shapes: Q ``(B, T, N, H)`` / K, V ``(B, S, K, H)`` in BTNH (``(B, N, T, H)`` in BNTH); ``bias`` and
    ``mask`` broadcast to ``(B, N, T, S)`` (``mask`` True keeps); ``q_seqlen``/``kv_seqlen`` int32
    ``(B,)``, or ``(B, M)`` with packed segments given by ``q_offsets``/``kv_offsets`` ``(B, M + 1)``.

    Returns the output (the query's layout, ``v``'s head dim), ``(output, logsumexp)`` with
    ``return_residual`` (logsumexp float32 ``(B, N, T)``, ``(B*M, N, T)`` packed), or
    ``(output, amax_s, amax_o)`` with ``use_fp8``.
    """
    arrays = _gpu_arrays(stream, query=query, key=key, value=value, bias=bias, mask=mask, q_seqlen=q_seqlen,
                         kv_seqlen=kv_seqlen, q_offsets=q_offsets, kv_offsets=kv_offsets, fp8_params=fp8_params,
                         score_mod_args=score_mod_args, sink=sink)
    config, operands = _prepared(arrays, dict(
        scale=scale, mask_type=mask_type, dropout_rate=dropout_rate, qkv_layout=qkv_layout,
        sliding_window_length=sliding_window_length, score_mod=score_mod, use_fp8=use_fp8,
        training=return_residual, diagonal_alignment=diagonal_alignment))
    result = execution.forward(config, operands, seed=seed, stream=stream, autotune=autotune)
    return _seed_result(result, use_fp8, return_residual)


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
    return _seed_result(result, use_fp8, return_residual)


def dot_product_attention_bwd(
    query: Any, key: Any, value: Any, output: Any, grad_output: Any, logsumexp: Any, bias: Any = None,
    mask: Any = None, q_seqlen: Any = None, kv_seqlen: Any = None, q_offsets: Any = None, kv_offsets: Any = None,
    fp8_params: FP8Params | None = None, score_mod_args: Sequence[Any] = (), *, scale: float = 1.0,
    mask_type: MaskType = MaskType.NO_MASK, seed: int = 42, dropout_rate: float = 0.0, qkv_layout: str = "BTNH",
    sliding_window_length: int | None = None, score_mod: Callable[..., Any] | None = None, use_fp8: bool = False,
    return_residual: bool = False, diagonal_alignment: str = "top_left", sink: Any = None,
    deterministic: bool = False, stream: Any = None, autotune: bool | None = None,
) -> AttentionGrads:
    """Backward of :func:`dot_product_attention` called with the same arguments (and the same ``seed``).

    ``output`` and ``logsumexp`` are the forward's results (``return_residual=True``), ``grad_output``
    the gradient of the output.  Returns :class:`AttentionGrads` ``(dq, dk, dv, dbias, dsink, ...)``:
    ``dbias`` when the bias is differentiable (an explicit bias, or a non-boolean mask), reduced to the
    bias's own broadcast shape; ``dsink`` with a sink.  ``return_residual`` is accepted for signature
    parity and ignored.
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
        diagonal_alignment=diagonal_alignment, deterministic=deterministic))
    prepare_backward(config, output, grad_output, logsumexp)
    return execution.backward(config, operands, output, grad_output, logsumexp,
                              seed=seed, stream=stream, autotune=autotune)


def _cupy() -> Any:
    import cupy

    return cupy
