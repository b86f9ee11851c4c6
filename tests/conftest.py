"""Session-wide test setup.

JAX must see 8 host devices for the sharding tests; the flag only works if it is set before JAX
initialises a backend, so it is set here, before any test module imports jax.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
