"""Dropout from a JAX PRNG key: the cuDNN Philox seed and offset as device operands of the call.

cuDNN reads the dropout seed and offset (int64 each) from device memory at launch when the graph declares them
as tensors (``AttentionConfig.device_seed``; :data:`~cudnn_attn.engine.call.DROPOUT_OPERANDS`), so a traced key
gives a fresh mask at every step of one compiled program.  JAX without ``jax_enable_x64`` has no int64, so each
is a uint32 ``(2,)`` array, the int64's two words, low first (the 8 bytes cuDNN reads).

* :func:`seed_operands`: the seed from ``jax.random.bits(key)``, the offset 0.  The same key gives the same
  seed, so the forward and its backward (which reads the forward's operands) draw the same mask.
* :func:`for_part`: the seed of part ``index`` of a call split into independent cuDNN calls (a shard of a
  batch- or head-sharded call, an instance of ``vmap`` over keys): ``index * 0x9E3779B9`` is XORed into the
  seed's high word, so parts draw independent Philox streams; part 0 keeps the key's seed.

What cuDNN's Philox allows: its mask of element ``(b, h, t, s)`` is a function of the seed, the offset and that
element's position *within the call* (the kernel's tile and thread).  A shard is its own call whose positions
start at 0, and the kernel's counter layout is not documented, so no offset makes a shard draw the part of the
unsharded mask that it holds: the same key gives the same mask only at the same sharding and the same
``vmap`` shape.  A ``vmap`` over one shared key folds the instances into the batch of one call, which draws
one mask whose rows differ per instance.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

_MIX = 0x9E3779B9


def seed_operands(key: Any) -> tuple[Any, Any]:
    """``(dropout_seed, dropout_offset)``, uint32 ``(2,)`` each, from a PRNG key (a typed key or the legacy
    uint32 ``(2,)`` key data), traced or not.

    Raises:
        ValueError: ``key`` is not a PRNG key.
    """
    typed = hasattr(key, "dtype") and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if not typed and not (hasattr(key, "shape") and hasattr(key, "dtype") and key.dtype == jnp.uint32
                          and tuple(key.shape) == (2,)):
        shown = f"{key.dtype}{list(key.shape)}" if hasattr(key, "shape") else type(key).__name__
        raise ValueError(f"dropout_rng: expected a JAX PRNG key (jax.random.key(n), or the uint32 (2,) data of "
                         f"jax.random.PRNGKey(n)), got {shown}")
    if typed and key.shape != ():
        raise ValueError(f"dropout_rng: expected one PRNG key (shape ()), got shape {tuple(key.shape)}")
    seed = jax.random.bits(key, (2,), jnp.uint32)
    return seed, jnp.zeros((2,), jnp.uint32)


def for_part(seed: Any, index: Any) -> Any:
    """The seed words of part ``index`` (an int32 scalar, traced or not) of a split call (module doc)."""
    mix = jnp.asarray(index).astype(jnp.uint32) * jnp.uint32(_MIX)
    return seed.at[1].set(seed[1] ^ mix)
