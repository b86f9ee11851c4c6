"""The torch front's calls: the native :func:`attention` (masks as :class:`~cudnn_attn.core.masks.MaskSpec`,
named results) and :func:`sdpa`, the same call with the mask as plain arguments (what
:mod:`cudnn_attn.torch.transformers_attention` uses).

Both choose the layout the operator runs in from the tensors' strides: a tensor that is a transposed view of
the other layout (transformers' ``(batch, heads, seq, dim)`` query is ``q_proj(x).view(B, T, N, H).transpose(1,
2)``, dense in BTNH) runs in that layout without a copy, and the output comes back as a view in the layout
asked for.  The query decides where it is dense in one layout alone (the output and the query's gradient come back
dense in its layout, which the caller's next operation reads: transformers' training step passes a BTNH query with
the BNTH key and value its cache concatenated, and runs in BTNH); otherwise key and value decide (in decoding they
are the large cache and the one query is dense in both).  A tensor not dense in the running layout reaches cuDNN
with its own strides where cuDNN reads them (:func:`cudnn_attn.engine.runtime.readable_layout`) and is copied
otherwise.  Differentiable with ``torch.autograd``; ``torch.compile(fullgraph=True)`` traces both (the operators
are opaque to it: :mod:`cudnn_attn.torch.ops`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch.utils import _python_dispatch

from cudnn_attn.core.config import DROPOUT_RULE, SCALE_RULE, DiagonalAlignment
from cudnn_attn.core.masks import as_mask
from cudnn_attn.core.errors import UnsupportedConfigurationError
from cudnn_attn.core.parameters import renamed_arguments, wants_logsumexp, wants_max_logit
from cudnn_attn.core.types import AttentionLayout, AttentionOutput
from cudnn_attn.core.validation import check_seed, checked, default_scale, flag, window_length

from cudnn_attn.engine.call import FWD

from .eager import AttentionFunction, DirectLaunches, apply_function as _apply_function
from .ops import (NAMES, _Direct, _readable, _shared_empty_lse, attention_op, attention_unrecorded, call_key, calls,
                  config_of)
from .transforms import TransformedAttention

__all__ = ["attention", "dispatch_free", "sdpa", "unrecorded"]

_OTHER = {"BTNH": "BNTH", "BNTH": "BTNH"}


def _layout_name(layout: Any) -> str:
    """``layout`` as ``"BTNH"`` or ``"BNTH"``: :meth:`AttentionLayout.parse`'s rule, in plain string operations
    (``torch.compile`` cannot trace an enum's ``__members__``)."""
    name = layout.upper().replace("S", "T") if isinstance(layout, str) else None
    if name not in _OTHER:
        with renamed_arguments(NAMES):
            AttentionLayout.parse(layout)        # raises its ValueError
    return name


def _dense_in(x: torch.Tensor, transposed: bool) -> bool:
    return (x.transpose(1, 2) if transposed else x).is_contiguous()


def _running_layout(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the call runs in the other layout (module doc): all three dense only there; else the query's layout
    where it is dense in one layout alone (the output and its gradient come back dense in it, where the caller's next
    operation reads them), else key and value dense only there."""
    if all(_dense_in(x, False) for x in (query, key, value)):
        return False
    if all(_dense_in(x, True) for x in (query, key, value)):
        return True
    here, there = _dense_in(query, False), _dense_in(query, True)
    if here != there:
        return there
    return not (_dense_in(key, False) and _dense_in(value, False)) and _dense_in(key, True) and _dense_in(value, True)


def _check_tensors(**tensors: Any) -> None:
    for name, x in tensors.items():
        required = name in ("query", "key", "value")
        if (required or x is not None) and not isinstance(x, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor{'' if required else ' or None'}, "
                             f"got {type(x).__name__}")
    for name in ("query", "key", "value"):
        if tensors[name].dim() != 4:
            raise ValueError(f"{name}: must be 4-D (BTNH or BNTH), got shape {list(tensors[name].shape)}")


def dispatch_free(*tensors: Any) -> bool:
    """Whether nothing of torch but autograd would see a forward call of ``tensors`` through its operator:
    ``torch.compile`` and ``torch.jit.trace`` are not tracing, no ``TorchDispatchMode`` (``make_fx``,
    ``FlopCounterMode``, fake tensors) or ``torch.func`` transform is active, and every tensor is a plain
    ``torch.Tensor``, the first on CUDA or the CPU (a meta tensor's call is the operator's fake implementation).
    Such a call skips torch's dispatcher: autograd records :class:`~cudnn_attn.torch.eager.AttentionFunction` (the
    operator's forward and gradient), and a call autograd would not record (:func:`unrecorded`) runs the
    implementation alone."""
    return not torch.compiler.is_compiling() and _plain(tensors) and _untraced()


def _plain(tensors: tuple) -> bool:
    """Every tensor a plain ``torch.Tensor`` (no subclass), the first on CUDA or the CPU: what :func:`dispatch_free`
    reads of the tensors, which a call signature fixes."""
    return all(type(x) is torch.Tensor for x in tensors if x is not None) and (tensors[0].is_cuda or tensors[0].is_cpu)


def unrecorded(*tensors: Any) -> bool:
    """Whether nothing of torch would see a forward call of ``tensors`` through its operator: :func:`dispatch_free`,
    and autograd records nothing (grad off, or no input requiring it).  Such a call runs the operator's
    implementation directly (:func:`~cudnn_attn.torch.ops.attention_unrecorded`, which says what that saves)."""
    return not _records(tensors) and dispatch_free(*tensors)


def _records(tensors: tuple) -> bool:
    """Whether autograd records a call of ``tensors``: grad enabled and one of them requiring it."""
    return torch.is_grad_enabled() and any(x.requires_grad for x in tensors if x is not None)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool = False,
         bottom_right: bool = False, window: int = 0, q_lengths: torch.Tensor | None = None,
         kv_lengths: torch.Tensor | None = None, keep: torch.Tensor | None = None, scale: float | None = None,
         dropout_rate: float = 0.0, seed: int = 42, layout: str = "BTNH",
         training: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, logsumexp)`` of cuDNN attention (the operator's arguments, :mod:`cudnn_attn.torch.ops`), the
    output in ``layout``.  ``scale=None`` is ``1/sqrt(H)``; ``training=None`` keeps the logsumexp exactly when
    autograd will need it (grad enabled and an input requiring grad); otherwise the logsumexp is empty.  ``seed``:
    an int, or an int64 tensor ``[seed, offset]`` on the query's device (a device seed: :func:`attention`).

    What a call decides - its checked static arguments, the layout it runs in, and for a forward that nothing of
    torch records its direct launch - is remembered by the call's signature (:func:`_signature`), so a repeated
    eager call checks only its seed and the state of torch that no signature holds (dispatch modes, transforms).
    A repeated inference forward with a direct launch, and a repeated call that autograd records, are found before
    their signature is made: by a key of the scalar arguments and the key's shape, then by the guard of their
    tensors (:class:`_Fast`)."""
    if type(key) is _Tensor and q_lengths is None and kv_lengths is None and type(seed) is int \
            and not _is_compiling():
        # What a known call is found by, with the guard of its tensors (:class:`_Fast`).
        fast_key = (key.shape, keep is None, scale, causal, bottom_right, window, dropout_rate, layout, training,
                    type(scale), type(causal), type(bottom_right), type(window), type(dropout_rate), type(layout),
                    type(training), _grad_enabled())
        try:
            fast = _fast.get(fast_key)
        except TypeError:                 # an unhashable argument: the slow path decides (and raises)
            fast = fast_key = None
        if fast is not None and 0 <= seed < _SEED_END and _untraced() \
                and (fast.matches(query, key, value) if keep is None else fast.matches(query, key, value, keep)):
            if fast.recorded is not None:
                # A repeated call that autograd records: its node (the signature's decision), by torch's C entry.
                return _apply_function(query, key, value, None, None, keep, seed, None, fast.recorded)
            output = fast.launch(query, key, value, keep)
            if output is not None:
                return output, fast.empty_lse
    else:
        fast_key = None
    tensors = (query, key, value, q_lengths, kv_lengths, keep)
    signature = _signature(tensors, scale, causal, bottom_right, window, dropout_rate, layout, training)
    decision = _decided(signature)
    if decision is not None and type(seed) is int and 0 <= seed < _SEED_END and _untraced():
        direct = decision.direct
        if direct is not None and direct.takes(tensors):
            # A repeated inference forward of tensors the operator reads as given (dense in the running layout, or
            # views cuDNN reads with their strides): the direct launch reads their addresses (a transposed view's
            # is its tensor's) and allocates the output in the caller's layout, so nothing of the slow path below
            # runs.
            if fast_key is not None and decision.fast is not None:
                _remember_fast(fast_key, decision.fast)
            return direct.launch((query, key, value), 0, keep, decision.transposed)[0], decision.empty_lse
        if decision.autograd:
            # A repeated call that autograd records and nothing else of torch sees (its signature fixes both).
            if fast_key is not None and decision.fast is not None:
                _remember_fast(fast_key, decision.fast)
            return AttentionFunction.apply(query, key, value, q_lengths, kv_lengths, keep, seed, None, decision)
    new = decision is None
    if new:
        decision = _decide(tensors, scale, causal, bottom_right, window, dropout_rate, seed, layout, training)
    seed_offset = seed if isinstance(seed, torch.Tensor) else None       # a device seed (the operators' doc)
    seed = 0 if seed_offset is not None else check_seed(seed)
    recorded, free = _records((query, key, value)), dispatch_free(*tensors)
    if recorded and free:
        # Eager autograd: one AttentionFunction node, which makes the running layout's views itself.
        output, logsumexp = AttentionFunction.apply(query, key, value, q_lengths, kv_lengths, keep, seed, seed_offset,
                                                    decision)
        if new and signature is not None:
            if fast_key is not None and decision.autograd:
                matches = _tensor_guard((query, key, value) if keep is None else (query, key, value, keep),
                                        public=False)
                if matches is not None:
                    decision = decision._replace(fast=_Fast(matches, None, None, decision))
                    _remember_fast(fast_key, decision.fast)
            _remember(signature, decision)
        return output, logsumexp
    static = decision.static + (seed,)
    q, k, v = (x.transpose(1, 2) if decision.transposed else x for x in (query, key, value))
    if not decision.as_given:
        q, k, v = (x.contiguous() if copy else x for x, copy in zip((q, k, v), decision.copies))
    # A recorded call without the dispatcher returned above: a dispatch-free one here is one autograd does not record.
    operator = attention_unrecorded if free else attention_op
    if not free and _transforms_active() and not _is_compiling() and not _in_dispatch_mode():
        # A torch.func transform refuses the operator's own autograd (cudnn_attn.torch.transforms says why); a
        # dispatch mode (FlopCounterMode, make_fx) must still see the operator.
        operator = TransformedAttention.apply
    output, logsumexp = operator(q, k, v, q_lengths, kv_lengths, keep, *static, decision.running,
                                 decision.training, seed_offset)
    if signature is not None:
        if free and not decision.training and q.is_cuda and decision.as_given \
                and decision.direct is None:
            known = calls.get(call_key(FWD, (q, k, v, q_lengths, kv_lengths, keep), static + (decision.running,),
                                       decision.training))
            if type(known) is _Direct and not known.prepared.dropout:
                empty_lse = _shared_empty_lse(q)
                launcher = known.launcher(query, decision.transposed)
                fast = None if launcher is None else _Fast(_tensor_guard((query, key, value) if keep is None else
                                                                         (query, key, value, keep)),
                                                           launcher, empty_lse)
                decision, new = decision._replace(direct=known, empty_lse=empty_lse, fast=fast), True
                if fast_key is not None and fast is not None:
                    _remember_fast(fast_key, fast)
        if new:
            _remember(signature, decision)
    return (output.transpose(1, 2) if decision.transposed else output), logsumexp


_SEED_END = 2 ** 63
"""The end of a static seed's range (:func:`~cudnn_attn.core.validation.check_seed`'s rule, which a seed outside
the fast path of :func:`sdpa` meets)."""


class _Decision(NamedTuple):
    """What :func:`sdpa` decided for a call signature: the checked static arguments but the seed, the layout the
    operator runs in, whether the tensors are transposed views of it, which of them are copied (not dense in the
    running layout, and strided in a way cuDNN cannot read), ``training``, for an unrecorded inference forward
    of tensors read as given its direct launch (:class:`~cudnn_attn.torch.ops._Direct`; ``None`` until one ran, or
    for other calls) with the empty logsumexp it returns, the direct launches of an eager call autograd records
    (an :class:`~cudnn_attn.torch.eager.EagerCall`: what :class:`~cudnn_attn.torch.eager.AttentionFunction` reads),
    and whether autograd records a call of the signature whose tensors are plain CUDA or CPU tensors (what
    :func:`dispatch_free` and :func:`_records` read but :func:`_untraced`'s state)."""

    static: tuple
    running: str
    transposed: bool
    copies: tuple
    training: bool
    direct: Any = None
    empty_lse: Any = None
    launches: Any = None               # a DirectLaunches, made once per signature
    autograd: bool = False             # autograd records the call, of plain CUDA or CPU tensors (dispatch_free
                                       # but for the state no signature holds: _untraced)
    fast: Any = None                   # the _Fast entry: the direct launch's, or a recorded call's (None: neither)

    @property
    def as_given(self) -> bool:
        """No tensor is copied: the operator reads all three as the caller gave them."""
        return not any(self.copies)



_decisions: dict[tuple, _Decision] = {}
_DECISIONS_MAX = 1024


class _Fast(NamedTuple):
    """A known call as :func:`sdpa` finds it before any signature: by the key's shape, which optional tensors are
    given, the scalar arguments, their types and whether grad is enabled (the fast key, one tuple made in
    :func:`sdpa`), and then by ``matches``, the guard of the query's, key's, value's (and keep-mask's) type, shape,
    strides, dtype, device and ``requires_grad`` (:func:`_tensor_guard`).  Together they fix everything the call's
    signature does (:func:`_signature`), so a match is a call of a remembered decision.

    An inference forward whose direct launch ran: ``launch`` is :meth:`~cudnn_attn.torch.ops._Direct.launcher`,
    ``empty_lse`` the logsumexp returned with its output.  A call that autograd records: ``recorded`` is its
    decision, which :class:`~cudnn_attn.torch.eager.AttentionFunction` reads (``launch`` and ``empty_lse`` are
    ``None``); its entry exists only with torch's own tensor guard, which also compares dispatch keys, so a
    functorch wrapper never matches a plain tensor's entry (:data:`~cudnn_attn.torch.eager.apply_function`)."""

    matches: Callable[..., bool]
    launch: Callable[..., Any] | None
    empty_lse: torch.Tensor | None
    recorded: Any = None


_fast: dict[tuple, _Fast] = {}
"""The :class:`_Fast` entries by fast key; one per key (a later decision of the same key replaces it, as a call
of another query shape against the same cache does)."""


def _remember_fast(key: tuple, fast: _Fast) -> None:
    if _fast.get(key) is not fast:
        if len(_fast) >= _DECISIONS_MAX:
            _fast.clear()
        _fast[key] = fast


def _tensor_guard(tensors: tuple, public: bool = True) -> Callable[..., bool] | None:
    """``matches(*like)``: whether tensors ``like`` have the type, shape, strides, dtype, device and
    ``requires_grad`` of ``tensors``, in order.  torch's own tensor guard (``torch._C._dynamo.guards.TensorGuards``,
    private; it also compares the tensors' dispatch keys under the thread's dispatch state, so it matches a subset
    of what the public reads would) checks three tensors in 0.49 us against 1.50 us for the public reads
    (``shape``, ``stride()``, ``dtype``, ``get_device()``, ``requires_grad`` of each; CPU host, ``timeit``); where
    torch lacks it or its constructor changed, the public reads (``device``, not ``get_device()``, which is -1 for
    a CPU and a meta tensor alike), or ``None`` with ``public=False``."""
    if _TensorGuards is not None:
        try:
            guard = _TensorGuards(*tensors, dynamic_dims_sizes=[list(x.shape) for x in tensors],
                                  dynamic_dims_strides=[list(x.stride()) for x in tensors],
                                  tensor_check_names=[f"tensor{i}" for i in range(len(tensors))])
            if guard.check(*tensors):
                return guard.check
        except (TypeError, RuntimeError, SystemError):
            pass
    if not public:
        return None
    wanted = tuple(map(_described_fully, tensors))
    return lambda *like: tuple(map(_described_fully, like)) == wanted


def _described_fully(x: Any) -> tuple:
    return type(x), x.shape, x.stride(), x.dtype, x.device, x.requires_grad


try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:                    # a torch without it: the public reads
    _TensorGuards = None


def _decided(signature: tuple | None) -> _Decision | None:
    """The decision remembered for ``signature`` (``None``: none, or no signature).  A traced call (no signature)
    never reads the table: ``torch.compile`` would guard the compiled code on it."""
    if signature is None:
        return None
    try:
        return _decisions.get(signature)
    except TypeError:                     # an unhashable argument: the call is decided afresh and not remembered
        return None


def _remember(signature: tuple, decision: _Decision) -> None:
    try:
        hash(signature)
    except TypeError:
        return
    if len(_decisions) >= _DECISIONS_MAX:
        _decisions.clear()
    _decisions[signature] = decision


def _signature(tensors: tuple, *scalars: Any) -> tuple | None:
    """The identity of an eager :func:`sdpa` call, one tuple: the query's, key's and value's shape, strides, dtype,
    device and ``requires_grad``, the same of each optional tensor (``None`` for an absent one), the scalar
    arguments and their types (``True`` and ``1`` differ), and whether grad is enabled; ``None`` (nothing
    remembered) while ``torch.compile`` traces or for anything but plain tensors.  An unhashable argument makes a
    signature that :func:`_decided` finds nothing for.  Written out for the three tensors every call has: 1.96 us
    against 2.35 for a loop over all six (a decode call's signature, CPU host, ``timeit``)."""
    if torch.compiler.is_compiling():
        return None
    query, key, value, q_lengths, kv_lengths, keep = tensors
    if type(query) is not torch.Tensor or type(key) is not torch.Tensor or type(value) is not torch.Tensor:
        return None
    if q_lengths is None and kv_lengths is None and keep is None:
        optional = None
    else:
        optional = (_described(q_lengths), _described(kv_lengths), _described(keep))
        if False in optional:
            return None
    return (query.shape, query.stride(), query.dtype, query.get_device(), query.requires_grad,
            key.shape, key.stride(), key.dtype, key.get_device(), key.requires_grad,
            value.shape, value.stride(), value.dtype, value.get_device(), value.requires_grad,
            optional, scalars, tuple(map(type, scalars)), torch.is_grad_enabled())


def _described(x: Any) -> tuple | bool | None:
    """An optional tensor's part of :func:`_signature` (``None`` when absent); ``False`` for anything but a plain
    tensor."""
    if x is None:
        return None
    if type(x) is not torch.Tensor:
        return False
    return x.shape, x.stride(), x.dtype, x.get_device(), x.requires_grad


def _untraced() -> bool:
    """No dispatch mode or ``torch.func`` transform is active and ``torch.jit.trace`` is not tracing (it records the
    operator, where a call without it would be a constant of the trace): the state :func:`dispatch_free` reads that
    no call signature holds."""
    return not _in_dispatch_mode() and not _transforms_active() and not _tracing()


# torch's queries bound once: the fast path of a repeated call reads them without attribute lookups.
_Tensor, _is_compiling, _grad_enabled = torch.Tensor, torch.compiler.is_compiling, torch.is_grad_enabled
_in_dispatch_mode = _python_dispatch.is_in_torch_dispatch_mode
_transforms_active, _tracing = torch._C._are_functorch_transforms_active, torch.jit.is_tracing


def _decide(tensors: tuple, scale: Any, causal: Any, bottom_right: Any, window: Any, dropout_rate: Any, seed: Any,
            layout: Any, training: Any) -> _Decision:
    """The checks of a new signature (every argument by validation's rules, before any GPU work) and its
    :class:`_Decision`."""
    query, key, value, q_lengths, kv_lengths, keep = tensors
    _check_tensors(query=query, key=key, value=value, q_lengths=q_lengths, kv_lengths=kv_lengths, keep=keep)
    asked = _layout_name(layout)
    # The static arguments by validation's rules, before the operator's typed schema converts them.
    scale = default_scale(query.shape[-1]) if scale is None else checked("scale", SCALE_RULE.check, scale)
    if window is not None and not (type(window) is int and window == 0):          # 0 and None: no window
        checked("window", window_length, window)
    if training is None:
        training = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    static = (scale, checked("causal", flag, causal), checked("bottom_right", flag, bottom_right), int(window or 0),
              checked("dropout_rate", DROPOUT_RULE.check, dropout_rate))
    training = checked("training", flag, training)
    transposed = _running_layout(query, key, value)
    running = _OTHER[asked] if transposed else asked
    views = tuple(x.transpose(1, 2) if transposed else x for x in (query, key, value))
    copies = tuple(not (x.is_contiguous() or _readable(x)) for x in views)
    if not torch.compiler.is_compiling() and (transposed or any(copies)):
        # The operator validates its own call (the fake implementation when traced).  Where that call differs
        # from this one - another layout, copies of the tensors - this one is validated first, so that a bad call
        # fails in the caller's terms before any GPU work.
        config_of(query, key, value, q_lengths, kv_lengths, keep, static + (seed if isinstance(seed, torch.Tensor)
                                                                             else check_seed(seed), asked),
                  bool(training))
    training = bool(training)
    autograd = _records((query, key, value)) and _plain(tensors)
    return _Decision(static, running, transposed, copies, training, launches=DirectLaunches(), autograd=autograd)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any = None, *,
              scale: float | None = None, dropout_rate: float = 0.0, seed: int = 42, layout: str = "BTNH",
              return_aux: Any = None) -> AttentionOutput:
    """cuDNN attention on torch tensors with the native API's arguments (:func:`cudnn_attn.attention`).

    ``mask``: ``None`` or a :class:`~cudnn_attn.core.masks.MaskSpec` of ``causal(alignment)``, ``window(left, 0)``,
    ``padding(q_lengths, kv_lengths)`` (int32 ``(B,)`` tensors) and ``keep(bool_tensor)``, combined with ``&``.
    Returns :class:`~cudnn_attn.core.types.AttentionOutput`: ``output`` (``layout``, the value's head dim) and,
    with ``return_aux=AuxRequest(logsumexp=True)``, the float32 ``(B, N, T)`` logsumexp (not differentiable);
    ``AuxRequest(max_logit=True)`` is refused (:class:`~cudnn_attn.core.errors.UnsupportedConfigurationError`).
    ``seed``: an int, or an int64 tensor ``[seed, offset]`` on the query's device that cuDNN reads at launch (a
    CUDA graph's replays then draw the masks of the values it holds).  CUDA tensors run cuDNN, CPU tensors the
    NumPy reference.
    """
    spec = as_mask(mask)
    if spec.alibi or spec.q_offsets is not None:
        raise ValueError(f"mask: the torch front takes causal(), window(left, 0), padding(...) and keep(...); "
                         f"got {spec.describe()}")
    if spec.has_diagonal and spec.right_bound != 0:
        raise ValueError(f"mask: the torch front's diagonals are causal() and window(left, 0) (right bound 0); "
                         f"got {spec.describe()}")
    want_lse = wants_logsumexp(return_aux)
    if wants_max_logit(return_aux):
        raise UnsupportedConfigurationError(
            ["return_aux: the torch front returns no max logit (AuxRequest(max_logit=True)); the CuPy front "
             "(cudnn_attn.attention, which takes torch tensors and returns torch tensors) and the JAX bridge do"])
    output, logsumexp = sdpa(query, key, value, causal=spec.causal,
                             bottom_right=spec.alignment is DiagonalAlignment.BOTTOM_RIGHT,
                             window=spec.left_bound or 0, q_lengths=spec.q_lengths, kv_lengths=spec.kv_lengths,
                             keep=spec.keep, scale=scale, dropout_rate=dropout_rate, seed=seed, layout=layout,
                             training=True if want_lse else None)
    return AttentionOutput(output, logsumexp if want_lse else None)
