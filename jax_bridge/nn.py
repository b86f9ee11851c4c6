"""A drop-in for ``jax.nn.dot_product_attention`` that runs this library's attention.

:func:`dot_product_attention_nn` takes ``jax.nn.dot_product_attention``'s arguments and follows its
semantics, translated onto the library's configuration:

=====================================  =====================================================================
``jax.nn``                             here
=====================================  =====================================================================
``query`` ``(B, T, N, H)`` / ``(T, N, H)``  BTNH layout (a missing batch dimension is added and removed)
``key``/``value`` with ``K`` heads     grouped-query attention (``N`` a multiple of ``K``)
``bias`` broadcastable to (B, N, T, S)  additive bias, cast to the query's dtype; differentiable
``mask`` (boolean, True keeps)         :func:`~cudnn_attn.core.masks.keep`: folded into the bias (large negative)
``scale=None``                         ``1 / sqrt(H)``
``is_causal``                          top-left causal mask (:func:`~cudnn_attn.core.masks.causal`)
``query_seq_lengths``/                 :func:`~cudnn_attn.core.masks.padding` (the missing one is the full length); rows
``key_value_seq_lengths`` ``(B,)``     past a query length are 0, as in ``jax.nn``
``local_window_size=(l, r)`` or ``w``  :func:`~cudnn_attn.core.masks.window` ``(l, r)``: keys ``i - l <= j <= i + r``
                                       (``w`` means ``(w, w)``); with ``is_causal`` the right side is 0
=====================================  =====================================================================

The call is the native :func:`~.api.attention` with that :class:`~cudnn_attn.core.masks.MaskSpec`.
Every argument is checked before anything is computed, and errors name the drop-in's own arguments
(``query_seq_lengths``, ``local_window_size``, ``is_causal``, ...). Refused with a ``ValueError``:
anything but arrays for ``query``/``key``/``value``/``bias``/``mask`` and the lengths, ranks other
than 3 or 4, empty dimensions, float32/float64 inputs (cuDNN attention computes on float16 and
bfloat16; cast first), a non-boolean ``mask`` (``jax.nn`` requires booleans; pass additive masks as
``bias``), lengths that are not int32 ``(B,)`` or (when their values are known, or with
``check_values``) lie outside ``[0, T]`` / ``[0, S]``, and window sizes that are not ints ``>= 0``.
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


def _check_arrays(query: Any, key: Any, value: Any) -> bool:
    """Q/K/V are arrays of rank 4 ``(B, T, N, H)`` or 3 ``(T, N, H)``, alike and without empty dimensions;
    returns whether they are unbatched (rank 3)."""
    arrays = {"query": query, "key": key, "value": value}
    for name, x in arrays.items():
        if not is_array(x):
            raise ValueError(f"{name}: expected an array, got {type(x).__name__}")
        if x.ndim not in (3, 4):
            raise ValueError(f"{name}: must have rank 4 (B, T, N, H) or 3 (T, N, H), got {_describe(x)}")
        if 0 in x.shape:
            raise ValueError(f"{name}: every dimension must be >= 1, got {_describe(x)}")
    if not query.ndim == key.ndim == value.ndim:
        raise ValueError("query/key/value: must have the same rank, got "
                         + ", ".join(f"{n}={_describe(x)}" for n, x in arrays.items()))
    return query.ndim == 3


def _check_lengths(name: str, lengths: Any, batch: int) -> None:
    if lengths is None:
        return
    if not is_array(lengths) or dtype_name(lengths) != "int32" or tuple(lengths.shape) != (batch,):
        raise ValueError(f"{name}: must be an int32 array of shape (B,) = ({batch},), got {_describe(lengths)}")


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
                             cuda_graph: bool | None = None, backend: str = "ffi",
                             check_values: bool | None = None) -> Any:
    """``jax.nn.dot_product_attention`` on this library's kernels (module doc for the mapping).

    ``cuda_graph``, ``backend`` and ``check_values`` are this library's options (see :mod:`.api`).
    """
    unbatched = _check_arrays(query, key, value)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise ValueError(f"is_causal: must be True or False, got {is_causal!r}")
    window = _window(local_window_size, bool(is_causal))
    batch = 1 if unbatched else query.shape[0]
    _check_lengths("query_seq_lengths", query_seq_lengths, batch)
    _check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
    for name, x in (("bias", bias), ("mask", mask)):
        if x is not None and not is_array(x):
            raise ValueError(f"{name}: expected an array or None, got {type(x).__name__}")
    if mask is not None and dtype_name(mask) != "bool":
        raise ValueError(f"mask: must be boolean (True keeps), got {_describe(mask)}; pass an additive mask as bias")

    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    if bias is not None and dtype_name(bias) in ("float16", "bfloat16", "float32", "float64"):
        bias = jnp.asarray(bias).astype(query.dtype)
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
    call = attention.arguments(query, key, value, mask=spec, bias=bias, scale=scale, cuda_graph=cuda_graph,
                               backend=backend, check_values=check_values)
    output = forward_call(call, names=NAMES).output
    return output[0] if unbatched else output
