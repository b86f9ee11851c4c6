"""JAX integration (installed as ``cudnn_attn.jax_bridge``)."""
