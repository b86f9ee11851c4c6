"""cuDNN fused attention inside JAX (installed as ``cudnn_attn.jax_bridge``).

* :func:`dot_product_attention`, :func:`paged_attention` - JAX's cuDNN attention API (:mod:`.api`);
* :func:`dot_product_attention_nn` - a drop-in for ``jax.nn.dot_product_attention`` (:mod:`.nn`);
* :func:`attention` - the native call: :class:`~cudnn_attn.core.masks.MaskSpec` masks, named results
  (:class:`~cudnn_attn.core.types.AttentionOutput`); :func:`configured_attention` runs a validated
  ``(AttentionConfig, AttentionOperands)``;
* :func:`flax_attention_fn` - an ``attention_fn`` for Flax's multi-head attention modules (:mod:`.flax`;
  Flax itself is not imported);
* :class:`ContextParallel`, :func:`context_parallelism`, :func:`load_balance`, :func:`restore_order` -
  attention with the sequence sharded over devices (:mod:`.context_parallel`).

Mechanism: two primitives registered once (:mod:`.primitives`) with batching (:mod:`.batching`) and
partitioning (:mod:`.partitioning`) rules, lowered to a named XLA FFI target whose handler is Python
(:mod:`.ffi`): the cuDNN graph on XLA's stream on GPU (:mod:`.cudnn_target`), the NumPy reference on
CPU (:mod:`.reference_target`).
"""

from .api import attention, call_options, configured_attention, dot_product_attention, paged_attention
from .call_site import Backend, CallOptions
from .context_parallel import ContextParallel, Scheme, context_parallelism, load_balance, restore_order
from .flax import flax_attention_fn
from .nn import dot_product_attention_nn

__all__ = ["Backend", "CallOptions", "ContextParallel", "Scheme", "attention", "configured_attention", "context_parallelism",
           "dot_product_attention", "dot_product_attention_nn", "call_options", "flax_attention_fn", "load_balance", "paged_attention",
           "restore_order"]
