"""cuDNN attention as torch custom operators: ``torch.ops.cudnn_attn.attention`` and its backward.

Both are ``torch.library.custom_op``s, so ``torch.autograd`` differentiates through them
(``register_autograd``: the backward is the second operator) and ``torch.compile(fullgraph=True)`` traces
them as opaque calls whose result shapes come from ``register_fake`` (nothing of the library runs while
torch traces).  An eager call runs their implementations without torch's dispatcher
(:mod:`cudnn_attn.torch.eager`, :func:`attention_unrecorded`).  An operator's arguments are tensors and plain
scalars:

``attention(query, key, value, q_lengths, kv_lengths, keep, scale, causal, bottom_right, window, dropout_rate,
seed, layout, training) -> (output, logsumexp)``

* ``query``/``key``/``value`` in ``layout`` (``"BTNH"`` or ``"BNTH"``), fp16 or bf16, key/value heads dividing
  the query heads (GQA); ``causal`` with ``bottom_right`` placing the diagonal at ``S - T``; ``window > 0``
  keeps keys ``(i - window, i]`` (causal); ``q_lengths``/``kv_lengths`` int32 ``(B,)`` (right padding; rows
  past them come back zero); ``keep`` a boolean mask broadcastable to ``(B, N, T, S)``, True keeps.
* ``output`` has the query's layout and the value's head dim; ``logsumexp`` is float32 ``(B, N, T)`` when
  ``training`` (the backward needs it), else an empty tensor.

CUDA tensors run on torch's current stream, and every byte a CUDA call uses comes from torch's caching allocator on
that stream - results, the workspace, a folded keep-mask, clamped lengths, temporaries - with no host
synchronisation and no host read of a device value.  So a CUDA graph torch captures (``torch.cuda.graph``,
``torch.compile(mode="reduce-overhead")``, transformers' static-cache ``generate()``) holds the whole call, and
the operators carry no ``cudagraph_unsafe`` tag.  A call runs one of two ways:

* a call of query/key/value alone, dense or views cuDNN reads with their strides (and, backward, the dense
  residuals; a bfloat16 inference forward with a boolean ``keep`` as well) is a *direct launch*: validated once per
  signature on stand-ins (:func:`config_of`), its :class:`~cudnn_attn.engine.prepared.PreparedCall` (the views'
  strides in its configuration) launched on the tensors' addresses into results from torch's caching allocator -
  no CuPy array, no DLPack;
* any other call (lengths, a keep-mask it cannot take, a view cuDNN cannot read) runs the CuPy front's generic path
  (:func:`cudnn_attn.fronts.cupy.run_forward` and ``run_backward``) on the tensors themselves, zero-copy, with
  torch's stream as CuPy's current stream and torch's allocator as CuPy's
  (:func:`cudnn_attn.engine.runtime.memory_from`), into results torch allocated.

Both kinds are remembered in one table, :data:`calls`, by :func:`call_key`.  The first call of a signature
validates, builds (or finds) its cuDNN graph and compiles the CuPy kernels it uses; none of that may happen while
a stream is being captured, so a first call met during capture raises :class:`CaptureWarmupError`: run the call
once before capturing, as torch's own CUDA graph recipes (and ``torch.compile``'s warm-up run) do.  A replayed
graph repeats the dropout mask of its capture when the seed is an int (a host scalar bound at capture); a device
seed (``seed_offset``, an int64 tensor ``[seed, offset]``) is read at every launch.

CPU tensors run the NumPy reference
(:mod:`cudnn_attn.reference`, float64 inside): the same validation and results, for tests and machines
without a GPU.  Both validate with :func:`cudnn_attn.core.validation.validate_call`, so errors are the
other fronts' (``ValueError`` naming the argument; ``UnsupportedConfigurationError`` from the support table).
The fake implementations validate the same way on stand-ins of the shapes (NumPy arrays of stride 0).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import cupy
import ml_dtypes
import numpy as np
import torch

from cudnn_attn.core.config import InputStrides
from cudnn_attn.core.parameters import renamed_arguments
from cudnn_attn.core.types import MaskType
from cudnn_attn.core import masked_rows
from cudnn_attn.core.validation import LARGE_NEGATIVE, check_seed, seed_operands, validate_backward, validate_call
from cudnn_attn.engine import runtime
from cudnn_attn.engine.call import BWD, FWD
from cudnn_attn.engine.prepared import PreparedCall, prepared_call
from cudnn_attn.engine.prepared import call_key as prepared_call_key
from cudnn_attn.engine.prepared import calls as prepared_calls
from cudnn_attn.fronts import cupy as cupy_front
from cudnn_attn.reference import dot_product_attention as reference_forward
from cudnn_attn.reference import dot_product_attention_bwd as reference_backward

__all__ = ["CaptureWarmupError", "attention_backward_op", "attention_op", "attention_unrecorded", "call_key", "calls"]

# What validation's messages call an argument, and what the operators call it.
NAMES = {"q_seqlen": "q_lengths", "kv_seqlen": "kv_lengths", "mask": "keep", "qkv_layout": "layout",
         "sliding_window_length": "window", "training (return_residual)": "training"}
_NUMPY_DTYPES = {torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
                 torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
                 torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64), torch.bool: np.dtype(np.bool_),
                 torch.uint8: np.dtype(np.uint8), torch.int8: np.dtype(np.int8), torch.int16: np.dtype(np.int16)}


# -- the library's arguments ---------------------------------------------------------------------------------

def _seed_arguments(q_lengths: Any, kv_lengths: Any, keep: Any, scale: float, causal: bool, bottom_right: bool,
                    window: int, dropout_rate: float, seed: int, layout: str) -> dict[str, Any]:
    """The keywords of the seed-form calls (``dot_product_attention`` and its backward) for these operator
    arguments (the arrays as given: torch tensors, CuPy-importable, or NumPy arrays)."""
    padded = q_lengths is not None or kv_lengths is not None
    causal = causal or window > 0
    mask_type = {(False, False): MaskType.NO_MASK, (True, False): MaskType.CAUSAL,
                 (False, True): MaskType.PADDING, (True, True): MaskType.PADDING_CAUSAL}[(causal, padded)]
    return dict(mask=keep, q_seqlen=q_lengths, kv_seqlen=kv_lengths, scale=scale, mask_type=mask_type,
                seed=seed, dropout_rate=dropout_rate, qkv_layout=layout,
                sliding_window_length=window if window > 0 else None,
                diagonal_alignment="bottom_right" if bottom_right and causal else "top_left")


def _stand_in(name: str, x: torch.Tensor | None) -> Any:
    """A NumPy array of ``x``'s dtype and shape that holds one element (stride 0): what validation reads of
    ``x`` without its values."""
    if x is None:
        return None
    dtype = _NUMPY_DTYPES.get(x.dtype)
    if dtype is None:
        raise ValueError(f"{name}: unsupported dtype {x.dtype} (shape {list(x.shape)}); query/key/value take "
                         f"float16 or bfloat16, lengths int32, keep bool")
    return np.broadcast_to(np.zeros((), dtype), tuple(x.shape))


def _validated(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_lengths: Any, kv_lengths: Any,
               keep: Any, scale: float, causal: bool, bottom_right: bool, window: int, dropout_rate: float,
               seed: int, layout: str, training: bool) -> Any:
    """The call's :class:`~cudnn_attn.core.config.AttentionConfig`, validated on stand-ins (``ValueError``s of
    :func:`~cudnn_attn.core.validation.validate_call`).  Validation folds a keep-mask into a bias: one host array
    of ``(B|1, N|1, T, S)`` elements of the io dtype, made and dropped here."""
    with renamed_arguments(NAMES):
        _check_seed(seed)
        return _validate_stand_ins(query, key, value, q_lengths, kv_lengths, keep, scale, causal, bottom_right,
                                   window, dropout_rate, seed, layout, training)


def _validate_stand_ins(query, key, value, q_lengths, kv_lengths, keep, scale, causal, bottom_right, window,
                        dropout_rate, seed, layout, training) -> Any:
    arguments = _seed_arguments(_stand_in("q_lengths", q_lengths), _stand_in("kv_lengths", kv_lengths),
                                _stand_in("keep", keep), scale, causal, bottom_right, window, dropout_rate, seed,
                                layout)
    arguments.pop("seed")
    config, _ = validate_call(_stand_in("query", query), _stand_in("key", key), _stand_in("value", value),
                              **arguments, training=training, xp=np)
    return config


def _check_seed(seed: Any, device: torch.device | None = None) -> Any:
    """A static int seed (:func:`~cudnn_attn.core.validation.check_seed`), or a device seed: an int64 tensor
    ``[seed, offset]`` that cuDNN reads at launch (:func:`~cudnn_attn.core.validation.seed_operands`'s rule), on
    ``device`` when given."""
    if isinstance(seed, torch.Tensor):
        seed_operands(_stand_in("seed", seed))
        if device is not None and seed.device != device:
            raise ValueError(f"seed: a device dropout seed must live on the query's device {device}, got a tensor "
                             f"on {seed.device}")
        return seed
    return check_seed(seed)


_validated_configs: dict[tuple, Any] = {}
"""The validation memo of :func:`config_of`: a call signature's configuration."""
_VALIDATED_MAX = 256


def config_of(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_lengths: Any, kv_lengths: Any,
              keep: Any, static: tuple, training: bool) -> Any:
    """:func:`_validated` once per call signature (shapes, dtypes, the static arguments but the seed, which is
    checked on every call): the configuration of a call, found before it touches the tensors."""
    _check_seed(static[5])
    signature = tuple(None if x is None else (tuple(x.shape), x.dtype) for x in
                      (query, key, value, q_lengths, kv_lengths, keep)) + static[:5] + (static[6], training)
    config = _validated_configs.get(signature)
    if config is None:
        config = _validated(query, key, value, q_lengths, kv_lengths, keep, *static, training)
        if len(_validated_configs) >= _VALIDATED_MAX:
            _validated_configs.clear()
        _validated_configs[signature] = config
    return config


# -- repeated calls ------------------------------------------------------------------------------------------

_TORCH_DTYPES = {np.dtype(np.float16): torch.float16, np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
                 np.dtype(np.float32): torch.float32}


class CaptureWarmupError(RuntimeError):
    """The first call of a signature met while torch captures a CUDA graph (module doc): run it once first."""


class _Direct(NamedTuple):
    """A call launched without CuPy or DLPack: its prepared call, the order of its operands in the plan, the
    ``(shape, torch dtype)`` of its results and its workspace bytes, which torch's caching allocator makes on
    torch's current stream (where the call runs).

    It never replays a CUDA graph of the engine's (:mod:`cudnn_attn.engine.replay`).  In transformers'
    ``generate()`` with the dynamic cache every decode step is a new plan whose address sets come back once per
    ``generate()``, so each second sighting captured a graph that was hardly replayed: 322 us of host time per
    decode call against 174 for the same calls whose addresses did not repeat (``benchmarks/bench_generate.py``,
    one H200).  A torch loop whose addresses do repeat has torch's own CUDA graphs, which hold this launch."""

    prepared: PreparedCall
    order: Callable[[Sequence[Any]], tuple]
    results: tuple
    workspace: int
    device: torch.device
    strided: bool                      # some of Q, K and V are views read with their strides (config.strides)
    transposed_results: tuple = ()     # (shape, strides, dtype) of each result as the other layout's view of it

    def takes(self, tensors: tuple) -> bool:
        """Whether this launch serves ``tensors`` of its signature: the views of a strided one must start 16-byte
        aligned, which a signature does not fix (:func:`cudnn_attn.engine.runtime.readable_strides`' rule; the
        general path copies the others, as the CuPy front does)."""
        return not self.strided or not any(x.data_ptr() & 15 for x in tensors[:3])

    def launch(self, tensors: tuple, seed: int, keep: torch.Tensor | None = None,
               transposed: bool = False) -> list[torch.Tensor]:
        """The results of one launch on ``tensors`` (read by address alone, so a transposed view of the running
        layout serves as its tensor).  ``transposed``: the results in the layout (the output, or dq, dk and dv) come
        back as the other layout's views of their dense memory, allocated so (:attr:`transposed_results`), not
        transposed afterwards."""
        call = self.prepared
        device = self.device
        if keep is not None:
            tensors = (*tensors, _folded(keep, call.config))
        if transposed:
            results = [torch.empty_strided(shape, strides, dtype=dtype, device=device)
                       for shape, strides, dtype in self.transposed_results]
        else:       # the sizes as separate arguments: torch parses them faster than one tuple (2.7 against 3.7 us)
            results = [torch.empty(*shape, dtype=dtype, device=device) for shape, dtype in self.results]
        pointers = [x.data_ptr() for x in self.order(tensors)]
        pointers += [r.data_ptr() for r in results]
        # The workspace tensor lives until the launch is enqueued: freed earlier, torch's allocator could hand its
        # memory to another thread's tensor on this stream before the launch that uses it.
        workspace = torch.empty(self.workspace, dtype=torch.uint8, device=device) if self.workspace else None
        index = call.device
        stream = _current_stream_of(index)
        seed = check_seed(seed) if call.dropout else seed
        address = 0 if workspace is None else workspace.data_ptr()
        if _current_device() == index:
            call.launch_into(pointers, stream, seed, replay=False, workspace=address)
        else:
            with runtime.on_device(index):
                call.launch_into(pointers, stream, seed, replay=False, workspace=address)
        del workspace
        return results

    def launcher(self, query: torch.Tensor, transposed: bool) -> Callable[..., Optional[torch.Tensor]] | None:
        """:meth:`launch` of an inference forward, one result, as one function with every lookup done once:
        ``launcher(query, key, value, keep)`` returns the output (``None``, launching nothing, where a view is not
        16-byte aligned or another device is current: :meth:`launch` then serves the call).  ``query`` is a
        sample of the caller's query (this launch's signature fixes its shape, strides and dtype): where
        ``torch.empty_like`` of it has the output's strides, the output is made so (0.46 us less than
        ``torch.empty`` of the shape, CPU host, ``timeit``).  ``None`` for a call with more than one result or with
        dropout (its seed is a per-call argument of :meth:`launch`)."""
        if len(self.results) != 1 or self.prepared.dropout:
            return None
        call, device, order, size, strided = self.prepared, self.device, self.order, self.workspace, self.strided
        config, index = call.config, call.device
        if transposed:
            shape, strides, dtype = self.transposed_results[0]
        else:
            (shape, dtype), strides = self.results[0], _transposed_view(self.results[0][0], False)[1]
        allocate = _allocation(query, tuple(shape), tuple(strides), dtype, device)
        # With one device visible it is the current one: its query (cudaGetDevice) is 0.3 us of a call.
        only_device = torch.cuda.device_count() == 1
        # The engine's launch sequence, asked of the call at each launch (it is made again after an eviction): about
        # 45 ns more per launch than a weak reference held here (CPU host, timeit), for one owner of that step.
        sequence = call.sequence

        def launcher(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     keep: torch.Tensor | None) -> Optional[torch.Tensor]:
            if strided and (query.data_ptr() & 15 or key.data_ptr() & 15 or value.data_ptr() & 15) \
                    or not (only_device or _current_device() == index):
                return None
            output = allocate(query)
            tensors = (query, key, value) if keep is None else (query, key, value, _folded(keep, config))
            pointers = [*map(_data_ptr, order(tensors)), output.data_ptr()]
            # The workspace tensor lives until the launch is enqueued (launch's comment).
            workspace = torch.empty(size, dtype=torch.uint8, device=device) if size else None
            sequence(False)(pointers, _current_stream_of(index), 0 if workspace is None else workspace.data_ptr(),
                            True, ())
            return output

        return launcher


_data_ptr = torch.Tensor.data_ptr


def _allocation(query: torch.Tensor, shape: tuple, strides: tuple, dtype: torch.dtype,
                device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """How :meth:`_Direct.launcher` makes a result of ``shape``, ``strides`` and ``dtype`` for a query like
    ``query``: ``torch.empty_like`` of the query where that has them, else ``torch.empty_strided``.  Decided on
    ``query`` itself (one allocation of its size, once), not a meta tensor of its layout: for a query dense in two
    layouts (one token), ``empty_like`` keeps its strides on a device and makes it contiguous on meta."""
    if query.dtype == dtype and tuple(query.shape) == shape:
        for memory_format in (torch.preserve_format, torch.contiguous_format):
            if torch.empty_like(query, memory_format=memory_format).stride() == strides:
                if memory_format is torch.preserve_format:
                    return torch.empty_like
                return lambda x: torch.empty_like(x, memory_format=torch.contiguous_format)
    return lambda x: torch.empty_strided(shape, strides, dtype=dtype, device=device)


class _General(NamedTuple):
    """A call the CuPy front's generic path runs (module doc), by its configuration."""

    config: Any


def _folded(keep: torch.Tensor, config: Any) -> torch.Tensor:
    """The bias cuDNN reads for a boolean ``keep`` mask, validation's fold (``validate_call``): 0 where kept,
    :data:`~cudnn_attn.core.validation.LARGE_NEGATIVE` elsewhere, in the io dtype, dense in the shape of
    ``config.bias`` (batch and heads as the mask broadcasts them).

    One kernel, ``large + (-large) * keep`` computed in float32 (exact: ``large`` is a power of two), whose
    ``large`` is a zero-dimensional CPU tensor of the io dtype: torch passes it to the kernel as an argument, so
    nothing is copied to the device and a CUDA graph holds the call, and being a tensor of the io dtype (not a
    Python number) it makes the result that dtype.  A cached device constant instead would stay in a CUDA graph
    tree's pool untracked, and ``torch.where`` copies zero-dimensional CPU operands to the device, which torch
    refuses during capture."""
    large = _LARGE_NEGATIVE[config.dtype]
    bias = torch.add(large, keep, alpha=-LARGE_NEGATIVE[config.dtype])
    shape = config.bias.shape
    if tuple(bias.shape) != shape or not bias.is_contiguous():     # the result follows a strided mask's layout
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)).expand(shape).contiguous()
    return bias


_LARGE_NEGATIVE = {name: torch.tensor(LARGE_NEGATIVE[name], dtype=dtype)
                   for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16))}
""":data:`~cudnn_attn.core.validation.LARGE_NEGATIVE` of each io dtype as a zero-dimensional CPU tensor
(:func:`_folded`'s kernel argument)."""


calls = prepared_calls
"""The calls seen on CUDA (:class:`_Direct` or :class:`_General` entries), by :func:`call_key`: the engine's one
table of repeated calls (:data:`cudnn_attn.engine.prepared.calls`), which the CuPy front shares."""

_FWD_NAMES = ("query", "key", "value")
_BWD_NAMES = _FWD_NAMES + ("output", "grad_output", "logsumexp")


def call_key(kind: str, tensors: tuple, static: tuple, training: bool) -> tuple:
    """The identity of a CUDA call (:func:`cudnn_attn.engine.prepared.call_key`): each tensor's descriptor
    (:func:`_descriptor`; ``None`` where absent), the static arguments but the seed (a new dropout seed per call
    launches the same plan; only whether it is a device tensor counts) and ``training``."""
    return prepared_call_key(kind, tensors, (static[:5], static[6], training, type(static[5]) is torch.Tensor),
                             _descriptor)


def _descriptor(x: torch.Tensor) -> tuple:
    """What a call's identity reads of a tensor: its type (the CuPy front's entries share the table), shape,
    strides, dtype and device."""
    return torch.Tensor, x.shape, x.stride(), x.dtype, x.get_device()


def _first_call(kind: str, tensors: tuple, static: tuple, training: bool) -> _Direct | _General:
    """How a call of a new signature runs (made before it first runs; remembered by the caller once it ran).
    ``tensors`` are the forward's ``(query, key, value, q_lengths, kv_lengths, keep)`` or the backward's residuals
    followed by ``(q_lengths, kv_lengths, keep)``.  Every ``ValueError`` of a CUDA call is raised here, in the
    operators' names: a repeated call, validated already, runs outside :func:`renamed_arguments`."""
    if torch.cuda.is_current_stream_capturing():
        raise CaptureWarmupError(
            f"cudnn_attn: the first call of a signature ({kind}, query {tuple(tensors[0].shape)} "
            f"{tensors[0].dtype}) was made while a CUDA graph is being captured; call it once before capturing "
            f"(a warm-up run) so that its cuDNN graph is built and its kernels are loaded")
    dense = tensors[:3] if kind == FWD else tensors[:6]
    q_lengths, kv_lengths, keep = tensors[-3:]
    config = config_of(*tensors[:3], q_lengths, kv_lengths, keep, static, training)
    if kind == BWD:
        with renamed_arguments(NAMES):
            validate_backward(config, *(_stand_in(name, x) for name, x in zip(_BWD_NAMES[3:], tensors[3:6])))
    device_seed = static[5] if type(static[5]) is torch.Tensor and static[4] > 0 else None
    strided = {name: x for name, x in zip(_FWD_NAMES, dense) if not x.is_contiguous()}
    if q_lengths is not None or kv_lengths is not None or not all(x.is_contiguous() for x in dense[3:]) \
            or not all(_readable(x) for x in strided.values()) \
            or device_seed is not None or len({x.get_device() for x in (*tensors, device_seed) if x is not None}) > 1:
        return _General(config)                # the general path copies, or names the tensor on another device
    if strided:                                # Q, K or V views cuDNN reads with their own strides
        config = config.replace(strides=InputStrides(**{name: runtime.normalized_strides(x.shape, x.stride())
                                                        for name, x in strided.items()}))
    if keep is not None and (kind != FWD or keep.dtype != torch.bool or not masked_rows.kernel_gives_the_mean(config)):
        return _General(config)
    if kind == BWD and (config.has_dbias or config.sink):
        return _General(config)
    call = prepared_call(config, kind, tensors[0].get_device())
    if not call.direct_capable:
        return _General(config)
    names = _FWD_NAMES + (("bias",) if keep is not None else ()) if kind == FWD else _BWD_NAMES
    results = tuple((shape, _TORCH_DTYPES[dtype]) for shape, dtype in call.result_layout())
    in_layout = 1 if kind == FWD else 3                  # the output, or dq, dk and dv; not the logsumexp
    return _Direct(call, call.direct_order(names), results, call.workspace_size, tensors[0].device, bool(strided),
                   tuple((*_transposed_view(shape, i < in_layout), dtype) for i, (shape, dtype) in enumerate(results)))


def _transposed_view(shape: tuple, transposed: bool) -> tuple[tuple, tuple]:
    """``(shape, strides)`` of a dense tensor of ``shape`` (torch's strides for it), viewed with dimensions 1 and 2
    swapped when ``transposed``."""
    view = torch.empty(shape, device="meta")
    if transposed:
        view = view.transpose(1, 2)
    return tuple(view.shape), view.stride()


def _readable(x: torch.Tensor) -> bool:
    """Whether cuDNN reads the Q, K or V tensor ``x`` with its strides (every front's rule,
    :func:`cudnn_attn.engine.runtime.readable_layout`; the data's alignment is checked per call:
    :meth:`_Direct.takes`)."""
    itemsize = x.element_size()
    return runtime.readable_layout(x.shape, [s * itemsize for s in x.stride()], itemsize)


def _run(kind: str, tensors: tuple, static: tuple, training: bool) -> list[torch.Tensor]:
    """A CUDA call: the results in the plan's order (forward: output, then the logsumexp when ``training``;
    backward: dq, dk, dv)."""
    if type(static[5]) is torch.Tensor:                 # its values are read at launch: checked on every call
        with renamed_arguments(NAMES):
            _check_seed(static[5], tensors[0].device)
    key = call_key(kind, tensors, static, training)
    known = calls.get(key)
    first = known is None
    if first:
        known = _first_call(kind, tensors, static, training)
    if type(known) is _Direct and known.takes(tensors):
        results = known.launch(tensors[:3] if kind == FWD else tensors[:6], static[5],
                               tensors[5] if kind == FWD else None)
    else:
        results = _general(kind, known.prepared.config if type(known) is _Direct else known.config, tensors, static,
                           training)
    if first:
        calls.remember(key, known)
    return results


def _general(kind: str, config: Any, tensors: tuple, static: tuple, training: bool) -> list[torch.Tensor]:
    """The CuPy front's generic path on torch's stream and torch's memory (module doc), into torch's results."""
    query = tensors[0]
    device = query.device
    if kind == FWD:
        results = [torch.empty(config.o_shape, dtype=query.dtype, device=device)]
        if training:
            results.append(torch.empty(config.lse_shape, dtype=torch.float32, device=device))
    else:
        results = [torch.empty(x.shape, dtype=x.dtype, device=device) for x in tensors[:3]]
    arrays = _detached(*tensors)
    q_lengths, kv_lengths, keep = arrays[-3:]
    with runtime.memory_from(_torch_memory(device), device.index), _on_torch_stream(query):
        seed = static[5]
        if isinstance(seed, torch.Tensor):
            seed = _cupy_view(seed.contiguous()) if static[4] > 0 else 0
        arguments = _seed_arguments(q_lengths, kv_lengths, _cupy_keep(keep), *static[:5], seed, static[6])
        views = [_cupy_view(x) for x in results]
        if kind == FWD:
            call = cupy_front.dot_product_attention.arguments(*arrays[:3], **arguments, return_residual=training,
                                                              stream=_stream(query))
            cupy_front.run_forward(call, output=views[0], logsumexp=views[1] if training else None)
        else:
            call = cupy_front.dot_product_attention_bwd.arguments(*arrays[:6], **arguments, stream=_stream(query))
            cupy_front.run_backward(call, dq=views[0], dk=views[1], dv=views[2])
    return results


def _torch_memory(device: torch.device) -> Callable[[int], tuple[int, torch.Tensor]]:
    """``nbytes -> (address, owner)`` from torch's caching allocator on torch's current stream of ``device``
    (:func:`cudnn_attn.engine.runtime.memory_from`)."""
    def allocate(nbytes: int) -> tuple[int, torch.Tensor]:
        owner = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return owner.data_ptr(), owner
    return allocate


_CUPY_DTYPES = {torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
                torch.float32: np.dtype(np.float32), torch.int64: np.dtype(np.int64)}


def _cupy_view(x: torch.Tensor) -> Any:
    """A dense CUDA tensor as a CuPy array over its memory (it keeps ``x`` alive), without DLPack."""
    memory = cupy.cuda.UnownedMemory(x.data_ptr(), x.numel() * x.element_size(), x, x.get_device())
    return cupy.ndarray(tuple(x.shape), _CUPY_DTYPES[x.dtype], cupy.cuda.MemoryPointer(memory, 0))


# -- NumPy views of CPU tensors -----------------------------------------------------------------------------

def _to_numpy(x: torch.Tensor | None) -> Any:
    if x is None:
        return None
    x = x.detach().contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def _from_numpy(x: np.ndarray) -> torch.Tensor:
    x = np.ascontiguousarray(x)
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def _public_current_stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_stream_of: Callable[[int], int] = \
    (lambda index: _public_current_stream(torch.device("cuda", index))) if _raw_stream is None else _raw_stream
"""torch's current ``cudaStream_t`` of the CUDA device of this index: ``torch._C._cuda_getCurrentRawStream``
(private), which makes no ``torch.cuda.Stream`` object: 4.3 us of a 40.8 us decode call's host time less
(``benchmarks/bench_torch_host.py``, cProfile, H200 host); the public ``torch.cuda.current_stream`` where torch lacks
it."""

_current_device: Callable[[], int] = cupy.cuda.runtime.getDevice
"""The current CUDA device (CUDA's runtime, which torch and CuPy share): a direct launch runs on its call's device."""


def _stream(x: torch.Tensor) -> int:
    return _current_stream_of(x.get_device())


def _on_torch_stream(x: torch.Tensor) -> Any:
    """torch's current stream of ``x``'s device as CuPy's current stream: what the CuPy front does besides the
    launch (importing, folding the keep-mask, clamping lengths) is ordered there too."""
    return runtime.device_context(x.device.index).stream(_stream(x))


def _cupy_keep(keep: Any) -> Any:
    """A boolean CUDA tensor as a CuPy bool array over the same memory (through its uint8 view: DLPack's bool
    type is recent, its uint8 older than both libraries)."""
    if keep is None or keep.dtype != torch.bool:
        return keep
    return cupy.from_dlpack(keep.contiguous().view(torch.uint8)).view(cupy.bool_)


def _empty_lse(query: torch.Tensor) -> torch.Tensor:
    return query.new_empty((0,), dtype=torch.float32)


def _shared_empty_lse(query: torch.Tensor) -> torch.Tensor:
    """One empty float32 tensor per device, for the calls outside torch's dispatcher (an operator returns new
    tensors): 3.3 us of a decode call's host time less (``benchmarks/bench_torch_host.py``, cProfile)."""
    empty = _empty_lses.get(query.device)
    if empty is None:
        empty = _empty_lses.setdefault(query.device, _empty_lse(query))
    return empty


_empty_lses: dict[torch.device, torch.Tensor] = {}


# -- the forward operator -----------------------------------------------------------------------------------

# torch infers the operators' schemas from these annotations (Optional[torch.Tensor] -> "Tensor?").
@torch.library.custom_op("cudnn_attn::attention", mutates_args=())
def attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_lengths: Optional[torch.Tensor],
                 kv_lengths: Optional[torch.Tensor], keep: Optional[torch.Tensor], scale: float, causal: bool,
                 bottom_right: bool, window: int, dropout_rate: float, seed: int, layout: str,
                 training: bool, seed_offset: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN attention (module doc): ``(output, logsumexp)``, the logsumexp empty unless ``training``.
    ``seed_offset``: a device dropout seed, an int64 tensor ``[seed, offset]`` that cuDNN reads at launch (``seed``
    is then unused), so that new values - drawn on the device, inside a CUDA graph too - draw a new mask."""
    return _forward(query, key, value, q_lengths, kv_lengths, keep,
                    (scale, causal, bottom_right, window, dropout_rate, _seed(seed, seed_offset), layout), training)


def attention_unrecorded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_lengths: Any,
                         kv_lengths: Any, keep: Any, scale: float, causal: bool, bottom_right: bool, window: int,
                         dropout_rate: float, seed: int, layout: str, training: bool,
                         seed_offset: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_op`'s implementation, for a call that nothing of torch would record
    (:func:`cudnn_attn.torch.api.unrecorded`): the same call without torch's dispatcher, which costs a custom
    operator's call 49-61 us of host time (H200 machines' hosts, a decode step of ``benchmarks/decode_growing.py``:
    104.7-118.6 us per call through the operator, 55.4-57.4 for this function)."""
    return _forward(query, key, value, q_lengths, kv_lengths, keep,
                    (scale, causal, bottom_right, window, dropout_rate, _seed(seed, seed_offset), layout), training,
                    _shared_empty_lse)


def _seed(seed: int, seed_offset: torch.Tensor | None) -> Any:
    """The seed a call runs with: the device tensor when given, else the int (the static tuple's slot 5)."""
    return seed if seed_offset is None else seed_offset


def _detached(*tensors: Any) -> tuple:
    """The tensors without their autograd history (DLPack exports no tensor that requires grad; the operators'
    gradients are :func:`register_autograd`'s, so the kernels never need it)."""
    return tuple(None if x is None else x.detach() for x in tensors)


def _forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_lengths: Any, kv_lengths: Any, keep: Any,
             static: tuple, training: bool,
             empty_lse: Callable[[torch.Tensor], torch.Tensor] = _empty_lse) -> tuple[torch.Tensor, torch.Tensor]:
    if query.is_cuda:
        result = _run(FWD, (query, key, value, q_lengths, kv_lengths, keep), static, training)
        return (result[0], result[1]) if training else (result[0], empty_lse(query))
    if query.device.type != "cpu":
        raise ValueError(f"query: the torch front runs on CUDA (cuDNN) and CPU (the NumPy reference) tensors, "
                         f"got a tensor on {query.device}")
    arguments = _seed_arguments(_to_numpy(q_lengths), _to_numpy(kv_lengths), _to_numpy(keep), *_numpy_seed(static))
    with renamed_arguments(NAMES):
        result = reference_forward(_to_numpy(query), _to_numpy(key), _to_numpy(value), **arguments,
                                   return_residual=training)
    if training:
        return _from_numpy(result[0]), _from_numpy(result[1])
    return _from_numpy(result), _empty_lse(query)


def _numpy_seed(static: tuple) -> tuple:
    """``static`` with a device seed tensor as a NumPy array (the reference's form of it)."""
    seed = static[5]
    return static if not isinstance(seed, torch.Tensor) else static[:5] + (_to_numpy(seed), static[6])


@attention_op.register_fake
def _attention_fake(query, key, value, q_lengths, kv_lengths, keep, scale, causal, bottom_right, window,
                    dropout_rate, seed, layout, training, seed_offset=None):
    if _symbolic(query, key, value, q_lengths, kv_lengths, keep):
        o_shape, lse_shape = _shapes(query, value, layout)
    else:
        config = _validated(query, key, value, q_lengths, kv_lengths, keep, scale, causal, bottom_right, window,
                            dropout_rate, _seed(seed, seed_offset), layout, training)
        o_shape, lse_shape = config.o_shape, config.lse_shape
    output = query.new_empty(o_shape)
    return output, (query.new_empty(lse_shape, dtype=torch.float32) if training else _empty_lse(query))


def _symbolic(*tensors: Any) -> bool:
    """Some dimension is symbolic (``torch.compile`` with dynamic shapes): validation needs concrete sizes, so
    the fake implementation then only computes the result shapes and the call validates when it runs."""
    return any(not isinstance(d, int) for x in tensors if x is not None for d in x.shape)


def _shapes(query: torch.Tensor, value: torch.Tensor, layout: str) -> tuple[tuple, tuple]:
    """The output's and the logsumexp's shapes (:class:`~cudnn_attn.core.config.AttentionConfig`'s rule)."""
    heads, length = (1, 2) if layout == "BNTH" else (2, 1)
    return (*query.shape[:3], value.shape[3]), (query.shape[0], query.shape[heads], query.shape[length])


# -- the backward operator ----------------------------------------------------------------------------------

@torch.library.custom_op("cudnn_attn::attention_backward", mutates_args=())
def attention_backward_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
                          grad_output: torch.Tensor, logsumexp: torch.Tensor, q_lengths: Optional[torch.Tensor],
                          kv_lengths: Optional[torch.Tensor], keep: Optional[torch.Tensor], scale: float,
                          causal: bool, bottom_right: bool, window: int, dropout_rate: float, seed: int,
                          layout: str, seed_offset: Optional[torch.Tensor] = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients ``(dq, dk, dv)`` of :func:`attention_op` (called with the same arguments and ``training``;
    ``seed_offset`` holding the forward's values) given its ``output``, ``logsumexp`` and the output's gradient."""
    return _backward_implementation(query, key, value, output, grad_output, logsumexp, q_lengths, kv_lengths, keep,
                                    scale, causal, bottom_right, window, dropout_rate, seed, layout, seed_offset)


def _backward_implementation(query, key, value, output, grad_output, logsumexp, q_lengths, kv_lengths, keep, scale,
                             causal, bottom_right, window, dropout_rate, seed, layout, seed_offset=None):
    """:func:`attention_backward_op`'s implementation (its arguments), which
    :class:`~cudnn_attn.torch.eager.AttentionFunction`'s backward calls without the dispatcher."""
    with renamed_arguments(NAMES):
        return _backward_grads(query, key, value, output, grad_output.contiguous(), logsumexp, q_lengths, kv_lengths,
                               keep, (scale, causal, bottom_right, window, dropout_rate, _seed(seed, seed_offset),
                                      layout))


def _backward_grads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
                    grad_output: torch.Tensor, logsumexp: torch.Tensor, q_lengths: Any, kv_lengths: Any, keep: Any,
                    static: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if query.is_cuda:         # the general path detaches the tensors (``_general``); a direct launch reads addresses
        grads = _run(BWD, (query, key, value, output, grad_output, logsumexp, q_lengths, kv_lengths, keep), static,
                     True)
        return grads[0], grads[1], grads[2]
    arguments = _seed_arguments(_to_numpy(q_lengths), _to_numpy(kv_lengths), _to_numpy(keep), *_numpy_seed(static))
    grads = reference_backward(*(_to_numpy(x) for x in (query, key, value, output, grad_output,
                                                                          logsumexp)), **arguments)
    return _from_numpy(grads.dq), _from_numpy(grads.dk), _from_numpy(grads.dv)


@attention_backward_op.register_fake
def _attention_backward_fake(query, key, value, output, grad_output, logsumexp, q_lengths, kv_lengths, keep, scale,
                             causal, bottom_right, window, dropout_rate, seed, layout, seed_offset=None):
    if not _symbolic(query, key, value, output, grad_output, logsumexp, q_lengths, kv_lengths, keep):
        config = _validated(query, key, value, q_lengths, kv_lengths, keep, scale, causal, bottom_right, window,
                            dropout_rate, _seed(seed, seed_offset), layout, True)
        with renamed_arguments(NAMES):
            validate_backward(config, _stand_in("output", output), _stand_in("grad_output", grad_output),
                              _stand_in("logsumexp", logsumexp))
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


# -- autograd -----------------------------------------------------------------------------------------------

def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    query, key, value, q_lengths, kv_lengths, keep, scale, causal, bottom_right, window, dropout_rate, seed, \
        layout, training, seed_offset = inputs
    out, logsumexp = output
    ctx.save_for_backward(query, key, value, out, logsumexp, q_lengths, kv_lengths, keep, seed_offset)
    ctx.static = (scale, causal, bottom_right, window, dropout_rate, seed, layout)
    ctx.training = training
    ctx.mark_non_differentiable(logsumexp)
    ctx.set_materialize_grads(False)          # no zero-filled gradient of the logsumexp, a kernel per call


def _backward(ctx: Any, grad_output: torch.Tensor, grad_logsumexp: Any,
              backward: Callable[..., tuple] | None = None) -> tuple:
    """The forward's 15 gradients: ``(dq, dk, dv)`` from ``backward`` (the backward operator's arguments; default
    the backward operator), ``None`` for the other inputs."""
    _check_trained(ctx.training)
    if grad_output is None:                   # the output was not used
        return (None,) * 15
    query, key, value, out, logsumexp, q_lengths, kv_lengths, keep, seed_offset = ctx.saved_tensors
    dq, dk, dv = (backward or attention_backward_op)(query, key, value, out, grad_output, logsumexp, q_lengths,
                                                     kv_lengths, keep, *ctx.static, seed_offset)
    return (dq, dk, dv) + (None,) * 12


def _check_trained(training: bool) -> None:
    """A backward of a forward that kept no logsumexp is refused."""
    if not training:
        raise RuntimeError("cudnn_attn::attention: the forward ran with training=False (no logsumexp kept); "
                           "call it with training=True to differentiate it (cudnn_attn.torch.attention decides "
                           "from torch.is_grad_enabled() and requires_grad)")


attention_op.register_autograd(_backward, setup_context=_setup_context)
