"""A short tour: ``python -m cudnn_attn.tools.demo`` (or ``./scripts/demo.sh``).

On a machine with an NVIDIA GPU it runs cuDNN's fused attention on CuPy arrays (forward, backward,
a padded/causal variant, the graph cache listing) and checks each result against the NumPy reference.
Without a GPU it says so plainly and runs the same calls through the reference and through the JAX
bridge on CPU, which uses the very FFI mechanism the GPU path uses.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import cudnn_attn
from cudnn_attn import MaskType, reference
from cudnn_attn.core.support import Environment


def _inputs(rng, B=2, T=256, S=256, N=8, K=2, H=64, dtype="float16"):
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)

    def draw(*shape):
        return rng.standard_normal(shape).astype(dtype)

    return draw(B, T, N, H), draw(B, S, K, H), draw(B, S, K, H)


def _rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def _gpu_demo(rng) -> None:
    import cupy as cp

    q, k, v = _inputs(rng)
    qd, kd, vd = (cp.asarray(a) for a in (q, k, v))
    scale = q.shape[-1] ** -0.5
    seqlen_q = np.array([256, 177], np.int32)
    seqlen_kv = np.array([256, 190], np.int32)
    cases = [
        ("GQA 8q/2kv, causal", dict(mask_type=MaskType.CAUSAL), {}),
        ("padding + causal", dict(mask_type=MaskType.PADDING_CAUSAL),
         dict(q_seqlen=seqlen_q, kv_seqlen=seqlen_kv)),
    ]
    for label, kw, arrays in cases:
        dev_arrays = {n: cp.asarray(a) for n, a in arrays.items()}
        t0 = time.perf_counter()
        out, lse = cudnn_attn.dot_product_attention(qd, kd, vd, scale=scale, return_residual=True,
                                                    **kw, **dev_arrays)
        cp.cuda.get_current_stream().synchronize()
        first = time.perf_counter() - t0
        ref_out, ref_lse = reference.dot_product_attention(q, k, v, scale=scale, return_residual=True,
                                                           **kw, **arrays)
        dout = cp.asarray(rng.standard_normal(out.shape).astype(q.dtype))
        grads = cudnn_attn.dot_product_attention_bwd(qd, kd, vd, out, dout, lse, scale=scale, **kw,
                                                     **dev_arrays)
        ref_grads = reference.dot_product_attention_bwd(q, k, v, ref_out, cp.asnumpy(dout), ref_lse,
                                                        scale=scale, **kw, **arrays)
        errs = {"out": _rel_err(cp.asnumpy(out), ref_out)}
        errs.update({n: _rel_err(cp.asnumpy(getattr(grads, n)), getattr(ref_grads, n))
                     for n in ("dq", "dk", "dv")})
        print(f"  {label:22s} first call {first * 1e3:7.1f} ms   rel. error vs float64 reference: "
              + "  ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    print("\nGraph cache (cudnn_attn.graph_cache):")
    print(cudnn_attn.graph_cache)


def _cpu_demo(rng) -> None:
    q, k, v = _inputs(rng)
    scale = q.shape[-1] ** -0.5
    t0 = time.perf_counter()
    out, lse = reference.dot_product_attention(q, k, v, scale=scale, mask_type=MaskType.CAUSAL,
                                               return_residual=True)
    print(f"  reference forward (GQA 8q/2kv, causal, fp16) {out.shape} in "
          f"{(time.perf_counter() - t0) * 1e3:.0f} ms; logsumexp {lse.shape}")
    try:
        import jax
        import jax.numpy as jnp

        from cudnn_attn import jax_bridge
    except ImportError as exc:  # pragma: no cover - jax is a dependency
        print(f"  (JAX bridge skipped: {exc})")
        return

    def loss(q, k, v):
        o = jax_bridge.dot_product_attention(q, k, v, scale=scale, mask_type=MaskType.CAUSAL)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    out_jax = jax.jit(lambda q, k, v: jax_bridge.dot_product_attention(
        q, k, v, scale=scale, mask_type=MaskType.CAUSAL))(q, k, v)
    print(f"  JAX bridge on CPU: jit forward matches the reference: "
          f"rel. error {_rel_err(out_jax, out):.1e}; jit(grad) shapes "
          f"{[tuple(g.shape) for g in grads]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    env = Environment.detect()
    print(f"cudnn_attn {cudnn_attn.__version__}; environment: {env}")
    if env.compute_capability is None:
        print("No CUDA GPU was found: cuDNN cannot run here. Running the NumPy reference and the JAX "
              "bridge on CPU instead.")
        _cpu_demo(rng)
    else:
        print("GPU found: running cuDNN fused attention on CuPy arrays.")
        _gpu_demo(rng)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
