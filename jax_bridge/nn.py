"""A drop-in for ``jax.nn.dot_product_attention`` that runs this library's attention.

:func:`dot_product_attention_nn` takes ``jax.nn.dot_product_attention``'s arguments and follows its
semantics, translated onto the library's configuration:

=====================================  =====================================================================
``jax.nn``                             here
=====================================  =====================================================================
``query`` ``(B, T, N, H)``, or rank < 4    BTNH layout (missing leading dimensions are added and removed)
``key``/``value`` with ``K`` heads     grouped-query attention (``N`` a multiple of ``K``)
``bias`` broadcastable to (B, N, T, S)  additive bias of any real or bool dtype, cast to the query's dtype (a
                                       bool bias adds 1 where True, as ``jax.nn``'s float32 logits do);
                                       rank <= 4, leading dimensions added; differentiable
``mask`` (boolean, True keeps)         :func:`~cudnn_attn.core.masks.keep`: folded into the bias (large negative)
``scale=None``                         ``1 / sqrt(H)``
``is_causal``                          top-left causal mask (:func:`~cudnn_attn.core.masks.causal`)
``query_seq_lengths``/                 :func:`~cudnn_attn.core.masks.padding` (the missing one is the full length); rows
``key_value_seq_lengths`` ``(B,)``     past a query length are 0, as in ``jax.nn``
``local_window_size=(l, r)`` or ``w``  :func:`~cudnn_attn.core.masks.window` ``(l, r)``: keys ``i - l <= j <= i + r``
                                       (``w`` means ``(w, w)``); with ``is_causal`` the right side is 0
(extensions) ``dropout_rate``,         attention dropout from a PRNG key, traced or not (:mod:`.dropout`)
``dropout_rng``
=====================================  =====================================================================

Every array argument may be anything ``jnp.asarray`` takes (NumPy arrays, lists, tuples, Python scalars),
as in ``jax.nn``.  The call is the native :func:`~.api.attention` with that
:class:`~cudnn_attn.core.masks.MaskSpec`.  Every argument is checked before anything is computed, and errors
name the drop-in's own arguments (``query_seq_lengths``, ``local_window_size``, ``is_causal``, ...).
Refused with a ``ValueError``, as ``jax.nn`` refuses them: what ``jnp.asarray`` cannot convert, ranks above
4, Q/K/V of different dtypes or shapes, a ``mask`` that is not boolean (a 0/1 float keep-mask, such as
Flax's, is passed as ``mask=m > 0``), lengths that are not int32 ``(B,)``, window sizes that are not ints
``>= 0``.  Refused here and not by ``jax.nn``: float32/float64 Q/K/V (cuDNN attention computes on float16 and
bfloat16; cast first), empty dimensions, complex biases, an ``is_causal`` that is not a bool, and lengths
whose known values (or, with ``check_values``, run-time values) lie outside ``[0, T]`` / ``[0, S]``.
``return_residual`` and ``implementation`` are not part of the drop-in: the logsumexp is available
from :func:`~.api.dot_product_attention`. A query row whose keys are all masked out (by ``mask``)
returns the mean of V over its keys, as ``jax.nn``'s XLA path does, in fp16 and bf16
(:mod:`cudnn_attn.core.masked_rows`).
"""

from __future__ import annotations

import numbers
from typing import Any

import jax.numpy as jnp
import numpy as np

from cudnn_attn.core import masks
from cudnn_attn.core.validation import dtype_name, is_array

from .api import attention, forward_call

# The drop-in's names for the library's arguments, in the messages of value checks.
NAMES = {"q_seqlen": "query_seq_lengths", "kv_seqlen": "key_value_seq_lengths"}


def _describe(x: Any) -> str:
    return f"{dtype_name(x)}{list(x.shape)}" if is_array(x) else type(x).__name__


def _array(name: str, x: Any) -> Any:
    """``x`` as ``jax.nn`` reads it: an array, or what ``jnp.asarray`` makes of a list, tuple or scalar."""
    if x is None or is_array(x):
        return x
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name}: expected an array or what jnp.asarray takes (a list, tuple or scalar), got "
                         f"{type(x).__name__} ({error})") from None


def _four_dimensional(name: str, x: Any, rule: str) -> Any:
    """``x`` with leading dimensions of size 1 up to rank 4 (``jax.nn``'s rule); a higher rank is refused."""
    if x.ndim > 4:
        raise ValueError(f"{name}: must have rank <= 4 {rule}, got {_describe(x)}")
    return x.reshape((1,) * (4 - x.ndim) + tuple(x.shape)) if x.ndim < 4 else x


def _check_arrays(query: Any, key: Any, value: Any) -> tuple[Any, Any, Any, tuple[int, ...]]:
    """Q/K/V as 4-D ``(B, T, N, H)`` arrays (leading dimensions added), alike and without empty dimensions,
    and the query's own shape (the output's)."""
    found, shape = [], None
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x is None:
            raise ValueError(f"{name}: expected an array, got None")
        x = _array(name, x)
        shape = tuple(x.shape) if shape is None else shape
        x = _four_dimensional(name, x, "(B, T, N, H); lower ranks get leading dimensions")
        if 0 in x.shape:
            raise ValueError(f"{name}: every dimension must be >= 1, got {_describe(x)}")
        found.append(x)
    query, key, value = found
    if tuple(value.shape) != tuple(key.shape):
        raise ValueError(f"value: must have the shape of key {list(key.shape)} (jax.nn's rule), got {_describe(value)}")
    return query, key, value, shape


def _check_lengths(name: str, lengths: Any, batch: int) -> Any:
    lengths = _array(name, lengths)
    if lengths is None:
        return None
    if dtype_name(lengths) != "int32" or tuple(lengths.shape) != (batch,):
        raise ValueError(f"{name}: must be an int32 array of shape (B,) = ({batch},), got {_describe(lengths)}")
    return lengths


def _bias(bias: Any, dtype: Any) -> Any:
    """``bias`` as an array of the query's dtype (bool and int biases too: ``jax.nn`` adds them to float32 logits)."""
    bias = _array("bias", bias)
    if bias is None:
        return None
    bias = _four_dimensional("bias", bias, "broadcastable to (B, N, T, S)")
    kind = np.dtype(bias.dtype).kind if dtype_name(bias) != "bfloat16" else "f"
    if kind not in "biuf":
        raise ValueError(f"bias: must be real or boolean (added to the scores), got {_describe(bias)}")
    return jnp.asarray(bias).astype(dtype)


def _mask(mask: Any) -> Any:
    mask = _array("mask", mask)
    if mask is None:
        return None
    mask = _four_dimensional("mask", mask, "broadcastable to (B, N, T, S)")
    if dtype_name(mask) != "bool":
        raise ValueError(f"mask: must be boolean (True keeps), as in jax.nn, got {_describe(mask)}; a 0/1 float "
                         "keep-mask (1 keeps, as Flax's masks) is mask=m > 0")
    return mask


def _window(local_window_size: Any, is_causal: bool) -> tuple[int, int] | None:
    if local_window_size is None:
        return None

    def whole(w: Any) -> bool:
        return isinstance(w, numbers.Integral) and not isinstance(w, (bool, np.bool_)) and w >= 0

    if isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2 \
            and all(whole(w) for w in local_window_size):
        left, right = (int(w) for w in local_window_size)
    elif whole(local_window_size):
        left = right = int(local_window_size)
    else:
        raise ValueError(f"local_window_size: expected an int >= 0 or a pair (left, right) of ints >= 0, "
                         f"got {local_window_size!r}")
    return left, 0 if is_causal else right


def dot_product_attention_nn(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, *,
                             scale: float | None = None, is_causal: bool = False, query_seq_lengths: Any = None,
                             key_value_seq_lengths: Any = None, local_window_size: Any = None,
                             dropout_rate: float = 0.0, dropout_rng: Any = None, cuda_graph: bool | None = None,
                             backend: str = "ffi", check_values: bool | None = None) -> Any:
    """``jax.nn.dot_product_attention`` on this library's kernels (module doc for the mapping).

    ``dropout_rate`` with ``dropout_rng`` (a PRNG key, traced or not; required with a rate > 0) is attention
    dropout, which ``jax.nn`` lacks: cuDNN's Philox mask from the key, a new one for every key
    (:mod:`.dropout`).  ``cuda_graph``, ``backend`` and ``check_values`` are this library's options (see
    :mod:`.api`).
    """
    if dropout_rng is None and isinstance(dropout_rate, numbers.Real) and dropout_rate > 0:
        raise ValueError("dropout_rng: required with dropout_rate > 0 (a JAX PRNG key; jax.random.key(n))")
    query, key, value, shape = _check_arrays(query, key, value)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise ValueError(f"is_causal: must be True or False, got {is_causal!r}")
    window = _window(local_window_size, bool(is_causal))
    batch = query.shape[0]
    query_seq_lengths = _check_lengths("query_seq_lengths", query_seq_lengths, batch)
    key_value_seq_lengths = _check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
    mask = _mask(mask)
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    bias = _bias(bias, query.dtype)
    spec = masks.MaskSpec()
    if is_causal:
        spec = spec & masks.causal()
    if window is not None:
        spec = spec & masks.window(*window)
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        spec = spec & masks.padding(
            jnp.full((batch,), query.shape[1], jnp.int32) if query_seq_lengths is None else query_seq_lengths,
            jnp.full((batch,), key.shape[1], jnp.int32) if key_value_seq_lengths is None else key_value_seq_lengths)
    if mask is not None:
        spec = spec & masks.keep(mask)
    call = attention.arguments(query, key, value, mask=spec, bias=bias, scale=scale, dropout_rate=dropout_rate,
                               cuda_graph=cuda_graph, backend=backend, check_values=check_values,
                               dropout_rng=dropout_rng)
    output = forward_call(call, names=NAMES).output
    return output.reshape(shape) if tuple(output.shape) != shape else output
