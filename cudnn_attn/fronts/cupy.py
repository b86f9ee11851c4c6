"""cuDNN fused attention on GPU arrays: the seed-compatible public functions and pre-bound calls.

``dot_product_attention``, ``paged_attention`` and ``dot_product_attention_bwd`` keep the argument
names, defaults and return forms of JAX's cuDNN attention module (and of :mod:`cudnn_attn.reference`),
and add keyword-only extensions after them:

* ``diagonal_alignment="top_left" | "bottom_right"`` - where the causal diagonal starts;
* ``sink`` - float32 ``(N,)`` attention-sink logits;
* ``deterministic`` (backward) - deterministic dQ accumulation, bit-identical reruns;
* ``stream`` - where to run (default: the current CuPy stream of the query's device; see
  :mod:`cudnn_attn.engine.runtime`);
* ``autotune`` - time every cuDNN plan once per configuration and keep the fastest (``None``: off, unless
  ``CUDNN_ATTN_AUTOTUNE=1`` was set when the library was imported: :attr:`cudnn_attn.core.settings.Settings.autotune`);
* ``fp8_dtype`` (with ``use_fp8``) - the FP8 format of the uint8 operands: ``"float8_e4m3fn"``
  (default) or ``"float8_e5m2"``;
* ``out_type`` - the array type of the results: ``None`` (default) returns them in the query's
  framework (CuPy arrays for CuPy, torch tensors for torch, JAX arrays for JAX, zero-copy through
  DLPack), ``"cupy"`` always returns CuPy arrays.

``seed`` (forward and backward) is the seed's int, or a CuPy int64 array ``[seed, offset]`` on the query's
device: cuDNN then reads its dropout seed and offset from that memory at launch, so new values draw a new mask
without a new graph (the backward must be given the same array values).  :func:`bind` takes an int.

Inputs are CuPy arrays or any ``__dlpack__`` GPU array (torch tensors, JAX arrays), zero-copy; every
array of a call lives on the query's device.  bfloat16 is CuPy's ``ml_dtypes.bfloat16``.  Rows cuDNN
does not compute (padding, tokens outside packed segments) are returned as zeros.

This front turns arrays into CuPy arrays and their addresses; everything else about a call is its
:class:`~cudnn_attn.engine.prepared.PreparedCall`'s.  Validation (:func:`cudnn_attn.core.validation.validate_call`)
runs in full for every new call signature (shapes, dtypes, strides, device and every static argument) and is
reused for an identical one (:data:`cudnn_attn.engine.prepared.validations`).  A repeated CuPy call of Q/K/V alone
(the common training and benchmarking case) is one lookup of its :func:`~cudnn_attn.engine.prepared.call_key` in
:data:`cudnn_attn.engine.prepared.calls` and the prepared call's direct launch.
:func:`bind` goes further for a fixed signature: it validates once and its calls only check that the arrays still
match.

FP8 (``use_fp8=True``): CuPy has no float8 dtype, so FP8 Q/K/V (and, for the backward, O and dO)
are uint8 arrays holding the FP8 bytes (``x.view(ml_dtypes.float8_e4m3fn)`` on the host, or
``tensor.view(torch.uint8)`` before handing a torch FP8 tensor over), in the format ``fp8_dtype``
names; the FP8 results (output, dq, dk, dv) come back the same way.  The scales and amax values are
float32 arrays.

Errors, before any GPU work: :class:`ValueError` for invalid arguments,
:class:`~cudnn_attn.core.errors.UnsupportedConfigurationError` for valid calls this GPU / cuDNN cannot run,
:class:`~cudnn_attn.core.errors.NoGPUError` without a usable GPU.

:func:`attention` is the native call: masks as :class:`~cudnn_attn.core.masks.MaskSpec` values, named results
(:class:`~cudnn_attn.core.types.AttentionOutput`).  The signatures of all four functions are written once, in
:mod:`cudnn_attn.core.parameters`.  On a validated ``(AttentionConfig, AttentionOperands)`` with preallocated
outputs: :func:`cudnn_attn.engine.prepared.forward` / :func:`~cudnn_attn.engine.prepared.backward`.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

from cudnn_attn.core import parameters
from cudnn_attn.core.config import AttentionConfig, AttentionOperands, InputStrides
from cudnn_attn.core.masks import MaskSpec
from cudnn_attn.core.parameters import AuxRequest
from cudnn_attn.core.types import AttentionGrads, AttentionOutput, FP8Params, MaskType
from cudnn_attn.core.validation import bind_seed, check_seed, seed_operands, validate_backward
from cudnn_attn.engine import call_steps, prepared, runtime
from cudnn_attn.engine.call import BWD, FWD
from cudnn_attn.engine.prepared import Known, PreparedCall, call_key, calls, prepared_call

__all__ = ["BoundAttention", "attention", "bind", "dot_product_attention", "dot_product_attention_bwd", "paged_attention",
           "run_backward", "run_forward"]

# -- arrays in, arrays out ------------------------------------------------------------------------------

def _gpu_arrays(stream: Any, **arrays: Any) -> dict[str, Any]:
    """Every array argument as a CuPy array on the query's device (``None`` stays ``None``).

    Raises :class:`~cudnn_attn.core.errors.NoGPUError` first when there is no GPU.
    """
    runtime.require_gpu()
    device = runtime.device_of("query", arrays["query"])
    on_stream = None if stream is None else \
        runtime.device_context(device).stream(runtime.stream_pointer(stream, device))
    # Q, K and V keep their strides where cuDNN reads them (packed and paged tensors are read densely).
    strided = arrays.get("q_offsets") is None and arrays.get("page_table_k") is None
    converted = {}
    for name, x in arrays.items():
        if x is None:
            converted[name] = None
        elif name == "fp8_params":
            converted[name] = {k: runtime.as_cupy(f"fp8_params[{k!r}]", v, device, on_stream) for k, v in x.items()}
        elif name == "score_mod_args":
            converted[name] = tuple(x)          # scalars, bound by value on the host
        else:
            converted[name] = runtime.as_cupy(name, x, device, on_stream, strided=strided and name in _STRIDED)
    return converted


_STRIDED = ("query", "key", "value")


def _with_strides(config: AttentionConfig, operands: AttentionOperands) -> AttentionConfig:
    """``config`` with the strides of the Q, K and V views it is called on (``None`` for dense arrays)."""
    found = {name: runtime.element_strides(x) for name in _STRIDED
             if not (x := getattr(operands, name)).flags.c_contiguous}
    return config.replace(strides=InputStrides(**found)) if found else config


def _framework(x: Any) -> str:
    root = type(x).__module__.partition(".")[0]
    return {"torch": "torch", "jax": "jax", "jaxlib": "jax"}.get(root, "cupy")


def _exporter(query: Any, out_type: str | None) -> Callable[[Any], Any] | None:
    """How results return to the caller's framework (``None``: they stay CuPy arrays)."""
    if out_type not in (None, "cupy"):
        raise ValueError(f"out_type: must be None (the query's framework) or 'cupy', got {out_type!r}")
    framework = "cupy" if out_type == "cupy" else _framework(query)
    if framework == "torch":
        import torch

        return lambda x: None if x is None else torch.from_dlpack(x)
    if framework == "jax":
        import jax

        return lambda x: None if x is None else jax.dlpack.from_dlpack(x)
    return None


def _export(result: Any, exporter: Callable[[Any], Any] | None) -> Any:
    if exporter is None:
        return result
    if isinstance(result, tuple):
        return type(result)(*(exporter(x) for x in result)) if hasattr(result, "_fields") else \
            tuple(exporter(x) for x in result)
    return exporter(result)


# -- validation, once per signature ----------------------------------------------------------------------

def _validate_on_device(arrays: dict[str, Any], static: dict[str, Any],
                        fp8_dtype: str | None = None) -> tuple[AttentionConfig, AttentionOperands]:
    """:func:`cudnn_attn.engine.prepared.validated` on the query's device, the bias as cuDNN reads it
    (:func:`cudnn_attn.engine.call_steps.dense_bias`, converted on that device too).  With ``fp8_dtype``, uint8
    Q/K/V are the bytes of that FP8 format (CuPy has no float8 dtype): validation reads them as such and they are
    bound as they are."""
    if fp8_dtype is not None:
        static = dict(static, fp8_dtype=fp8_dtype)
    cupy = runtime.cupy()
    with runtime.on_device(arrays["query"].device.id):
        config, operands = prepared.validated(arrays, static, xp=cupy)
        return config, call_steps.dense_bias(operands, cupy)


# -- the direct launch of repeated Q/K/V calls ----------------------------------------------------------------

def _remember_direct(kind: str, arrays: tuple, static: tuple, config: AttentionConfig, autotune: bool | None,
                     names: Sequence[str]) -> None:
    """After a successful call: its signature takes the direct launch next time (when the call is of its arrays
    alone, and cuDNN read them as they are: Q, K, V dense or with readable strides, the backward's residuals dense)."""
    if not all(x.flags.c_contiguous or (i < 3 and runtime.readable_strides(x)) for i, x in enumerate(arrays)):
        return
    call = prepared_call(config, kind, arrays[0].data.device_id, autotune)
    if call.direct_capable:
        calls.remember(call_key(kind, arrays, static), Known(config, frozenset(), call, call.direct_order(names)))


def _launch_direct(kind: str, arrays: tuple, static: tuple, seed: Any) -> tuple[PreparedCall, list[Any]] | None:
    """The direct launch of a remembered signature: ``(its prepared call, the results)``, or ``None`` when the
    signature is not remembered (or holds an unhashable argument: the generic path's validation explains)."""
    known = calls.get(call_key(kind, arrays, static))
    if known is None:
        return None
    call = known.prepared
    seed = check_seed(seed) if call.dropout else seed
    pointers = [x.data.ptr for x in known.order(arrays)]
    cupy = runtime.cupy()
    if cupy.cuda.runtime.getDevice() != call.device:
        with cupy.cuda.Device(call.device):
            return call, call.direct(pointers, seed)
    return call, call.direct(pointers, seed)


def _is_cupy(*arrays: Any) -> bool:
    ndarray = _NDARRAY or _cupy_ndarray()
    for x in arrays:
        if type(x) is not ndarray:
            return False
    return True


# -- the public functions (signatures: cudnn_attn.core.parameters) -----------------------------------------------

def _forward(call: Any) -> tuple[AttentionConfig, AttentionOutput, Callable[[Any], Any] | None]:
    """The forward of a seed or native call on the generic path: arrays imported, validated (through the
    memo), run.  Returns the configuration, the named results and how they return to the caller's framework."""
    exporter = _exporter(call.query, call.out_type)
    config, result = run_forward(call)
    return config, result, exporter


def run_forward(call: Any, *, output: Any = None, logsumexp: Any = None) -> tuple[AttentionConfig, AttentionOutput]:
    """The generic path of a forward call (``dot_product_attention.arguments(...)`` or ``attention.arguments(...)``):
    the arrays imported, validated through the memo, run by the prepared call.  Returns the configuration and the
    results as CuPy arrays, written into ``output`` / ``logsumexp`` when given (CuPy arrays of the configuration's
    ``o_shape`` / ``lse_shape``: for a front whose framework allocates its results, :mod:`cudnn_attn.torch`)."""
    arrays, static = parameters.arguments(call)
    arrays = _gpu_arrays(call.stream, **arrays)
    fp8_dtype = getattr(call, "fp8_dtype", None) if static["use_fp8"] else None
    with parameters.native_names(call):
        config, operands = _validate_on_device(arrays, static, fp8_dtype)
    config = _with_strides(parameters.finish(call, config), operands)
    config, operands, seed = bind_seed(config, operands, call.seed)
    result = prepared.forward(config, operands, seed=seed, stream=call.stream,
                              autotune=call.autotune, check_values=call.check_values, output=output,
                              logsumexp=logsumexp)
    return config, result


@parameters.front(parameters.NATIVE, "fp8_dtype", "stream", "autotune", "out_type", "check_values")
def attention(query: Any, key: Any, value: Any, *, mask: MaskSpec | None = None, bias: Any = None,
              scale: float | None = None, dropout_rate: float = 0.0, seed: int = 42, layout: str = "BTNH",
              sink: Any = None, fp8_params: FP8Params | None = None, return_aux: AuxRequest | None = None,
              fp8_dtype: str = "float8_e4m3fn", stream: Any = None, autotune: bool | None = None,
              out_type: str | None = None, check_values: bool | None = None) -> AttentionOutput:
    """cuDNN scaled dot-product attention with named results (the native API).

    ``mask`` is a :class:`~cudnn_attn.core.masks.MaskSpec` built from ``causal()``, ``window(left, right)``,
    ``padding(q_lengths, kv_lengths)``, ``segments(...)``, ``alibi()``, ``keep(array)`` combined with ``&``;
    ``bias`` an additive bias broadcastable to ``(B, N, T, S)``; ``scale=None`` is ``1/sqrt(H)``; ``layout``
    ``"BTNH"`` or ``"BNTH"``; ``fp8_params`` (FP8Params) runs FP8 (uint8 Q/K/V bytes of ``fp8_dtype``).

    Returns :class:`~cudnn_attn.core.types.AttentionOutput`: ``output``, ``logsumexp`` with
    ``return_aux=AuxRequest(logsumexp=True)`` (else ``None``), ``score_max`` and ``max_logit`` with
    ``AuxRequest(max_logit=True)``, ``amax_s``/``amax_o`` with FP8.  ``seed`` is an int, or a CuPy int64
    array ``[seed, offset]`` on the call's device that cuDNN reads at launch (this module's seed functions take
    it too: :func:`cudnn_attn.core.validation.seed_operands`).  The extensions (``stream``, ``autotune``,
    ``out_type``, ``check_values``) are :func:`dot_product_attention`'s, and so is the direct path of repeated
    calls (CuPy Q/K/V and a mask without arrays, a static seed, no max logit).
    """
    call = attention.arguments(query, key, value, mask, bias, scale, dropout_rate, seed, layout, sink, fp8_params,
                               return_aux, fp8_dtype, stream, autotune, out_type, check_values)
    qkv = (call.query, call.key, call.value)
    mask = call.mask
    plain = (call.bias is None and call.sink is None and call.fp8_params is None and call.stream is None
             and call.out_type is None and (mask is None or type(mask) is MaskSpec and not mask.has_arrays)
             and not getattr(call.return_aux, "max_logit", False) and seed_operands(call.seed) is None
             and _is_cupy(*qkv))
    if plain:               # the direct path, keyed by the mask's static fields (MaskSpec compares by identity)
        static = ("attention", None if mask is None else mask.static(padding=False), call.scale, call.dropout_rate,
                  call.layout, call.return_aux, call.autotune)
        launched = _launch_direct(FWD, qkv, static, call.seed)
        if launched is not None:
            direct, results = launched
            return AttentionOutput(results[0], results[1] if direct.training else None)
    config, result, exporter = _forward(call)
    if plain:
        _remember_direct(FWD, qkv, static, config, call.autotune, ("query", "key", "value"))
    return _export(result, exporter)


@parameters.front(parameters.FORWARD, "stream", "autotune", "fp8_dtype", "out_type", "check_values")
def dot_product_attention(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, q_seqlen: Any = None,
                          kv_seqlen: Any = None, q_offsets: Any = None, kv_offsets: Any = None,
                          fp8_params: FP8Params | None = None, score_mod_args: Sequence[Any] = (), *,
                          scale: float | None = 1.0, mask_type: MaskType = MaskType.NO_MASK, seed: int = 42,
                          dropout_rate: float = 0.0, qkv_layout: str = "BTNH",
                          sliding_window_length: int | None = None, score_mod: Callable[..., Any] | None = None,
                          use_fp8: bool = False, return_residual: bool = False, diagonal_alignment: str = "top_left",
                          sink: Any = None, stream: Any = None, autotune: bool | None = None,
                          fp8_dtype: str = "float8_e4m3fn", out_type: str | None = None,
                          check_values: bool | None = None) -> Any:
    """cuDNN scaled dot-product attention (forward).

    Shapes: Q ``(B, T, N, H)`` / K, V ``(B, S, K, H)`` in BTNH (``(B, N, T, H)`` in BNTH); ``bias`` and
    ``mask`` broadcast to ``(B, N, T, S)`` (``mask`` True keeps); ``q_seqlen``/``kv_seqlen`` int32
    ``(B,)``, or ``(B, M)`` with packed segments given by ``q_offsets``/``kv_offsets`` ``(B, M + 1)``.

    Returns the output (the query's layout, ``v``'s head dim), ``(output, logsumexp)`` with
    ``return_residual`` (logsumexp float32 ``(B, N, T)``, ``(B*M, N, T)`` packed), or
    ``(output, amax_s, amax_o)`` with ``use_fp8`` (FP8 output as uint8 bytes, see the module doc).
    """
    call = dot_product_attention.arguments(query, key, value, bias, mask, q_seqlen, kv_seqlen, q_offsets, kv_offsets,
                                           fp8_params, score_mod_args, scale, mask_type, seed, dropout_rate,
                                           qkv_layout, sliding_window_length, score_mod, use_fp8, return_residual,
                                           diagonal_alignment, sink, stream, autotune, fp8_dtype, out_type,
                                           check_values)
    qkv = (call.query, call.key, call.value)
    static = (call.scale, call.mask_type, call.dropout_rate, call.qkv_layout, call.sliding_window_length,
              call.score_mod, call.use_fp8, call.return_residual, call.diagonal_alignment, call.autotune,
              call.fp8_dtype)
    plain = _plain(call) and not call.score_mod_args and _is_cupy(*qkv)
    if plain:
        launched = _launch_direct(FWD, qkv, static, call.seed)
        if launched is not None:
            direct, results = launched
            return (results[0], results[1]) if direct.training else results[0]
    config, result, exporter = _forward(call)
    if plain:
        _remember_direct(FWD, qkv, static, config, call.autotune, ("query", "key", "value"))
    return _export(result.seed_form(call.use_fp8, call.return_residual), exporter)


def _plain(call: Any) -> bool:
    """A call of Q/K/V (and the backward's residuals) alone, on the current stream, results as CuPy arrays."""
    return (call.bias is None and call.mask is None and call.q_seqlen is None and call.kv_seqlen is None
            and call.q_offsets is None and call.kv_offsets is None and call.fp8_params is None and call.sink is None
            and call.stream is None and call.out_type is None and seed_operands(call.seed) is None)


@parameters.front(parameters.PAGED, "stream", "autotune", "out_type", "check_values")
def paged_attention(query: Any, key: Any, value: Any, q_seqlen: Any, kv_seqlen: Any, page_table_k: Any,
                    page_table_v: Any, bias: Any = None, mask: Any = None, fp8_params: FP8Params | None = None, *,
                    scale: float | None = 1.0, mask_type: MaskType = MaskType.NO_MASK, seed: int = 42,
                    dropout_rate: float = 0.0, qkv_layout: str = "BTNH", sliding_window_length: int | None = None,
                    use_fp8: bool = False, return_residual: bool = False, diagonal_alignment: str = "top_left",
                    sink: Any = None, stream: Any = None, autotune: bool | None = None, out_type: str | None = None,
                    check_values: bool | None = None) -> Any:
    """cuDNN attention over paged K/V caches (forward only).

    K/V are caches of blocks ``(num_blocks, block_size, K, H)`` (BTNH) or ``(num_blocks, K, block_size, H)``
    (BNTH); ``page_table_k``/``page_table_v`` int32 ``(B, 1, blocks_per_seq, 1)`` map each sequence's
    logical blocks to cache blocks.  Returns the output, or ``(output, logsumexp)`` with ``return_residual``.
    """
    call = paged_attention.arguments(query, key, value, q_seqlen, kv_seqlen, page_table_k, page_table_v, bias, mask,
                                     fp8_params, scale, mask_type, seed, dropout_rate, qkv_layout,
                                     sliding_window_length, use_fp8, return_residual, diagonal_alignment, sink,
                                     stream, autotune, out_type, check_values)
    _, result, exporter = _forward(call)
    return _export(result.seed_form(call.use_fp8, call.return_residual), exporter)


@parameters.front(parameters.BACKWARD, "deterministic", "stream", "autotune", "fp8_dtype", "out_type", "check_values")
def dot_product_attention_bwd(query: Any, key: Any, value: Any, output: Any, grad_output: Any, logsumexp: Any,
                              bias: Any = None, mask: Any = None, q_seqlen: Any = None, kv_seqlen: Any = None,
                              q_offsets: Any = None, kv_offsets: Any = None, fp8_params: FP8Params | None = None,
                              score_mod_args: Sequence[Any] = (), *, scale: float | None = 1.0,
                              mask_type: MaskType = MaskType.NO_MASK, seed: int = 42, dropout_rate: float = 0.0,
                              qkv_layout: str = "BTNH", sliding_window_length: int | None = None,
                              score_mod: Callable[..., Any] | None = None, use_fp8: bool = False,
                              return_residual: bool = False, diagonal_alignment: str = "top_left", sink: Any = None,
                              deterministic: bool = False, stream: Any = None, autotune: bool | None = None,
                              fp8_dtype: str = "float8_e4m3fn", out_type: str | None = None,
                              check_values: bool | None = None) -> AttentionGrads:
    """Backward of :func:`dot_product_attention` called with the same arguments (and the same ``seed``).

    ``output`` and ``logsumexp`` are the forward's results (``return_residual=True``), ``grad_output``
    the gradient of the output.  Returns :class:`AttentionGrads` ``(dq, dk, dv, dbias, dsink, ...)``:
    ``dbias`` when the bias is differentiable (an explicit bias, or a non-boolean mask), reduced to the
    bias's own broadcast shape; ``dsink`` with a sink; with ``use_fp8`` the FP8 gradients (uint8 bytes,
    like ``output`` and ``grad_output``) and ``amax_dQ/dK/dV/dP``.  ``return_residual`` is accepted
    for signature parity and ignored.
    """
    call = dot_product_attention_bwd.arguments(query, key, value, output, grad_output, logsumexp, bias, mask,
                                               q_seqlen, kv_seqlen, q_offsets, kv_offsets, fp8_params, score_mod_args,
                                               scale, mask_type, seed, dropout_rate, qkv_layout,
                                               sliding_window_length, score_mod, use_fp8, return_residual,
                                               diagonal_alignment, sink, deterministic, stream, autotune, fp8_dtype,
                                               out_type, check_values)
    static = (call.scale, call.mask_type, call.dropout_rate, call.qkv_layout, call.sliding_window_length,
              call.score_mod, call.use_fp8, call.diagonal_alignment, call.deterministic, call.autotune,
              call.fp8_dtype)
    residual_arrays = (call.query, call.key, call.value, call.output, call.grad_output, call.logsumexp)
    plain = _plain(call) and not call.score_mod_args and _is_cupy(*residual_arrays)
    if plain:
        launched = _launch_direct(BWD, residual_arrays, static, call.seed)
        if launched is not None:
            return AttentionGrads(*launched[1])
    exporter = _exporter(call.query, call.out_type)
    config, grads = run_backward(call)
    if plain and not config.has_dbias and not config.sink:
        _remember_direct(BWD, residual_arrays, static, config, call.autotune,
                         ("query", "key", "value", "output", "grad_output", "logsumexp"))
    return _export(grads, exporter)


def run_backward(call: Any, *, dq: Any = None, dk: Any = None,
                 dv: Any = None) -> tuple[AttentionConfig, AttentionGrads]:
    """The generic path of a backward call (``dot_product_attention_bwd.arguments(...)``), as :func:`run_forward`:
    the configuration and the gradients as CuPy arrays, ``dq`` / ``dk`` / ``dv`` written into the given arrays."""
    arrays, static_arguments = parameters.arguments(call, backward=True)
    arrays = _gpu_arrays(call.stream, **arrays, output=call.output, grad_output=call.grad_output,
                         logsumexp=call.logsumexp)
    output, grad_output, logsumexp = (arrays.pop(n) for n in ("output", "grad_output", "logsumexp"))
    config, operands = _validate_on_device(arrays, static_arguments, call.fp8_dtype if call.use_fp8 else None)
    validate_backward(config, output, grad_output, logsumexp)      # FP8 O and dO: uint8 bytes like Q/K/V
    config, operands, seed = bind_seed(_with_strides(config, operands), operands, call.seed)
    grads = prepared.backward(config, operands, output, grad_output, logsumexp, seed=seed,
                              stream=call.stream, autotune=call.autotune, check_values=call.check_values,
                              dq=dq, dk=dk, dv=dv)
    return config, grads


# -- pre-bound calls ----------------------------------------------------------------------------------

class BoundAttention:
    """A forward (and its backward) validated once for fixed Q/K/V shapes, dtypes, strides and static
    arguments; made by :func:`bind`.

    ``bound(q, k, v)`` returns what :func:`dot_product_attention` returns; ``bound.backward(q, k, v, o,
    do, lse)`` returns :class:`~cudnn_attn.core.types.AttentionGrads` (validated and built on its first call).
    Each call only checks that the arrays are CuPy arrays of the bound signature on the bound device (a
    mismatch is a ValueError: cuDNN would read out of bounds), then launches the prepared call directly on the
    current CuPy stream.
    """

    _FWD_NAMES = ("query", "key", "value")
    _BWD_NAMES = _FWD_NAMES + ("output", "grad_output", "logsumexp")

    def __init__(self, query: Any, key: Any, value: Any, *, seed: int, static: dict, autotune: bool | None = None):
        self._static = dict(static)
        self._seed = check_seed(seed)
        self._autotune = autotune
        self._forward = self._make(FWD, (query, key, value))
        self._backward: _Bound | None = None
        self.config: AttentionConfig = self._forward.call.config

    def _make(self, kind: str, arrays: tuple) -> "_Bound":
        static = dict(self._static)
        deterministic = static.pop("deterministic")
        return_residual = static.pop("return_residual")
        training = return_residual if kind == FWD else True
        for name, x in zip(self._BWD_NAMES, arrays):
            if not x.flags.c_contiguous and not (name in _STRIDED and runtime.readable_strides(x)):
                raise ValueError(f"{name}: bind takes arrays cuDNN reads as they are - dense, or (query, key, value) "
                                 f"views with positive 16-byte-aligned strides and a contiguous last dimension; got "
                                 f"{x.dtype}{list(x.shape)} with strides {x.strides} (pass cupy.ascontiguousarray(x))")
        config, operands = _validate_on_device(dict(zip(self._FWD_NAMES, arrays[:3])), dict(
            static, training=training, deterministic=deterministic and kind == BWD))
        config = _with_strides(config, operands)
        if kind == BWD:
            validate_backward(config, *arrays[3:])
        call = prepared_call(config, kind, arrays[0].data.device_id, self._autotune)
        if call.padded is not None:
            raise ValueError(f"bind: the {kind} of {config.describe()} runs lifted (padded, transposed to BTNH or its "
                             "diagonal folded into the bias: cudnn_attn.core.padded_call); "
                             "call dot_product_attention / dot_product_attention_bwd for it")
        call.plan()                                          # built now
        typed = [prepared.descriptor(x) for x in arrays]
        return _Bound(call, call.direct_order(self._BWD_NAMES[:len(arrays)]), typed, sum(map(tuple, typed), ()))

    def _check(self, bound: "_Bound", arrays: tuple) -> None:
        """Raise a ValueError naming the first of ``arrays`` that is not a CuPy array of ``bound``'s signature."""
        describe = prepared.descriptor
        try:
            if [describe(x) for x in arrays] == bound.typed:
                return
        except AttributeError:                  # not an array: named below
            pass
        ndarray = _NDARRAY or _cupy_ndarray()
        for name, x, expected in zip(self._BWD_NAMES, arrays, bound.typed):
            if type(x) is not ndarray or (ndarray, x.shape, x.dtype, x.strides, x.data.device_id) != expected:
                _, shape, dtype, strides, device = expected
                raise ValueError(f"{name}: this bound call takes a CuPy array {dtype}{list(shape)} with strides "
                                 f"{strides} on GPU {device}, got {type(x).__name__}"
                                 + (f" {x.dtype}{list(x.shape)}" if hasattr(x, "shape") else ""))

    def __call__(self, query: Any, key: Any, value: Any, *, out: Any = None) -> Any:
        """The forward; ``out`` (optional) is a preallocated output (C-contiguous, the output's shape and
        dtype, on the bound device) that receives the result instead of a new array."""
        arrays, forward = (query, key, value), self._forward
        try:            # the signature check of _check, spelled out for Q, K, V: 1 us less per call
            same = (type(query), query.shape, query.dtype, query.strides, query.data.device_id,
                    type(key), key.shape, key.dtype, key.strides, key.data.device_id,
                    type(value), value.shape, value.dtype, value.strides, value.data.device_id) == forward.flat
        except AttributeError:
            same = False
        if not same:
            self._check(forward, arrays)
        results = forward.launch(arrays, self._seed, out)
        return (results[0], results[1]) if forward.call.training else results[0]

    def backward(self, query: Any, key: Any, value: Any, output: Any, grad_output: Any,
                 logsumexp: Any) -> AttentionGrads:
        arrays = (query, key, value, output, grad_output, logsumexp)
        if self._backward is None:
            self._check(self._forward, arrays[:3])
            self._backward = self._make(BWD, arrays)
        self._check(self._backward, arrays)
        dq, dk, dv = self._backward.launch(arrays, self._seed)
        return AttentionGrads(dq, dk, dv)


class _Bound(NamedTuple):
    """One bound kind: its prepared call, the operand order, and the array descriptors it takes."""

    call: PreparedCall
    order: Callable[[Sequence[Any]], tuple]
    typed: list
    flat: tuple

    def launch(self, arrays: tuple, seed: int, out: Any = None) -> list[Any]:
        call = self.call
        cupy = runtime.cupy()
        pointers = [x.data.ptr for x in self.order(arrays)]
        if cupy.cuda.runtime.getDevice() != call.device:
            with cupy.cuda.Device(call.device):
                return call.direct(pointers, seed, out)
        return call.direct(pointers, seed, out)


def bind(query: Any, key: Any, value: Any, *, scale: float | None = 1.0, mask_type: MaskType = MaskType.NO_MASK,
         seed: int = 42, dropout_rate: float = 0.0, qkv_layout: str = "BTNH",
         sliding_window_length: int | None = None, return_residual: bool = False,
         diagonal_alignment: str = "top_left", deterministic: bool = False,
         autotune: bool | None = None) -> BoundAttention:
    """A pre-bound attention call for these Q/K/V (CuPy arrays; their shapes, dtypes, strides and device)
    and static arguments (those of :func:`dot_product_attention`).  Validates and builds now (``autotune``:
    times every cuDNN plan on these arrays and keeps the fastest); each call of the returned
    :class:`BoundAttention` only checks the arrays and launches."""
    if not _is_cupy(query, key, value):
        raise ValueError(f"query/key/value: bind takes CuPy arrays, got {type(query).__name__}, "
                         f"{type(key).__name__}, {type(value).__name__} (convert with cupy.from_dlpack)")
    runtime.require_gpu()
    prepared.plan_choice(autotune)                                # a bad value fails here, named
    static = dict(scale=scale, mask_type=mask_type, dropout_rate=dropout_rate, qkv_layout=qkv_layout,
                  sliding_window_length=sliding_window_length, return_residual=return_residual,
                  diagonal_alignment=diagonal_alignment, deterministic=deterministic)
    return BoundAttention(query, key, value, seed=seed, static=static, autotune=autotune)


_CUPY = None
_NDARRAY = None


def _cupy() -> Any:
    global _CUPY
    import cupy

    _CUPY = cupy
    return cupy


def _cupy_ndarray() -> Any:
    global _NDARRAY
    try:
        _NDARRAY = _cupy().ndarray
    except ImportError:              # pragma: no cover - cupy is a dependency
        _NDARRAY = type(None)
    return _NDARRAY
