"""A small causal transformer trained under ``jax.jit``, as users train: not a test by itself.

    python benchmarks/train_step.py --impl ours|jax [--gpus 1|2] [--size tiny|small|wide] [--steps 5]
        [--cuda-graph on|off] [--threads 4] [--shard-map] [--watchdog 120] [--json FILE]

The model: ``--layers`` pre-norm blocks (causal attention with ``--heads`` heads, a 4x MLP), scanned with
``lax.scan`` over ``jax.checkpoint``-ed layers; ``jax.value_and_grad`` of a mean-squared loss, plain
SGD, parameters donated; the batch sharded over a ``("dp",)`` mesh of ``--gpus`` GPUs.  The attention is
``cudnn_attn.jax_bridge.dot_product_attention(..., mask_type=CAUSAL)`` (``--impl ours``) or
``jax.nn.dot_product_attention(..., implementation="cudnn")`` (``--impl jax``); parameters and data
come from fixed seeds, so both impls train the same model on the same data.

Modes:
* default: ``--steps`` training steps; prints one JSON line with the losses and the per-step wall times;
* ``--threads N``: after one step, N Python threads evaluate the (non-donating) loss and gradients of
  the same batch at once; every thread's result must equal the single-thread one (``threads_equal``);
* ``--shard-map``: the attention inside ``jax.shard_map`` over the mesh, followed by a ``psum``.

A watchdog (``faulthandler.dump_traceback_later``) prints every thread's stack and exits with code 3
when the run does not finish in ``--watchdog`` seconds, so a hang fails a caller instead of blocking it.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import threading
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

SIZES = {
    "tiny": dict(layers=1, d_model=256, heads=4, seq=256, batch=4),      # host-bound: JAX's dispatch sets the step time
    "small": dict(layers=2, d_model=512, heads=8, seq=512, batch=8),     # the GPU test (seconds)
    "wide": dict(layers=4, d_model=1024, heads=16, seq=2048, batch=16),  # device-bound: attention is most of the step
}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=("ours", "jax"), default="ours")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--cuda-graph", choices=("on", "off"), default="on",
                   help="ours only: let XLA capture the call into CUDA graphs (on, the default) or not")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--shard-map", action="store_true")
    p.add_argument("--watchdog", type=float, default=120.0)
    p.add_argument("--json", default=None, help="also append the result line to this file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    faulthandler.dump_traceback_later(args.watchdog, exit=True)   # a hang prints the stacks and exits
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    size = SIZES[args.size]
    L, D, H, T, B = size["layers"], size["d_model"], size["heads"], size["seq"], size["batch"]
    hd = D // H
    devices = jax.devices("gpu")[:args.gpus] if jax.default_backend() == "gpu" else jax.devices()[:args.gpus]
    mesh = jax.sharding.Mesh(np.array(devices), ("dp",))
    dtype = jnp.bfloat16

    if args.impl == "ours":
        from cudnn_attn import MaskType
        from cudnn_attn.jax_bridge import dot_product_attention as ours

        def attention(q, k, v):
            return ours(q, k, v, scale=hd ** -0.5, mask_type=MaskType.CAUSAL, cuda_graph=args.cuda_graph == "on")
    else:
        def attention(q, k, v):
            implementation = "cudnn" if jax.default_backend() == "gpu" else None
            return jax.nn.dot_product_attention(q, k, v, scale=hd ** -0.5, is_causal=True,
                                                implementation=implementation)

    def init(key):
        k = jax.random.split(key, 4)
        normal = lambda key, shape, fan_in: (jax.random.normal(key, shape, jnp.float32) / fan_in ** 0.5).astype(dtype)
        return {"qkv": normal(k[0], (L, D, 3 * D), D), "out": normal(k[1], (L, D, D), D),
                "up": normal(k[2], (L, D, 4 * D), D), "down": normal(k[3], (L, 4 * D, D), 4 * D)}

    def norm(x):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(dtype)

    def block(x, p):
        q, k, v = jnp.split(norm(x) @ p["qkv"], 3, axis=-1)
        q, k, v = (t.reshape(t.shape[0], T, H, hd) for t in (q, k, v))
        x = x + attention(q, k, v).reshape(x.shape) @ p["out"]
        return x + jax.nn.gelu(norm(x) @ p["up"]) @ p["down"], None

    def loss_fn(params, x, y):
        out, _ = jax.lax.scan(jax.checkpoint(block), x, params)
        return jnp.mean((out.astype(jnp.float32) - y.astype(jnp.float32)) ** 2)

    replicated, batch_sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    grad_fn = jax.value_and_grad(loss_fn)

    @jax.jit
    def loss_and_grad(params, x, y):
        return grad_fn(params, x, y)

    def sgd(params, x, y):
        loss, grads = grad_fn(params, x, y)
        return loss, jax.tree.map(lambda p, g: (p - 0.05 * g.astype(jnp.float32)).astype(p.dtype), params, grads)

    step = jax.jit(sgd, donate_argnums=0, in_shardings=(replicated, batch_sharded, batch_sharded),
                   out_shardings=(replicated, replicated))
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = jax.device_put(init(keys[0]), replicated)
    x = jax.device_put(jax.random.normal(keys[1], (B, T, D), jnp.float32).astype(dtype), batch_sharded)
    y = jax.device_put(jax.random.normal(keys[2], (B, T, D), jnp.float32).astype(dtype), batch_sharded)

    result = dict(impl=args.impl, gpus=len(devices), size=args.size, cuda_graph=args.cuda_graph)
    if args.shard_map:
        spec = P("dp")

        def sharded(q, k, v):
            return jax.lax.psum(jnp.sum(attention(q, k, v).astype(jnp.float32)), "dp")

        q = jax.device_put(jax.random.normal(keys[1], (B, T, H, hd), jnp.float32).astype(dtype), batch_sharded)
        total = jax.jit(jax.shard_map(sharded, mesh=mesh, in_specs=(spec, spec, spec), out_specs=P()))(q, q, q)
        result["shard_map_psum"] = float(total)
    losses, times = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss, params = step(params, x, y)
        loss = float(loss)                                     # waits for the step
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(loss)
    result.update(losses=losses, step_ms=times, median_step_ms=statistics.median(times[2:] or times))
    if args.threads:
        want = loss_and_grad(params, x, y)
        jax.block_until_ready(want)
        found: list = [None] * args.threads

        def run(i: int) -> None:
            found[i] = jax.block_until_ready(loss_and_grad(params, x, y))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(args.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        flat_want = jax.tree.leaves(want)
        result["threads_equal"] = all(
            r is not None and all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(r), flat_want))
            for r in found)
    faulthandler.cancel_dump_traceback_later()
    line = json.dumps(result)
    print(line, flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
