"""One process of the multi-process test (``test_multiprocess.py``): a jitted training step with batch, head
and sequence sharding (ring context parallelism, load-balanced) on a mesh of every process's CPU devices.

``python multiprocess_worker.py PROCESS_ID PROCESSES PORT DEVICES_PER_PROCESS OUT``: with ``PROCESSES > 1``
the process joins ``jax.distributed`` (coordinator on 127.0.0.1:PORT, CPU collectives over gloo); process 0
writes the gathered output and gradients to ``OUT`` (``.npz``).  Inputs are drawn from fixed seeds, so one
process with all the devices runs the same program on the same numbers.
"""

from __future__ import annotations

import os
import sys

process_id, processes, port, local_devices, out_path = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                                   int(sys.argv[4]), sys.argv[5])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local_devices}"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
if processes > 1:
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=processes,
                               process_id=process_id, initialization_timeout=60)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from cudnn_attn import MaskType  # noqa: E402
from cudnn_attn import jax_bridge as jb  # noqa: E402

B, T, N, K, H = 2, 64, 4, 2, 16
SP = 2                                   # the sequence axis: its two halves on different processes

devices = np.array(jax.devices()).reshape(SP, -1)           # process-major: row r holds process r's devices
mesh = Mesh(devices.reshape(SP, 2, -1), ("sp", "data", "model"))
spec = P("data", "sp", "model")
rng = np.random.default_rng(70)
q = rng.standard_normal((B, T, N, H)).astype(np.float32)
k, v = (rng.standard_normal((B, T, K, H)).astype(np.float32) for _ in range(2))
weight = rng.standard_normal((B, T, N, H)).astype(np.float32)


def put(x: np.ndarray) -> jax.Array:
    x = np.asarray(jb.load_balance(jnp.asarray(x, jnp.float16), SP))
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda index: x[index])


context = jb.ContextParallel("ring", load_balance=SP)


def loss(q, k, v, w):
    out = jb.dot_product_attention(q, k, v, scale=0.25, mask_type=MaskType.CAUSAL, context_parallel=context)
    return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32)), out


step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
(_, out), grads = step(put(q), put(k), put(v), put(weight))
assert all(d.process_index == jax.process_index() for d in out.addressable_shards[0].data.devices())
found = {name: np.asarray(jb.restore_order(multihost_utils.process_allgather(x, tiled=True), SP), np.float32)
         for name, x in zip(("output", "dq", "dk", "dv"), (out, *grads))}
if jax.process_index() == 0:
    np.savez(out_path, **found)
print(f"process {jax.process_index()} of {jax.process_count()}: ok", flush=True)
