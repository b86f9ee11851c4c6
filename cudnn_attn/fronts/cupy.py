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
  ``CUDNN_ATTN_AUTOTUNE=1`` was set when the library was imported: :data:`cudnn_attn.fronts.execution.AUTOTUNE_DEFAULT`);
* ``fp8_dtype`` (with ``use_fp8``) - the FP8 format of the uint8 operands: ``"float8_e4m3fn"``
  (default) or ``"float8_e5m2"``;
* ``out_type`` - the array type of the results: ``None`` (default) returns them in the query's
  framework (CuPy arrays for CuPy, torch tensors for torch, JAX arrays for JAX, zero-copy through
  DLPack), ``"cupy"`` always returns CuPy arrays.

Inputs are CuPy arrays or any ``__dlpack__`` GPU array (torch tensors, JAX arrays), zero-copy; every
array of a call lives on the query's device.  bfloat16 is CuPy's ``ml_dtypes.bfloat16``.  Rows cuDNN
does not compute (padding, tokens outside packed segments) are returned as zeros.

Speed.  Validation (:func:`cudnn_attn.core.validation.validate_call`) runs in full for every new call signature
(shapes, dtypes, strides, device and every static argument) and is reused only for an identical one.
A repeated CuPy call of Q/K/V alone (the common training and benchmarking case) takes a direct path:
one dictionary lookup of its signature, the results allocated, one launch.  :func:`bind` goes further
for a fixed signature: it validates once and its calls only check that the arrays still match.

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
:mod:`cudnn_attn.core.parameters`.  On a prepared ``(AttentionConfig, AttentionOperands)`` with preallocated
outputs: :mod:`cudnn_attn.fronts.execution`.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Callable, Sequence

from cudnn_attn.core import parameters
from cudnn_attn.core.config import AttentionConfig, AttentionOperands
from cudnn_attn.core.masks import MaskSpec
from cudnn_attn.core.padded_call import lifted_config
from cudnn_attn.core.types import AttentionGrads, AttentionOutput, MaskType
from cudnn_attn.core.validation import check_seed, validate_backward, validate_call
from cudnn_attn.engine import runtime
from cudnn_attn.engine.plan import BWD, DIRECT_IDS, FWD
from cudnn_attn.engine.result_blocks import result_blocks

from . import execution

__all__ = ["BoundAttention", "attention", "bind", "dot_product_attention", "dot_product_attention_bwd", "paged_attention"]

# -- arrays in, arrays out ------------------------------------------------------------------------------

def _gpu_arrays(stream: Any, **arrays: Any) -> dict[str, Any]:
    """Every array argument as a CuPy array on the query's device (``None`` stays ``None``).

    Raises :class:`~cudnn_attn.core.errors.NoGPUError` first when there is no GPU.
    """
    runtime.require_gpu()
    device = runtime.device_of("query", arrays["query"])
    on_stream = None if stream is None else \
        runtime.device_context(device).stream(runtime.stream_pointer(stream, device))
    converted = {}
    for name, x in arrays.items():
        if x is None:
            converted[name] = None
        elif name == "fp8_params":
            converted[name] = {k: runtime.as_cupy(f"fp8_params[{k!r}]", v, device, on_stream) for k, v in x.items()}
        elif name == "score_mod_args":
            converted[name] = tuple(x)          # scalars, bound by value (see cudnn_attn.fronts.execution)
        else:
            converted[name] = runtime.as_cupy(name, x, device, on_stream)
    return converted


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


# -- validation, once per signature ---------------------------------------------------------------------

_OPERAND_FIELDS = ("query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets",
                   "page_table_k", "page_table_v", "sink")


class _ValidationMemo:
    """:func:`~cudnn_attn.core.validation.validate_call` for repeated call signatures, without re-running it.

    ``validate_call`` reads nothing but shapes, dtypes and the static arguments, so its verdict and its
    configuration hold for every call with the same signature (shape, dtype and strides of every array,
    the device, every static argument).  When it passed the arrays through unchanged (no mask folded
    into the bias, no FP8 scales, no score_mod arguments), a repeated signature reuses the configuration
    *object* and only rebinds the new arrays.
    """

    def __init__(self, maxsize: int = 256):
        self._maxsize = maxsize
        self._known: dict[tuple, tuple[Any, frozenset]] = {}

    def validate(self, arrays: dict[str, Any], static: dict[str, Any]) -> tuple[Any, Any]:
        if arrays.get("mask") is not None or arrays.get("fp8_params") or arrays.get("score_mod_args"):
            return validate_call(**arrays, **static, xp=_cupy())
        shapes = tuple(None if arrays.get(n) is None else (arrays[n].shape, arrays[n].dtype, _strides(arrays[n]))
                       for n in _OPERAND_FIELDS)
        signature = (shapes, tuple(static.items()))
        try:
            known = self._known.get(signature)
        except TypeError:                         # an unhashable argument: validate_call explains what is wrong
            return validate_call(**arrays, **static, xp=_cupy())
        if known is not None:
            config, kept = known
            return config, AttentionOperands(**{n: arrays[n] for n in kept})
        config, operands = validate_call(**arrays, **static, xp=_cupy())
        kept = frozenset(n for n in _OPERAND_FIELDS if getattr(operands, n) is not None)
        if all(getattr(operands, n) is arrays.get(n) for n in kept):
            if len(self._known) >= self._maxsize:
                self._known.clear()
            self._known[signature] = (config, kept)
        return config, operands


def _strides(x: Any) -> Any:
    return getattr(x, "strides", None)


_validated = _ValidationMemo()


def _validate_on_device(arrays: dict[str, Any], static: dict[str, Any], fp8_dtype: str | None = None) -> tuple[Any, Any]:
    """Validate (through the memo) on the query's device.  The bias cuDNN reads must be dense and in
    the io dtype: a mask folded by ``validate_call`` may be neither (CuPy 14's bfloat16 ``where`` computes in
    float32), so it is converted here.  With ``fp8_dtype``, uint8 Q/K/V are the bytes of that FP8 format
    (CuPy has no float8 dtype): ``validate_call`` reads them as such and they are bound as they are."""
    if fp8_dtype is not None:
        static = dict(static, fp8_dtype=fp8_dtype)
    with runtime.on_device(arrays["query"].device.id):
        config, operands = _validated.validate(arrays, static)
        bias, io = operands.bias, operands.query.dtype
        if bias is not None and (bias.dtype != io or not bias.flags.c_contiguous):
            operands = operands.replace(bias=_cupy().ascontiguousarray(bias.astype(io, copy=False)))
    return config, operands


# -- the direct path of repeated Q/K/V calls ---------------------------------------------------------------

class _Direct:
    """A validated signature whose arrays are exactly the graph's operands (Q, K, V and, for the
    backward, O, dO and the logsumexp): each call binds them, allocates the results and launches.

    Several results (the backward's dq, dk, dv; the training forward's output and logsumexp) are views of
    one allocation from CuPy's pool, 256-byte aligned: one pool allocation costs about as much as one
    ``cupy.empty`` (the pool's lock and free-list search dominate), a view only the array object.  The
    next call on the same stream reuses that block when the caller has dropped every result
    (:mod:`cudnn_attn.engine.result_blocks`): no allocation, and the same addresses let the launch replay.

    It refers to its :class:`~cudnn_attn.engine.plan.CallPlan` weakly, so evicting the plan from the graph
    cache frees it; the next call fetches (or rebuilds) it.
    """

    __slots__ = ("config", "kind", "device", "autotune", "order", "dropout", "training", "typed", "flat", "_plan",
                 "_results", "_layout", "_nbytes", "__weakref__")

    def __init__(self, config: AttentionConfig, kind: str, arrays: tuple, autotune: bool | None,
                 names: Sequence[str]):
        self.config, self.kind, self.autotune = config, kind, autotune
        self.device = arrays[0].data.device_id
        self.typed = [(type(x), x.shape, x.dtype, x.strides, x.data.device_id) for x in arrays]
        self.flat = sum(self.typed, ())                  # one tuple: what a bound forward compares
        self.dropout = config.has_dropout
        self.training = config.training
        plan = self.plan()
        position = {DIRECT_IDS[name]: i for i, name in enumerate(names)}
        self.order = operator.itemgetter(*(position[t] for t in plan.operand_ids))

    def plan(self) -> Any:
        plan = execution.plan_for(self.config, self.kind, self.device, self.autotune)
        self._plan = weakref.ref(plan)
        self._results = tuple((spec.shape, spec.dtype) for spec in plan.results)
        layout, offset = [], 0
        for spec in plan.results:
            layout.append((spec.shape, spec.dtype, offset))
            offset += -(-spec.nbytes // _ALIGNMENT) * _ALIGNMENT
        self._layout, self._nbytes = tuple(layout), offset
        return plan

    def __call__(self, arrays: tuple, seed: int, out: Any = None) -> list[Any]:
        cupy = _CUPY or _cupy()
        if cupy.cuda.runtime.getDevice() != self.device:
            with cupy.cuda.Device(self.device):
                return self._launch(cupy, arrays, seed, out)
        return self._launch(cupy, arrays, seed, out)

    def _allocate(self, stream: int) -> list[Any]:
        """The results on the current device and ``stream``: those of an earlier call of this signature that
        the caller has let go of (:mod:`cudnn_attn.engine.result_blocks`), else new ones (see the class doc)."""
        return result_blocks.results(self, stream, self._nbytes, self._new_results)

    def _new_results(self) -> list[Any]:
        cupy = _CUPY or _cupy()
        ndarray = cupy.ndarray                # what cupy.empty returns, without its Python wrapper
        if len(self._layout) == 1:
            shape, dtype, _ = self._layout[0]
            return [ndarray(shape, dtype)]
        memory = cupy.cuda.alloc(self._nbytes)
        return [ndarray(shape, dtype, memory + offset if offset else memory) for shape, dtype, offset in self._layout]

    def _launch(self, cupy: Any, arrays: tuple, seed: int, out: Any) -> list[Any]:
        plan = self._plan() or self.plan()
        stream = cupy.cuda.get_current_stream().ptr
        if out is None:
            results = self._allocate(stream)
        else:
            shape, dtype = self._results[0]
            if type(out) is not type(arrays[0]) or out.shape != shape or out.dtype != dtype \
                    or not out.flags.c_contiguous or out.data.device_id != self.device:
                raise ValueError(f"out: must be a C-contiguous CuPy array {dtype}{list(shape)} on GPU {self.device}, "
                                 f"got {type(out).__name__}" + (f" {out.dtype}{list(out.shape)}"
                                                               if hasattr(out, "shape") else ""))
            results = [out] + [cupy.empty(shape, dtype) for shape, dtype in self._results[1:]]
        pointers = [x.data.ptr for x in self.order(arrays)]          # Q, K, V at least: a tuple
        pointers += [r.data.ptr for r in results]
        if self.dropout:
            plan.launch(pointers, stream, None, (seed, 0))
        else:
            plan.run(pointers, stream)
        return results


_ALIGNMENT = 256                        # bytes between the results of one allocation (cuDNN asks for 16)
_direct: dict[tuple, _Direct] = {}
_DIRECT_MAX = 1024


def _direct_signature(kind: str, arrays: tuple, static: tuple) -> tuple:
    """Everything validation and the plan depend on: shape, dtype, strides and device of every array, and the
    static arguments (``autotune`` among them; its default is fixed at import)."""
    return (kind, *[(x.shape, x.dtype, x.strides, x.data.device_id) for x in arrays], static)


def _remember_direct(kind: str, arrays: tuple, static: tuple, config: AttentionConfig, autotune: bool | None,
                     names: Sequence[str]) -> None:
    """After a successful generic call: make its signature take the direct path next time."""
    if config.packing is not None or config.fp8 or config.score_mod is not None or config.mask.padding \
            or lifted_config(config) is not None:
        return
    if len(_direct) >= _DIRECT_MAX:
        _direct.clear()
    _direct[_direct_signature(kind, arrays, static)] = _Direct(config, kind, arrays, autotune, names)


def _launch_direct(kind: str, arrays: tuple, static: tuple, seed: Any) -> tuple[_Direct, list[Any]] | None:
    """The direct path of a remembered signature: ``(its _Direct, the results)``, or ``None`` when the
    signature is not remembered (or holds an unhashable argument: the generic path's validation explains)."""
    try:
        direct = _direct.get(_direct_signature(kind, arrays, static))
    except TypeError:
        return None
    if direct is None:
        return None
    return direct, direct(arrays, check_seed(seed) if direct.dropout else seed)


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
    arrays, static = parameters.arguments(call)
    arrays = _gpu_arrays(call.stream, **arrays)
    fp8_dtype = getattr(call, "fp8_dtype", None) if static["use_fp8"] else None
    with parameters.native_names(call):
        config, operands = _validate_on_device(arrays, static, fp8_dtype)
    config = parameters.finish(call, config)
    result = execution.forward(config, operands, seed=check_seed(call.seed), stream=call.stream,
                               autotune=call.autotune, check_values=call.check_values)
    return config, result, exporter


@parameters.front(parameters.NATIVE, "fp8_dtype", "stream", "autotune", "out_type", "check_values")
def attention(call: Any) -> AttentionOutput:
    """cuDNN scaled dot-product attention with named results (the native API).

    ``mask`` is a :class:`~cudnn_attn.core.masks.MaskSpec` built from ``causal()``, ``window(left, right)``,
    ``padding(q_lengths, kv_lengths)``, ``segments(...)``, ``alibi()``, ``keep(array)`` combined with ``&``;
    ``bias`` an additive bias broadcastable to ``(B, N, T, S)``; ``scale=None`` is ``1/sqrt(H)``; ``layout``
    ``"BTNH"`` or ``"BNTH"``; ``fp8_params`` (FP8Params) runs FP8 (uint8 Q/K/V bytes of ``fp8_dtype``).

    Returns :class:`~cudnn_attn.core.types.AttentionOutput`: ``output``, ``logsumexp`` with
    ``return_aux=AuxRequest(logsumexp=True)`` (else ``None``), ``amax_s``/``amax_o`` with FP8.  The
    extensions (``stream``, ``autotune``, ``out_type``, ``check_values``) are :func:`dot_product_attention`'s,
    and so is the direct path of repeated calls (CuPy Q/K/V and a mask without arrays).
    """
    qkv = (call.query, call.key, call.value)
    mask = call.mask
    plain = (call.bias is None and call.sink is None and call.fp8_params is None and call.stream is None
             and call.out_type is None and (mask is None or type(mask) is MaskSpec and not mask.has_arrays)
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
def dot_product_attention(call: Any) -> Any:
    """cuDNN scaled dot-product attention (forward).

    Shapes: Q ``(B, T, N, H)`` / K, V ``(B, S, K, H)`` in BTNH (``(B, N, T, H)`` in BNTH); ``bias`` and
    ``mask`` broadcast to ``(B, N, T, S)`` (``mask`` True keeps); ``q_seqlen``/``kv_seqlen`` int32
    ``(B,)``, or ``(B, M)`` with packed segments given by ``q_offsets``/``kv_offsets`` ``(B, M + 1)``.

    Returns the output (the query's layout, ``v``'s head dim), ``(output, logsumexp)`` with
    ``return_residual`` (logsumexp float32 ``(B, N, T)``, ``(B*M, N, T)`` packed), or
    ``(output, amax_s, amax_o)`` with ``use_fp8`` (FP8 output as uint8 bytes, see the module doc).
    """
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
            and call.stream is None and call.out_type is None)


@parameters.front(parameters.PAGED, "stream", "autotune", "out_type", "check_values")
def paged_attention(call: Any) -> Any:
    """cuDNN attention over paged K/V caches (forward only).

    K/V are caches of blocks ``(num_blocks, block_size, K, H)`` (BTNH) or ``(num_blocks, K, block_size, H)``
    (BNTH); ``page_table_k``/``page_table_v`` int32 ``(B, 1, blocks_per_seq, 1)`` map each sequence's
    logical blocks to cache blocks.  Returns the output, or ``(output, logsumexp)`` with ``return_residual``.
    """
    _, result, exporter = _forward(call)
    return _export(result.seed_form(call.use_fp8, call.return_residual), exporter)


@parameters.front(parameters.BACKWARD, "deterministic", "stream", "autotune", "fp8_dtype", "out_type", "check_values")
def dot_product_attention_bwd(call: Any) -> AttentionGrads:
    """Backward of :func:`dot_product_attention` called with the same arguments (and the same ``seed``).

    ``output`` and ``logsumexp`` are the forward's results (``return_residual=True``), ``grad_output``
    the gradient of the output.  Returns :class:`AttentionGrads` ``(dq, dk, dv, dbias, dsink, ...)``:
    ``dbias`` when the bias is differentiable (an explicit bias, or a non-boolean mask), reduced to the
    bias's own broadcast shape; ``dsink`` with a sink; with ``use_fp8`` the FP8 gradients (uint8 bytes,
    like ``output`` and ``grad_output``) and ``amax_dQ/dK/dV/dP``.  ``return_residual`` is accepted
    for signature parity and ignored.
    """
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
    arrays, static_arguments = parameters.arguments(call, backward=True)
    arrays = _gpu_arrays(call.stream, **arrays, output=call.output, grad_output=call.grad_output,
                         logsumexp=call.logsumexp)
    output, grad_output, logsumexp = (arrays.pop(n) for n in ("output", "grad_output", "logsumexp"))
    config, operands = _validate_on_device(arrays, static_arguments, call.fp8_dtype if call.use_fp8 else None)
    validate_backward(config, output, grad_output, logsumexp)      # FP8 O and dO: uint8 bytes like Q/K/V
    grads = execution.backward(config, operands, output, grad_output, logsumexp, seed=check_seed(call.seed),
                               stream=call.stream, autotune=call.autotune, check_values=call.check_values)
    if plain and not config.has_dbias and not config.sink:
        _remember_direct(BWD, residual_arrays, static, config, call.autotune,
                         ("query", "key", "value", "output", "grad_output", "logsumexp"))
    return _export(grads, exporter)


# -- pre-bound calls ----------------------------------------------------------------------------------

class BoundAttention:
    """A forward (and its backward) validated once for fixed Q/K/V shapes, dtypes, strides and static
    arguments; made by :func:`bind`.

    ``bound(q, k, v)`` returns what :func:`dot_product_attention` returns; ``bound.backward(q, k, v, o,
    do, lse)`` returns :class:`~cudnn_attn.core.types.AttentionGrads` (validated and built on its first call).
    Each call only checks that the arrays are CuPy arrays of the bound signature on the bound device (a
    mismatch is a ValueError: cuDNN would read out of bounds), then allocates the results and launches on
    the current CuPy stream.
    """

    _FWD_NAMES = ("query", "key", "value")
    _BWD_NAMES = _FWD_NAMES + ("output", "grad_output", "logsumexp")

    def __init__(self, query: Any, key: Any, value: Any, *, seed: int, static: dict, autotune: bool | None = None):
        self._static = dict(static)
        self._seed = check_seed(seed)
        self._autotune = autotune
        self._forward = self._make(FWD, (query, key, value))
        self._backward: _Direct | None = None
        self.config: AttentionConfig = self._forward.config

    def _make(self, kind: str, arrays: tuple) -> _Direct:
        static = dict(self._static)
        deterministic = static.pop("deterministic")
        return_residual = static.pop("return_residual")
        training = return_residual if kind == FWD else True
        config, operands = _validate_on_device(dict(zip(self._FWD_NAMES, arrays[:3])), dict(
            static, training=training, deterministic=deterministic and kind == BWD))
        if kind == BWD:
            validate_backward(config, *arrays[3:])
        if lifted_config(config) is not None:
            raise ValueError(f"bind: the {kind} of {config.describe()} runs lifted (padded, transposed to BTNH or its "
                             "diagonal folded into the bias: cudnn_attn.core.padded_call); "
                             "call dot_product_attention / dot_product_attention_bwd for it")
        return _Direct(config, kind, arrays, self._autotune, self._BWD_NAMES[:len(arrays)])

    def _check(self, direct: _Direct, arrays: tuple) -> None:
        """Raise a ValueError naming the first of ``arrays`` that is not a CuPy array of ``direct``'s signature."""
        try:
            if [(type(x), x.shape, x.dtype, x.strides, x.data.device_id) for x in arrays] == direct.typed:
                return
        except AttributeError:
            pass
        ndarray = _NDARRAY or _cupy_ndarray()
        for name, x, expected in zip(self._BWD_NAMES, arrays, direct.typed):
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
        results = forward(arrays, self._seed, out)
        return (results[0], results[1]) if forward.training else results[0]

    def backward(self, query: Any, key: Any, value: Any, output: Any, grad_output: Any,
                 logsumexp: Any) -> AttentionGrads:
        arrays = (query, key, value, output, grad_output, logsumexp)
        if self._backward is None:
            self._check(self._forward, arrays[:3])
            self._backward = self._make(BWD, arrays)
        self._check(self._backward, arrays)
        dq, dk, dv = self._backward(arrays, self._seed)
        return AttentionGrads(dq, dk, dv)


def bind(query: Any, key: Any, value: Any, *, scale: float = 1.0, mask_type: MaskType = MaskType.NO_MASK,
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
    static = dict(scale=scale, mask_type=mask_type, dropout_rate=dropout_rate, qkv_layout=qkv_layout,
                  sliding_window_length=sliding_window_length, return_residual=return_residual,
                  diagonal_alignment=diagonal_alignment, deterministic=deterministic)
    execution.plan_choice(autotune)                               # a bad value fails here, named
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
