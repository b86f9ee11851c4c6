"""Tracing with JAX: a user ``score_mod`` into its spec and pointwise programs (the one layer below the JAX
bridge that imports JAX, and only inside its functions)."""
