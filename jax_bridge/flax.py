"""Flax's ``attention_fn`` on this library's kernels: ``nnx.MultiHeadAttention(attention_fn=flax_attention_fn())``.

:func:`flax_attention_fn` returns a function with the signature of ``flax.nnx.dot_product_attention`` and
``flax.linen.dot_product_attention`` (the arguments ``nnx.MultiHeadAttention`` and
``linen.MultiHeadDotProductAttention`` pass it), which runs :func:`cudnn_attn.jax_bridge.attention` (or, with
``softcap``/``score_mod``, :func:`cudnn_attn.jax_bridge.dot_product_attention`).  Flax is not imported here.

=======================================  ==========================================================================
Flax's argument                          here
=======================================  ==========================================================================
``query``/``key``/``value``              ``[batch..., length, heads, features]``: the batch dimensions are flattened
                                         into one (none: a batch of 1); key/value heads may divide the query heads
``mask``, float 0/1 or boolean,          a keep-mask (non-zero keeps, as Flax's ``jnp.where(mask, ...)``), as built by
broadcastable to                         ``make_attention_mask``, ``make_causal_mask``, ``combine_masks``; folded into
``[batch..., heads, q_len, kv_len]``     the bias with a large finite negative number, so a fully masked query row
                                         averages uniformly over its keys, as in Flax.  A
                                         :class:`cudnn_attn.MaskSpec` (``padding(q_lengths, kv_lengths)``,
                                         ``segments(...)``, ...) is taken as it is: lengths instead of a dense mask
``bias``                                 additive, broadcastable like ``mask``, cast to the computation dtype
``is_causal``                            top-left causal mask (or the factory's alignment)
``dtype``                                the computation dtype: Q/K/V are cast to it (default: their promoted dtype);
                                         it must be float16 or bfloat16 (cuDNN's), unless ``compute_dtype`` is set
``dropout_rate``, ``deterministic``,     cuDNN's dropout (Philox, one independent mask per batch row and head), when
``dropout_rng``, ``broadcast_dropout``   ``deterministic`` is False and the rate > 0 (below)
``precision``                            accepted, no effect: cuDNN multiplies float16/bfloat16 inputs with float32
                                         accumulation and a float32 softmax whatever it says
``module``                               accepted; nothing is sown: the fused kernel never forms the attention
                                         weights (``sow_weights=True`` gives no ``attention_weights``)
``force_fp32_for_softmax`` (linen)       accepted, no effect: cuDNN's softmax is float32 always
``einsum_dot_general``,                  must be None: the fused kernel runs no einsum (``ValueError``)
``qk_attn_weights_einsum``,
``attn_weights_value_einsum`` (linen)
=======================================  ==========================================================================

Dropout.  Flax's default ``broadcast_dropout=True`` shares one mask over the batch and the heads; cuDNN
draws an independent one for every batch row and head, which is Flax's ``broadcast_dropout=False``: active
dropout with ``broadcast_dropout=True`` raises a ``ValueError`` (set ``broadcast_dropout=False`` on the
module).  ``dropout_rng`` (traced under ``jit`` or not) goes to :func:`cudnn_attn.jax_bridge.attention`'s
``dropout_rng``: cuDNN reads the seed from the device at launch, so a compiled training step draws a fresh
mask from every new key (:mod:`cudnn_attn.jax_bridge.dropout`).  With ``dropout_seed=N`` the factory binds
that static seed instead (one mask per compiled program, as JAX's own cuDNN attention); with
``softcap``/``score_mod`` (the seed form, which takes a static seed only) the seed is derived from a concrete
``dropout_rng``, and a traced one raises a ``ValueError`` unless ``dropout_seed`` is given.  On the CPU the
NumPy reference draws its mask from the seed with NumPy, not cuDNN's Philox stream.

The factory's options are what Flax's default attention lacks (all keyword-only, checked when the
factory is called): ``is_causal`` (ORed with the per-call ``is_causal``), ``diagonal_alignment``
(``"top_left"``/``"bottom_right"``, for the causal mask and the window), ``window`` (``(left, right)``: keys
``i - left <= j <= i + right``; an int ``w`` is ``(w, 0)``), ``sink`` (float32 ``(heads,)`` attention-sink
logits: an array, or a callable returning one at each call), ``softcap`` (``c * tanh(score / c)`` via
``score_mod``), ``score_mod``, ``scale`` (default ``1/sqrt(features)``, as Flax), ``compute_dtype`` (cast
Q/K/V and the bias to float16/bfloat16 for the kernel and the output back), ``dropout_seed``, and the JAX
bridge's ``cuda_graph``, ``backend`` and ``check_values``.  Packed sequences are data of each call:
pass ``mask=cudnn_attn.segments(q_lengths, kv_lengths, q_offsets, kv_offsets)`` to the module's call.
With ``softcap``/``score_mod`` a window must end at the diagonal (``right == 0``), the seed form's sliding
window.
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from cudnn_attn.core import masks
from cudnn_attn.core.types import MaskType
from cudnn_attn.core.validation import dtype_name, is_array

from .api import attention, dot_product_attention

__all__ = ["flax_attention_fn"]

_KERNEL_DTYPES = ("float16", "bfloat16")
_SEED_RANGE = 2 ** 63


def _describe(x: Any) -> str:
    return f"{dtype_name(x)}{list(x.shape)}" if is_array(x) else type(x).__name__


def _window(window: Any) -> tuple[int, int] | None:
    def whole(w: Any) -> bool:
        return isinstance(w, numbers.Integral) and not isinstance(w, (bool, np.bool_)) and w >= 0

    if window is None:
        return None
    if whole(window):
        return int(window), 0
    if isinstance(window, (tuple, list)) and len(window) == 2 and all(whole(w) for w in window):
        return int(window[0]), int(window[1])
    raise ValueError(f"window: expected an int >= 0 or a pair (left, right) of ints >= 0, got {window!r}")


def _positive_float(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a finite float > 0 or None, got {value!r}")
    return float(value)


def _kernel_dtype(name: str, dtype: Any) -> Any:
    if dtype is None:
        return None
    try:
        found = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"{name}: expected a dtype, got {dtype!r}") from None
    if found.name not in _KERNEL_DTYPES:
        raise ValueError(f"{name}: must be float16 or bfloat16 (cuDNN's input dtypes), got {found.name}")
    return found


def _seed(dropout_rng: Any, dropout_seed: int | None) -> int:
    """The static dropout seed of a call that takes one (``dropout_seed`` given, or the seed form of
    softcap/score_mod): ``dropout_seed``, else one derived from a concrete ``dropout_rng``."""
    if dropout_seed is not None:
        return dropout_seed
    if dropout_rng is None:
        raise ValueError("dropout_rng: required when dropout_rate > 0 and deterministic is False (as in Flax)")
    data = jax.random.key_data(dropout_rng) if jnp.issubdtype(jnp.asarray(dropout_rng).dtype,
                                                               jax.dtypes.prng_key) else dropout_rng
    try:
        words = np.asarray(data).astype(np.uint64).ravel()
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        raise ValueError("dropout_rng: traced (under jit), but with softcap/score_mod the call takes the seed "
                         "form, whose dropout seed is a Python int bound when the call is traced; pass "
                         "flax_attention_fn(dropout_seed=N) to accept one fixed dropout mask per compiled program, "
                         "or run with deterministic=True") from None
    seed = 0
    for word in words:
        seed = (seed * 0x100000001B3 + int(word) + 1) % _SEED_RANGE
    return seed


def _batch_4d(x: Any, name: str, batch: tuple[int, ...], heads: int, q_len: int, kv_len: int) -> Any:
    """``x`` broadcastable to ``[batch..., heads, q_len, kv_len]`` as ``(1 | B, 1 | heads, q_len, kv_len)``."""
    full = (*batch, heads, q_len, kv_len)
    if not is_array(x) or x.ndim > len(full):
        raise ValueError(f"{name}: expected an array broadcastable to [batch..., heads, q_length, kv_length] = "
                         f"{list(full)}, got {_describe(x)}")
    x = jnp.reshape(x, (1,) * (len(full) - x.ndim) + tuple(x.shape))
    try:
        np.broadcast_shapes(x.shape, full)
    except ValueError:
        raise ValueError(f"{name}: {_describe(x)} does not broadcast to [batch..., heads, q_length, kv_length] = "
                         f"{list(full)}") from None
    lead = x.shape[:len(batch)]
    rows = 1 if all(n == 1 for n in lead) else math.prod(batch)
    x = jnp.broadcast_to(x, (*(lead if rows == 1 else batch), x.shape[-3], q_len, kv_len))
    return jnp.reshape(x, (rows, x.shape[-3], q_len, kv_len))


def _flat(x: Any, name: str, batch: tuple[int, ...]) -> Any:
    if not is_array(x) or x.ndim < 3:
        raise ValueError(f"{name}: expected an array [batch..., length, heads, features], got {_describe(x)}")
    if tuple(x.shape[:-3]) != batch:
        raise ValueError(f"{name}: batch dimensions {list(x.shape[:-3])} differ from the query's {list(batch)}")
    return jnp.reshape(x, (math.prod(batch), *x.shape[-3:]))


def _seed_form(query: Any, key: Any, value: Any, spec: masks.MaskSpec, bias: Any, score_mod: Callable,
               options: dict[str, Any]) -> Any:
    """The call on the seed form, the one that takes ``score_mod`` (windows ending at the diagonal only)."""
    if spec.right_bound not in (None, 0):
        raise ValueError(f"window: with softcap/score_mod the window must end at the diagonal (right == 0), "
                         f"got {spec.describe()}")
    padded = spec.q_lengths is not None
    mask_type = {(False, False): MaskType.NO_MASK, (True, False): MaskType.CAUSAL,
                 (False, True): MaskType.PADDING, (True, True): MaskType.PADDING_CAUSAL}[(spec.causal, padded)]
    return dot_product_attention(query, key, value, bias, **spec.seed_arrays(), mask_type=mask_type,
                                 sliding_window_length=spec.left_bound, score_mod=score_mod,
                                 diagonal_alignment=spec.alignment.value, **options)


def flax_attention_fn(*arrays: Any, is_causal: bool = False, diagonal_alignment: str = "top_left", window: Any = None,
                      sink: Any = None, softcap: float | None = None, score_mod: Callable[..., Any] | None = None,
                      scale: float | None = None, compute_dtype: Any = None, dropout_seed: int | None = None,
                      cuda_graph: bool | None = None, backend: str = "ffi", check_values: bool | None = None,
                      **unknown: Any) -> Callable[..., Any]:
    """An ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` / ``flax.linen.MultiHeadDotProductAttention``
    that runs cuDNN attention (module doc: the arguments, the options, dropout).  A factory: the module takes
    ``attention_fn=flax_attention_fn()``, called, with any options.

    Raises:
        ValueError: an option is malformed or unknown (named in the message), or the factory itself was given as
            the module's ``attention_fn`` and is being called with Flax's arrays.
    """
    if arrays:
        raise ValueError("attention_fn: flax_attention_fn is a factory; call it: attention_fn=flax_attention_fn() "
                         "(with options, e.g. flax_attention_fn(is_causal=True)), not attention_fn=flax_attention_fn")
    if unknown:
        options = [name for name in inspect.signature(flax_attention_fn).parameters if name not in ("arrays",
                                                                                                    "unknown")]
        raise ValueError(f"{', '.join(sorted(unknown))}: not an option of flax_attention_fn (its options: "
                         f"{', '.join(options)}); Flax's own arguments go to the module's call")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise ValueError(f"is_causal: must be True or False, got {is_causal!r}")
    try:
        masks.causal(diagonal_alignment)                   # the alignment's rule, named as the factory names it
    except ValueError as exc:
        raise ValueError(f"diagonal_alignment: {str(exc).removeprefix('mask: alignment ')}") from None
    static = masks.MaskSpec()
    if is_causal:
        static = static & masks.causal(diagonal_alignment)
    bounds = _window(window)
    if bounds is not None:
        static = static & masks.window(*bounds, alignment=diagonal_alignment)
    softcap = _positive_float("softcap", softcap)
    if softcap is not None and score_mod is not None:
        raise ValueError("softcap/score_mod: give one of them (softcap is the score_mod c * tanh(score / c))")
    if score_mod is not None and not callable(score_mod):
        raise ValueError(f"score_mod: must be callable as score_mod(score), got {score_mod!r}")
    if softcap is not None:
        def softcapped(score: Any) -> Any:
            return softcap * jnp.tanh(score / softcap)
        score_mod = softcapped
    scale = _positive_float("scale", scale)
    compute_dtype = _kernel_dtype("compute_dtype", compute_dtype)
    if dropout_seed is not None and (isinstance(dropout_seed, bool) or not isinstance(dropout_seed, numbers.Integral)
                                     or not 0 <= dropout_seed < _SEED_RANGE):
        raise ValueError(f"dropout_seed: expected an int in [0, 2**63) or None, got {dropout_seed!r}")
    if sink is not None and not (callable(sink) or is_array(sink)):
        raise ValueError(f"sink: expected a float32 (heads,) array, a callable returning one, or None, "
                         f"got {type(sink).__name__}")
    bridge = dict(cuda_graph=cuda_graph, backend=backend, check_values=check_values)

    def cudnn_dot_product_attention(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None,
                                    broadcast_dropout: bool = True, dropout_rng: Any = None,
                                    dropout_rate: float = 0.0, deterministic: bool = False, dtype: Any = None,
                                    precision: Any = None, module: Any = None, is_causal: bool = False,
                                    force_fp32_for_softmax: bool = False, einsum_dot_general: Any = None,
                                    qk_attn_weights_einsum: Any = None,
                                    attn_weights_value_einsum: Any = None) -> Any:
        for name, given in (("einsum_dot_general", einsum_dot_general),
                            ("qk_attn_weights_einsum", qk_attn_weights_einsum),
                            ("attn_weights_value_einsum", attn_weights_value_einsum)):
            if given is not None:
                raise ValueError(f"{name}: must be None; the fused cuDNN kernel runs no einsum")
        if not is_array(query):
            raise ValueError(f"query: expected an array [batch..., length, heads, features], got {_describe(query)}")
        batch = tuple(query.shape[:-3])
        q, k, v = (_flat(x, n, batch) for x, n in ((query, "query"), (key, "key"), (value, "value")))
        if dtype is None:
            dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
        dtype = jnp.dtype(dtype)
        kernel = compute_dtype or dtype
        if kernel.name not in _KERNEL_DTYPES:
            raise ValueError(f"query: dtype must be one of float16, bfloat16 (cuDNN's), got the computation dtype "
                             f"{kernel.name} (query {_describe(query)}); set dtype=jnp.bfloat16 on the module, or "
                             "flax_attention_fn(compute_dtype=jnp.bfloat16) to cast for the kernel only")
        q, k, v = (x.astype(kernel) for x in (q, k, v))
        heads, q_len, kv_len = q.shape[2], q.shape[1], k.shape[1]

        spec = static
        if is_causal:
            spec = spec & masks.causal(diagonal_alignment)
        if isinstance(mask, masks.MaskSpec):
            spec = spec & mask
        elif mask is not None:
            keep = _batch_4d(mask, "mask", batch, heads, q_len, kv_len)
            spec = spec & masks.keep(keep if keep.dtype == jnp.bool_ else keep != 0)
        if bias is not None:
            bias = _batch_4d(bias, "bias", batch, heads, q_len, kv_len).astype(kernel)

        rate = 0.0 if deterministic else dropout_rate
        if not isinstance(rate, numbers.Real) or not 0.0 <= rate < 1.0:
            raise ValueError(f"dropout_rate: must be in [0, 1), got {dropout_rate!r}")
        seed, rng = 42, None
        if rate > 0.0:
            if broadcast_dropout:
                raise ValueError("broadcast_dropout: cuDNN draws an independent dropout mask for every batch row "
                                 "and head (Flax's broadcast_dropout=False), not one shared mask; set "
                                 "broadcast_dropout=False on the module, or dropout_rate=0")
            if dropout_seed is None and dropout_rng is not None and score_mod is None:
                rng = dropout_rng                  # read on the device at launch: a fresh mask per key
            else:
                seed = _seed(dropout_rng, dropout_seed)
        options = dict(scale=scale, dropout_rate=float(rate), seed=seed,
                       sink=sink() if callable(sink) else sink, **bridge)
        if score_mod is None:
            out = attention(q, k, v, mask=spec, bias=bias, dropout_rng=rng, **options).output
        else:
            options["scale"] = q.shape[-1] ** -0.5 if scale is None else scale
            out = _seed_form(q, k, v, spec, bias, score_mod, options)
        return jnp.reshape(out, (*batch, *out.shape[1:])).astype(dtype)

    return cudnn_dot_product_attention
