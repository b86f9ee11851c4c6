"""A drop-in for ``jax.nn.dot_product_attention`` that runs this library's attention.

:func:`dot_product_attention_nn` takes ``jax.nn.dot_product_attention``'s arguments and follows its
semantics, translated onto the library's configuration:

=====================================  =====================================================================
``jax.nn``                             here
=====================================  =====================================================================
``query`` ``(B, T, N, H)`` / ``(T, N, H)``  BTNH layout (a missing batch dimension is added and removed)
``key``/``value`` with ``K`` heads     grouped-query attention (``N`` a multiple of ``K``)
``bias`` broadcastable to (B, N, T, S)  additive bias, cast to the query's dtype; differentiable
``mask`` (boolean, True keeps)         folded into the bias with a large negative number
``scale=None``                         ``1 / sqrt(H)``
``is_causal``                          top-left causal mask (``MaskType.CAUSAL``)
``query_seq_lengths``/                 padding mask (the missing one is the full length); output rows
``key_value_seq_lengths`` ``(B,)``     past a query length are 0, as in ``jax.nn``
``local_window_size=(l, r)`` or ``w``  keys ``j`` with ``i - l <= j <= i + r`` (``w`` means ``(w, w)``);
                                       with ``is_causal`` the right side is 0
=====================================  =====================================================================

Refused with a ``ValueError``: float32/float64 inputs (cuDNN attention computes on float16 and
bfloat16; cast first), a non-boolean ``mask`` (``jax.nn`` requires booleans; pass additive masks as
``bias``), and negative window sizes.  ``return_residual`` and ``implementation`` are not part of the
drop-in: the logsumexp is available from :func:`~.api.dot_product_attention`.  A query row whose keys
are all masked out (by ``mask``) attends uniformly to the masked keys, as in ``jax.nn``'s XLA path,
because the boolean mask becomes a finite additive bias.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax.numpy as jnp

from cudnn_attn.types import MaskType
from cudnn_attn.validation import prepare

from .api import attention, kernel_options


def _window(local_window_size: Any, is_causal: bool) -> tuple[int, int] | None:
    if local_window_size is None:
        return None
    window = (local_window_size, local_window_size) if isinstance(local_window_size, numbers.Integral) \
        else tuple(local_window_size)
    if len(window) != 2 or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= 0
                                   for w in window):
        raise ValueError(f"local_window_size: expected an int >= 0 or a pair (left, right) of ints >= 0, "
                         f"got {local_window_size!r}")
    left, right = (int(w) for w in window)
    return left, 0 if is_causal else right


def dot_product_attention_nn(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, *,
                             scale: float | None = None, is_causal: bool = False, query_seq_lengths: Any = None,
                             key_value_seq_lengths: Any = None, local_window_size: Any = None,
                             cuda_graph: bool | None = None, backend: str = "ffi") -> Any:
    """``jax.nn.dot_product_attention`` on this library's kernels (module doc for the mapping).

    ``cuda_graph`` and ``backend`` are this library's execution options (see :mod:`.api`).
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise ValueError(f"mask: must be boolean (True keeps), got {mask.dtype}{list(mask.shape)}; "
                             "pass an additive mask as bias")
    if bias is not None:
        bias = jnp.asarray(bias).astype(query.dtype)
    padding = query_seq_lengths is not None or key_value_seq_lengths is not None
    if padding:
        batch = query.shape[0]
        if query_seq_lengths is None:
            query_seq_lengths = jnp.full((batch,), query.shape[1], jnp.int32)
        if key_value_seq_lengths is None:
            key_value_seq_lengths = jnp.full((batch,), key.shape[1], jnp.int32)
    mask_type = {(False, False): MaskType.NO_MASK, (True, False): MaskType.CAUSAL,
                 (False, True): MaskType.PADDING, (True, True): MaskType.PADDING_CAUSAL}[(bool(is_causal), padding)]
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    config, operands = prepare(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths,
                               scale=scale, mask_type=mask_type, qkv_layout="BTNH", xp=jnp)
    window = _window(local_window_size, bool(is_causal))
    if window is not None:
        left, right = window
        # Keys with i - left <= j <= i + right:  d = j - i <= right  and  -d < left + 1.
        config = config.replace(mask=dataclasses.replace(config.mask, right_bound=right, left_bound=left + 1))
    output = attention(config, operands, kernel_options(config, backend=backend, cuda_graph=cuda_graph)).output
    return output[0] if unbatched else output

