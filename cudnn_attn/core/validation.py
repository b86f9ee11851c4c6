"""The public boundary: check one attention call and describe it as an :class:`AttentionConfig`.

:func:`validate_call` is the only place that looks at user arguments (with :func:`check_seed`, the one
check of the dropout seed every front uses).  It takes real arrays only - NumPy, CuPy and JAX arrays,
JAX tracers, and ``__dlpack__`` GPU arrays such as torch tensors; a shape/dtype description
(``jax.ShapeDtypeStruct``, any object with ``.shape`` and ``.dtype``) is refused - and reads nothing but
their ``.shape`` and ``.dtype`` (no value leaves the device: value rules live in :mod:`cudnn_attn.core.values`).
It translates the seed's ``MaskType`` into the orthogonal :class:`~cudnn_attn.core.config.StaticMask` fields,
folds a ``mask`` into the additive bias and traces a ``score_mod`` (its program is its identity, see
:mod:`cudnn_attn.core.score_mod_spec`).

Every rule here is about *validity* (shapes, dtypes, ranges): a violation raises :class:`ValueError`
naming the argument, showing the shapes/dtypes of the call and stating the rule.  Whether a valid call
can run - on this GPU / cuDNN, on the JAX bridge, in the reference; FP8 with a bias or a padding mask,
paged K/V with packed segments, a paged backward - is decided by :mod:`cudnn_attn.core.support` alone.

Deliberate differences from the seed:

* Paged K/V caches may hold more blocks than the page tables use, in any order: the seed requires
  ``num_blocks == B * blocks_per_seq``; here any ``num_blocks >= 1`` is valid.
* ``q_seqlen``/``kv_seqlen`` are ignored (left out of the operands, as the seed does) unless a padding
  mask type, packing or paging makes them meaningful.
* A ``bias``/``mask`` dimension of size 1 broadcasts; the combined bias is materialised with full
  ``T`` and ``S`` dimensions, because cuDNN reads the bias with dense ``(T, S)`` strides.
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from .config import (
    DROPOUT_RULE,
    FP8_DTYPES,
    IO_DTYPES,
    SCALE_RULE,
    AttentionConfig,
    AttentionOperands,
    BiasSpec,
    DiagonalAlignment,
    PackingSpec,
    PagingSpec,
    RealRule,
    ScoreModSpec,
    StaticMask,
)
from .diagonal_warning import warn_top_left
from .score_mod_spec import score_mod_spec
from .types import FP8_PARAM_KEYS, AttentionLayout, MaskType

# The seed's stand-in for -inf in a boolean mask: cuDNN mishandles the difference of two -inf-like
# values, so a large finite negative number of the io dtype is used instead.
LARGE_NEGATIVE = {"bfloat16": -2 << 40, "float16": -2 << 14}

_PADDING_MASKS = (MaskType.PADDING, MaskType.PADDING_CAUSAL)


# -- small helpers -----------------------------------------------------------------------------------

def dtype_name(x: Any) -> str:
    """NumPy name of ``x.dtype`` (``float16``, ``bfloat16``, ``float8_e4m3fn``, ``int32``, ``bool``); for a
    dtype NumPy does not know (``torch.float16``), its own name (``float16``)."""
    try:
        return np.dtype(x.dtype).name
    except TypeError:
        return str(x.dtype).rpartition(".")[2]


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def _describe(x: Any) -> str:
    if not is_array(x):
        return "None" if x is None else type(x).__name__
    return f"{dtype_name(x)}{list(_shape(x))}"


def _describe_inputs(**arrays: Any) -> str:
    """``query=float16[2, 128, 8, 64], key=...`` for the arrays that are present."""
    return ", ".join(f"{name}={_describe(a)}" for name, a in arrays.items() if a is not None)


class _ArgumentCheck:
    """The checks of one call's arguments build their ValueErrors here: every message carries the Q/K/V
    description."""

    def __init__(self, query: Any, key: Any, value: Any, layout: str):
        self._inputs = (query, key, value)
        self.layout = layout

    def error(self, argument: str, rule: str, hint: str | None = None) -> ValueError:
        query, key, value = self._inputs
        lines = [f"{argument}: {rule}",
                 f"  inputs ({self.layout}): {_describe_inputs(query=query, key=key, value=value)}"]
        if hint:
            lines.append(f"  hint: {hint}")
        return ValueError("\n".join(lines))


class _Dims(NamedTuple):
    """A Q/K/V shape read in the call's layout."""

    batch: int
    length: int
    heads: int
    dim: int

    @classmethod
    def of(cls, x: Any, layout: AttentionLayout) -> "_Dims":
        b, d1, d2, h = _shape(x)
        return cls(b, d1, d2, h) if layout is AttentionLayout.BTNH else cls(b, d2, d1, h)


def _array_namespace(x: Any) -> Any:
    """``numpy``, ``cupy`` or ``jax.numpy`` by the type of ``x`` (JAX tracers count as JAX)."""
    root = type(x).__module__.partition(".")[0]
    if root in ("jax", "jaxlib"):
        return x.__array_namespace__()      # jax.numpy, for arrays and tracers alike
    if root == "cupy":
        import cupy
        return cupy
    return np


def is_array(x: Any) -> bool:
    """``x`` holds data: a NumPy array or scalar, a CuPy array, a JAX array or tracer, or a ``__dlpack__``
    array (torch tensors).  Descriptions without data (``jax.ShapeDtypeStruct``) are not arrays."""
    if isinstance(x, (np.ndarray, np.generic)):
        return True
    for module, kind in (("jax", "Array"), ("cupy", "ndarray")):
        loaded = sys.modules.get(module)          # an array of a framework that is not imported cannot exist
        if loaded is not None and isinstance(x, getattr(loaded, kind)):
            return True
    return hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__") and hasattr(x, "shape") \
        and hasattr(x, "dtype")


def _not_array(x: Any) -> str:
    """Why ``x`` is refused as an array (for the messages)."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return (f"got {type(x).__name__} (a shape/dtype description without data); pass a NumPy, CuPy or JAX "
                "array (e.g. numpy.empty(shape, dtype) to describe a call)")
    return f"got {type(x).__name__}"


def check_seed(seed: Any) -> int:
    """The dropout seed as an int, checked the same way by every front (reference, CuPy, JAX): a Python or
    NumPy integer in ``[0, 2**63)`` (cuDNN binds it as int64).  Forward and backward must be given the same
    seed to draw the same dropout mask.

    Raises:
        ValueError: ``None``, a string, a bool, a float, a negative or too large value (naming ``seed``).
    """
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed: the dropout seed must be a Python or NumPy int in [0, 2**63), got "
                         f"{type(seed).__name__} {seed!r} (cuDNN binds it by value: it is static under jit, and "
                         "the forward and its backward must use the same one; a seed read on the device is an "
                         "int64 array [seed, offset], or on JAX's attention a dropout_rng key)")
    if not 0 <= int(seed) < 2 ** 63:
        raise ValueError(f"seed: the dropout seed must be an int in [0, 2**63), got {int(seed)}")
    return int(seed)


_SEED_WORDS = {"int64": 1, "uint64": 1, "uint32": 2}     # 8 bytes of a Philox seed or offset


def seed_operands(seed: Any) -> tuple[Any, Any] | None:
    """The device seed and offset of cuDNN's dropout when ``seed`` holds them, else ``None`` (a static seed:
    :func:`check_seed`).  ``seed`` may be an int64 array of two elements ``[seed, offset]`` (CuPy, torch; C-contiguous:
    its two one-element views are returned), or a pair ``(seed, offset)`` of arrays of 8 bytes each (an int64 of one
    element, or a uint32 of two: the int64's words, low first, as JAX makes them from a key).

    Raises:
        ValueError: an array or pair of another dtype or size (naming ``seed``).
    """
    if isinstance(seed, tuple) and len(seed) == 2 and all(is_array(x) for x in seed):
        for part, x in zip(("seed", "offset"), seed):
            if _SEED_WORDS.get(dtype_name(x)) != math.prod(_shape(x)):
                raise ValueError(f"seed: the dropout {part} must be an int64 array of one element or a uint32 array "
                                 f"of two (8 bytes), got {_describe(x)}")
        return seed
    if not is_array(seed) or isinstance(seed, (np.generic,)) or _shape(seed) == ():
        return None
    if dtype_name(seed) != "int64" or math.prod(_shape(seed)) != 2:
        raise ValueError(f"seed: a device dropout seed must be an int64 array of two elements [seed, offset], got "
                         f"{_describe(seed)}")
    flat = seed.reshape(2)
    return flat[0:1], flat[1:2]


def bind_seed(config: AttentionConfig, operands: AttentionOperands,
              seed: Any) -> tuple[AttentionConfig, AttentionOperands, int]:
    """``(config, operands, static_seed)`` of a call given ``seed``: a static int seed stays a host scalar (checked
    by :func:`check_seed`); a device seed (:func:`seed_operands`) with dropout sets ``config.device_seed`` and the
    operands' ``dropout_seed``/``dropout_offset`` (the static seed is then 0, unused)."""
    pair = seed_operands(seed)
    if pair is None:
        return config, operands, check_seed(seed)
    if not config.has_dropout:
        return config, operands, 0
    return (config.replace(device_seed=True), operands.replace(dropout_seed=pair[0], dropout_offset=pair[1]), 0)


# -- argument groups --------------------------------------------------------------------------------

def _io_dtype_name(x: Any, fp8_dtype: str | None) -> str:
    """The dtype of a Q/K/V-like array; uint8 bytes count as ``fp8_dtype`` when one is given."""
    name = dtype_name(x)
    return fp8_dtype if fp8_dtype is not None and name == "uint8" else name


def _check_qkv(call: _ArgumentCheck, query: Any, key: Any, value: Any, use_fp8: bool, fp8_dtype: str | None) -> str:
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not is_array(x):
            raise call.error(name, f"expected an array, {_not_array(x)}")
        if len(x.shape) != 4:
            raise call.error(name, f"must have rank 4, got rank {len(x.shape)}",
                             hint="Q is (B, T, N, H) for BTNH or (B, N, T, H) for BNTH; K/V likewise.")
        if 0 in _shape(x):
            raise call.error(name, f"every dimension must be >= 1, got shape {_shape(x)}")
    names = {_io_dtype_name(x, fp8_dtype) for x in (query, key, value)}
    if len(names) != 1:
        raise call.error("query/key/value", "must have the same dtype")
    dtype = names.pop()
    allowed = FP8_DTYPES if use_fp8 else IO_DTYPES
    if dtype not in allowed:
        hint = ("use_fp8=True takes FP8 inputs (quantise Q/K/V and pass their descales in fp8_params)"
                if use_fp8 else
                "FP8 inputs need use_fp8=True and fp8_params" if dtype in FP8_DTYPES else
                "cast Q/K/V to float16 or bfloat16")
        raise call.error("query", f"dtype must be one of {', '.join(allowed)}"
                         f"{' (use_fp8=True)' if use_fp8 else ''}, got {dtype}", hint)
    return dtype


def _check_paging(call: _ArgumentCheck, layout: AttentionLayout, q: _Dims, k: _Dims, v: _Dims,
                  page_table_k: Any, page_table_v: Any) -> tuple[PagingSpec | None, _Dims, _Dims]:
    """Returns the paging spec and K/V dims with the *logical* length ``blocks_per_seq * block_size``."""
    if page_table_k is None and page_table_v is None:
        return None, k, v
    if page_table_k is None or page_table_v is None:
        raise call.error("page_table_k/page_table_v", "give both page tables or neither")
    cache = "(num_blocks, block_size, K, H)" if layout is AttentionLayout.BTNH else "(num_blocks, K, block_size, H)"
    for name, table in (("page_table_k", page_table_k), ("page_table_v", page_table_v)):
        shape = _shape(table)
        if dtype_name(table) != "int32" or len(shape) != 4 or shape[1] != 1 or shape[3] != 1:
            raise call.error(name, f"must be int32 of shape (B, 1, blocks_per_seq, 1), got {_describe(table)}")
        if shape[0] != q.batch:
            raise call.error(name, f"batch {shape[0]} differs from the query batch {q.batch}")
        if shape[2] < 1:
            raise call.error(name, "blocks_per_seq must be >= 1")
    if _shape(page_table_k) != _shape(page_table_v):
        raise call.error("page_table_v", f"must have the shape of page_table_k {_shape(page_table_k)}, "
                         f"got {_shape(page_table_v)}")
    # Read in the layout, a cache (num_blocks, block_size, K, H) parses as batch=num_blocks, length=block_size.
    if k.length != v.length:
        raise call.error("key/value", f"caches {cache} must have the same block_size, got {k.length} vs {v.length}")
    blocks_per_seq = _shape(page_table_k)[2]
    paging = PagingSpec(num_blocks_k=k.batch, num_blocks_v=v.batch, block_size=k.length,
                        blocks_per_seq=blocks_per_seq)
    kv_len = blocks_per_seq * k.length
    return paging, k._replace(batch=q.batch, length=kv_len), v._replace(batch=q.batch, length=kv_len)


def _check_shapes(call: _ArgumentCheck, q: _Dims, k: _Dims, v: _Dims) -> None:
    if not q.batch == k.batch == v.batch:
        raise call.error("query/key/value", f"batch sizes must be equal, got {q.batch}, {k.batch}, {v.batch}")
    if q.dim != k.dim:
        raise call.error("key", f"head dim {k.dim} must equal the query head dim {q.dim}")
    if k.heads != v.heads:
        raise call.error("value", f"number of heads {v.heads} must equal the key's {k.heads}")
    if q.heads % k.heads:
        hint = "grouped-query attention shares each K/V head among N/K query heads; choose K dividing N."
        if q.heads % k.length == 0:      # K/V read in the other layout would fit: the layout is the likelier mistake
            other = "BNTH" if call.layout == "BTNH" else "BTNH"
            hint = (f"read as {other}, key/value would have K={k.length} heads and S={k.heads} positions: "
                    f"query, key and value take one layout (here {call.layout}); give key/value in it too "
                    f"(e.g. x.transpose(0, 2, 1, 3)) or all three in {other} with qkv_layout/layout={other!r}.")
        raise call.error("key/value", f"query heads N={q.heads} must be a multiple of key/value heads K={k.heads}",
                         hint)
    if k.length != v.length:
        raise call.error("value", f"sequence length {v.length} must equal the key's {k.length}")


def _check_sequences(call: _ArgumentCheck, batch: int, q_seqlen: Any, kv_seqlen: Any, q_offsets: Any,
                     kv_offsets: Any) -> PackingSpec | None:
    if (q_offsets is None) != (kv_offsets is None):
        raise call.error("q_offsets/kv_offsets", "give both offsets (packed segments) or neither")
    packing = None
    if q_offsets is not None:
        if q_seqlen is None or kv_seqlen is None:
            raise call.error("q_seqlen/kv_seqlen", "packed segments (q_offsets/kv_offsets) require both "
                             "q_seqlen and kv_seqlen of shape (B, M)")
        for name, offsets in (("q_offsets", q_offsets), ("kv_offsets", kv_offsets)):
            shape = _shape(offsets)
            if dtype_name(offsets) != "int32" or len(shape) != 2 or shape[0] != batch or shape[1] < 2:
                raise call.error(name, f"must be int32 of shape (B, M + 1) with B={batch} and M >= 1 segments "
                                 f"per row, got {_describe(offsets)}")
        if _shape(q_offsets) != _shape(kv_offsets):
            raise call.error("kv_offsets", f"must have the shape of q_offsets {_shape(q_offsets)}, "
                             f"got {_shape(kv_offsets)}")
        packing = PackingSpec(max_segments=_shape(q_offsets)[1] - 1)
    expected = (batch, packing.max_segments) if packing else (batch,)
    rule = "(B, M) with packed segments" if packing else "(B,)"
    for name, seqlen in (("q_seqlen", q_seqlen), ("kv_seqlen", kv_seqlen)):
        if seqlen is not None and (dtype_name(seqlen) != "int32" or _shape(seqlen) != expected):
            raise call.error(name, f"must be int32 of shape {rule} = {expected}, got {_describe(seqlen)}")
    return packing


def _mask_spec(call: _ArgumentCheck, mask_type: MaskType, sliding_window_length: Any, diagonal_alignment: Any,
               padding: bool) -> StaticMask:
    causal = mask_type in (MaskType.CAUSAL, MaskType.PADDING_CAUSAL, MaskType.ALIBI)
    left_bound = None
    if sliding_window_length is not None:
        try:
            left_bound = window_length(sliding_window_length)
        except ValueError as exc:
            raise call.error("sliding_window_length", str(exc),
                             "the window (pos - w, pos] keeps w keys ending at the diagonal.") from None
        causal = True
    try:
        alignment = DiagonalAlignment(diagonal_alignment)
    except ValueError:
        raise call.error("diagonal_alignment", f"must be 'top_left' or 'bottom_right', got {diagonal_alignment!r}") \
            from None
    if not causal:
        alignment = DiagonalAlignment.TOP_LEFT   # no diagonal, nothing to align
    return StaticMask(right_bound=0 if causal else None, left_bound=left_bound, alignment=alignment,
                      padding=padding, alibi=mask_type is MaskType.ALIBI)


def _check_fp8(call: _ArgumentCheck, fp8_params: Any) -> dict:
    if not isinstance(fp8_params, Mapping):
        raise call.error("fp8_params", "use_fp8=True requires fp8_params, a dict of the FP8Params entries, "
                         f"got {type(fp8_params).__name__}")
    missing = [k for k in FP8_PARAM_KEYS if k not in fp8_params]
    if missing:
        raise call.error("fp8_params", f"missing keys: {', '.join(missing)}")
    for name in FP8_PARAM_KEYS:
        x = fp8_params[name]
        if not is_array(x) or dtype_name(x) != "float32" or math.prod(_shape(x)) != 1:
            found = _describe(x)
            raise call.error(f"fp8_params[{name!r}]", f"must be a float32 array with one element "
                             f"(shape () or (1, 1, 1, 1)), got {found}")
    return {name: fp8_params[name] for name in FP8_PARAM_KEYS}


def _check_bias_like(call: _ArgumentCheck, name: str, x: Any, full: tuple[int, int, int, int],
                     allowed_dtypes: Sequence[str], hint: str | None = None) -> tuple[int, int, int, int]:
    shape = _shape(x)
    if dtype_name(x) not in allowed_dtypes:
        raise call.error(name, f"dtype must be one of {', '.join(allowed_dtypes)}, got {dtype_name(x)}", hint)
    four = (1,) * (4 - len(shape)) + shape
    if len(shape) > 4 or any(d not in (1, f) for d, f in zip(four, full)):
        raise call.error(name, f"shape {shape} does not broadcast to (B, N, T, S) = {full}: rank <= 4, "
                         "leading dimensions are added, each dimension is 1 or the full size",
                         "e.g. (T, S), (1, N, T, S), (B, 1, T, S), (B, 1, 1, S) or (B, N, T, S).")
    return four


def _fold_bias(bias: Any, mask: Any, bias_shape: tuple[int, ...], mask_shape: tuple[int, ...],
               full_shape: tuple[int, ...], dtype: Any, xp: Any) -> Any:
    """``bias + where(mask, 0, large negative)`` (or the additive mask), 4-D, dense in ``(T, S)``."""
    terms = []
    if bias is not None:
        terms.append(xp.reshape(bias, bias_shape))
    if mask is not None:
        if dtype_name(mask) == "bool":
            neg = LARGE_NEGATIVE[np.dtype(dtype).name]
            mask = xp.where(mask, xp.full((), 0, dtype=dtype), xp.full((), neg, dtype=dtype))
        terms.append(xp.reshape(mask, mask_shape))
    combined = terms[0] if len(terms) == 1 else terms[0] + terms[1]
    if _shape(combined) != full_shape:   # materialise broadcast T/S dims densely (a fresh C-order array)
        combined = combined + xp.zeros(full_shape, dtype=combined.dtype)
    return combined


def _prepare_bias(call: _ArgumentCheck, bias: Any, mask: Any, full: tuple[int, int, int, int], dtype: str,
                  io_dtype: Any, xp: Any) -> tuple[Any, BiasSpec | None, Any]:
    """The folded bias, its spec and a boolean mask read as 4-D (``None`` without one)."""
    if bias is None and mask is None:
        return None, None, None
    # An FP8 call has no bias dtype (it takes no bias: the support table refuses one on every front).
    dtypes = (dtype, *IO_DTYPES, "float32") if dtype in FP8_DTYPES else (dtype,)
    shapes = {}
    if bias is not None:
        shapes["bias"] = _check_bias_like(call, "bias", bias, full, dtypes)
    if mask is not None:
        shapes["mask"] = _check_bias_like(call, "mask", mask, full, ("bool", *dtypes),
                                          "a boolean mask keeps the keys where it is True; a 0/1 keep-mask m of "
                                          "another dtype (Flax's float masks) is m > 0 (keep(m > 0) in the native "
                                          "call); an additive mask takes the query's dtype.")
    # Batch and heads stay broadcast (cuDNN reads them with stride 0); T and S are materialised.
    combined = tuple(max(dims) for dims in zip(*shapes.values()))[:2] + full[2:]
    differentiable = bias is not None or dtype_name(mask) != "bool"
    if dtype in FP8_DTYPES:     # FP8 takes no bias on any front (the support table): nothing to fold
        return None, BiasSpec(shape=combined, differentiable=differentiable), None
    folded = _fold_bias(bias, mask, shapes.get("bias"), shapes.get("mask"), combined, io_dtype, xp)
    keep = xp.reshape(mask, shapes["mask"]) if mask is not None and dtype_name(mask) == "bool" else None
    return folded, BiasSpec(shape=combined, differentiable=differentiable), keep


def default_scale(head_dim: int) -> float:
    """The softmax scale ``scale=None`` stands for on every front: ``1 / sqrt(H)``."""
    return 1.0 / math.sqrt(head_dim)


def _check_real(call: _ArgumentCheck, name: str, value: Any, rule: RealRule) -> float:
    try:
        return rule.check(value)
    except ValueError as exc:
        raise call.error(name, str(exc)) from None


def flag(value: Any) -> bool:
    """``value`` as a bool (a Python or NumPy bool), or a ``ValueError`` saying the rule (the caller adds the
    name)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def window_length(value: Any) -> int:
    """A sliding window's length in keys (the seed's ``sliding_window_length`` when given), or a ``ValueError``
    saying the rule (the caller adds the name)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"must be an int > 0 or None, got {value!r}")
    return int(value)


def checked(name: str, rule: Callable[[Any], Any], value: Any) -> Any:
    """``rule(value)`` (:func:`flag`, :func:`window_length`, ``SCALE_RULE.check``, ...) with its ``ValueError``
    naming ``name``: validation's rules for a front that checks a static argument before it calls
    :func:`validate_call` (the torch front, whose operator takes typed scalars)."""
    try:
        return rule(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _check_flag(call: _ArgumentCheck, name: str, value: Any) -> bool:
    try:
        return flag(value)
    except ValueError as exc:
        raise call.error(name, str(exc)) from None


def _check_score_mod(call: _ArgumentCheck, score_mod: Any, score_mod_args: Sequence[Any],
                     score_shape: tuple[int, int, int, int]) -> ScoreModSpec | None:
    if not isinstance(score_mod_args, (tuple, list)):
        raise call.error("score_mod_args", f"must be a tuple of arrays, got {type(score_mod_args).__name__}")
    args = tuple(score_mod_args)
    if score_mod is None:
        if args:
            raise call.error("score_mod_args", "given without score_mod")
        return None
    if not callable(score_mod):
        raise call.error("score_mod", f"must be callable as score_mod(score, *score_mod_args), got {score_mod!r}")
    for i, a in enumerate(args):
        if not is_array(a):
            raise call.error(f"score_mod_args[{i}]", f"must be an array, got {type(a).__name__}")
    try:
        return score_mod_spec(score_mod, score_shape, tuple((_shape(a), dtype_name(a)) for a in args))
    except ValueError as error:        # "score_mod: <rule>" from the tracer
        raise call.error("score_mod", str(error).removeprefix("score_mod: ")) from error


# -- public -----------------------------------------------------------------------------------------

def validate_call(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, q_seqlen: Any = None,
                  kv_seqlen: Any = None, q_offsets: Any = None, kv_offsets: Any = None, page_table_k: Any = None,
                  page_table_v: Any = None, fp8_params: Any = None, score_mod_args: Sequence[Any] = (),
                  sink: Any = None, *, scale: float | None = 1.0, mask_type: MaskType = MaskType.NO_MASK,
                  dropout_rate: float = 0.0, qkv_layout: Any = "BTNH", sliding_window_length: int | None = None,
                  score_mod: Callable[..., Any] | None = None, use_fp8: bool = False, training: bool = False,
                  diagonal_alignment: Any = "top_left", deterministic: bool = False, fp8_dtype: str | None = None,
                  xp: Any = None) -> tuple[AttentionConfig, AttentionOperands]:
    """Validate one attention call and describe it.

    Arguments follow the seed's ``dot_product_attention`` / ``paged_attention`` (see DESIGN.md);
    ``training`` asks the forward for the logsumexp, ``diagonal_alignment`` places the causal diagonal
    and ``deterministic`` selects deterministic backward accumulation.  With ``use_fp8``, ``fp8_dtype``
    (``"float8_e4m3fn"`` or ``"float8_e5m2"``) reads ``uint8`` Q/K/V as the bytes of that FP8 format
    (CuPy has no float8 dtype); ``config.dtype`` is then the FP8 format.  ``xp`` is the array namespace
    used to fold ``mask`` into the bias (detected from ``query`` when ``None``).  ``scale=None`` is
    ``1 / sqrt(H)`` (:func:`default_scale`), as in ``jax.nn.dot_product_attention``.

    Returns the static :class:`AttentionConfig` and the :class:`AttentionOperands` holding the arrays
    (``bias`` combined with ``mask``, ``keep_mask`` a boolean ``mask`` as 4-D; seqlens only where a padding
    mask, packing or paging uses them).

    Raises:
        ValueError: the call is invalid (the message names the argument, the rule and the shapes).
    """
    layout = AttentionLayout.parse(qkv_layout)
    call = _ArgumentCheck(query, key, value, layout.name)
    if not isinstance(mask_type, MaskType):
        raise call.error("mask_type", f"must be a MaskType ({', '.join(MaskType.__members__)}), got {mask_type!r}")
    optional = dict(bias=bias, mask=mask, q_seqlen=q_seqlen, kv_seqlen=kv_seqlen, q_offsets=q_offsets,
                    kv_offsets=kv_offsets, page_table_k=page_table_k, page_table_v=page_table_v, sink=sink)
    for name, x in optional.items():
        if x is not None and not is_array(x):
            raise call.error(name, f"expected an array or None, {_not_array(x)}")
    use_fp8 = _check_flag(call, "use_fp8", use_fp8)
    training = _check_flag(call, "training (return_residual)", training)
    deterministic = _check_flag(call, "deterministic", deterministic)
    if fp8_dtype is not None and fp8_dtype not in FP8_DTYPES:
        raise call.error("fp8_dtype", f"the FP8 format of uint8 operands must be one of {', '.join(FP8_DTYPES)}, "
                         f"got {fp8_dtype!r}")
    dtype = _check_qkv(call, query, key, value, use_fp8, fp8_dtype if use_fp8 else None)
    q, k, v = (_Dims.of(x, layout) for x in (query, key, value))
    paging, k, v = _check_paging(call, layout, q, k, v, page_table_k, page_table_v)
    _check_shapes(call, q, k, v)

    fp8_scales = _check_fp8(call, fp8_params) if use_fp8 else None
    packing = _check_sequences(call, q.batch, q_seqlen, kv_seqlen, q_offsets, kv_offsets)
    if paging and (q_seqlen is None or kv_seqlen is None):
        raise call.error("q_seqlen/kv_seqlen", "paged attention requires both q_seqlen and kv_seqlen of shape (B,)")
    if mask_type in _PADDING_MASKS and (q_seqlen is None or kv_seqlen is None):
        raise call.error("q_seqlen/kv_seqlen", f"{mask_type.name} requires both q_seqlen and kv_seqlen")
    padding = mask_type in _PADDING_MASKS or packing is not None or paging is not None
    mask_spec = _mask_spec(call, mask_type, sliding_window_length, diagonal_alignment, padding)

    scale = default_scale(q.dim) if scale is None else _check_real(call, "scale", scale, SCALE_RULE)
    dropout_rate = _check_real(call, "dropout_rate", dropout_rate, DROPOUT_RULE)
    score_mod_spec = _check_score_mod(call, score_mod, score_mod_args, (q.batch, q.heads, q.length, k.length))
    if sink is not None and (dtype_name(sink) != "float32" or _shape(sink) != (q.heads,)):
        raise call.error("sink", f"must be float32 of shape (N,) = ({q.heads},), got {_describe(sink)}")

    full = (q.batch, q.heads, q.length, k.length)
    xp = xp if xp is not None else _array_namespace(query)
    bias_array, bias_spec, keep = _prepare_bias(call, bias, mask, full, dtype, query.dtype, xp)
    config = AttentionConfig(
        batch=q.batch, q_heads=q.heads, kv_heads=k.heads, q_len=q.length, kv_len=k.length, qk_dim=q.dim,
        v_dim=v.dim, dtype=dtype, layout=layout, scale=scale, mask=mask_spec, bias=bias_spec,
        dropout_rate=dropout_rate, packing=packing, paging=paging, score_mod=score_mod_spec,
        sink=sink is not None, training=training, deterministic=deterministic,
    )
    warn_top_left(config)
    operands = AttentionOperands(
        query=query, key=key, value=value, bias=bias_array,
        q_seqlen=q_seqlen if padding else None, kv_seqlen=kv_seqlen if padding else None,
        q_offsets=q_offsets, kv_offsets=kv_offsets, page_table_k=page_table_k, page_table_v=page_table_v,
        sink=sink, score_mod_args=tuple(score_mod_args), fp8_scales=fp8_scales, keep_mask=keep,
    )
    return config, operands


def validate_backward(config: AttentionConfig, output: Any, grad_output: Any, logsumexp: Any) -> None:
    """Check the forward's residuals and the incoming gradient against ``config``.

    ``output`` and ``grad_output`` must have ``config.o_shape`` and the io dtype (with FP8, also ``uint8``
    bytes of it, as :func:`validate_call` accepts with ``fp8_dtype``); ``logsumexp`` must be float32 of
    ``config.lse_shape``.  Raises :class:`ValueError` otherwise.
    """
    expected = {
        "output": (config.o_shape, config.dtype),
        "grad_output": (config.o_shape, config.dtype),
        "logsumexp": (config.lse_shape, "float32"),
    }
    for name, x in (("output", output), ("grad_output", grad_output), ("logsumexp", logsumexp)):
        shape, dtype = expected[name]
        found_dtype = _io_dtype_name(x, config.dtype if config.fp8 and name != "logsumexp" else None) \
            if is_array(x) else None
        if found_dtype is None or _shape(x) != shape or found_dtype != dtype:
            found = _describe(x)
            raise ValueError(f"{name}: expected {dtype}{list(shape)}, got {found}\n"
                             f"  configuration: {config.describe()}")
