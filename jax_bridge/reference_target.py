"""The CPU target: the NumPy reference (:mod:`cudnn_attn.reference`) behind the same call sites.

Two ways to reach it from XLA:

* the named FFI target (:data:`TARGET`, platform ``cpu``): the handler views XLA's host buffers as
  NumPy arrays (zero copy), runs the reference and writes into XLA's result buffers.  This is the
  mechanism the GPU uses, so CPU tests exercise ``jit``, ``vmap``, ``grad``, ``shard_map`` and
  automatic partitioning on the very lowering path of the GPU;
* ``jax.pure_callback`` (:func:`reference_callback`, :attr:`Backend.CALLBACK`), for environments
  where an FFI target cannot be registered.

Both refuse at lowering what the cuDNN target would refuse on the CPU fronts' GPU target
(:mod:`cudnn_attn.core.cpu_target`), as the cuDNN target refuses what its GPU cannot run.

Dropout uses NumPy's generator seeded with the call site's seed (the reference's convention), not
cuDNN's Philox stream.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from cudnn_attn import reference
from cudnn_attn.core import cpu_target
from cudnn_attn.core.types import Front
from cudnn_attn.engine import call_steps

from . import ffi
from .call_site import TARGET, AttentionCall, registry
from .signature import FWD, operand_names, result_shapes


def reference_results(site: AttentionCall, arrays: Sequence[Any]) -> dict[str, np.ndarray]:
    """Run the reference for call site ``site`` on the bound arrays; ``result name -> array``."""
    config = site.config
    operands, residuals = call_steps.attention_operands(config, site.kind,
                                                        dict(zip(operand_names(config, site.kind), arrays)))
    if site.kind == FWD:
        result = reference.forward(config, operands, seed=site.seed)
    else:
        result = reference.backward(config, operands, residuals["output"], residuals["grad_output"],
                                    residuals["logsumexp"], seed=site.seed)
    return {name: np.asarray(getattr(result, name)) for name in site.results}


def _run(call: ffi.Call) -> None:
    site = registry.call(call.int64_attribute("key"))
    arrays = [ffi.host_array(buffer, writeable=False) for buffer in call.args]
    results = reference_results(site, arrays)
    for name, buffer in zip(site.results, call.rets):
        value = results[name]
        if value.dtype != buffer.dtype:
            raise TypeError(f"{name}: the reference produced {value.dtype}, XLA expects {buffer.dtype}")
        np.copyto(ffi.host_array(buffer, writeable=True), value.reshape(buffer.shape))


def _instantiate(call: ffi.Call) -> Any:
    """XLA builds an executable calling this site: hold its registry entry until the executable dies."""
    key = call.int64_attribute("key")
    registry.call(key)                     # a key of another process fails at compile time, not at run time
    return registry.holds.pin(key)


HANDLER = ffi.make_handler(TARGET, _run, instantiate=_instantiate)


def lower(ctx: Any, *args: Any, kind: str, config: Any, options: Any) -> Any:
    """Lowering of the inner primitive on CPU: one call of the reference FFI target (``cuda_graph`` has no
    meaning here: command buffers are a GPU feature)."""
    import jax

    cpu_target.check(config, kind=kind, front=Front.JAX)
    key = registry.key(AttentionCall(config, kind, options.seed))
    return jax.ffi.ffi_lowering(TARGET)(ctx, *args, key=np.int64(key))


def reference_callback(site: AttentionCall, *arrays: Any) -> list[Any]:
    """The call site as ``jax.pure_callback`` (host copies of the operands; any platform)."""
    import jax

    cpu_target.check(site.config, kind=site.kind, front=Front.JAX)
    shapes = result_shapes(site.config, site.kind)
    result_types = [jax.ShapeDtypeStruct(*shapes[name]) for name in site.results]

    def host(*values: Any) -> tuple[np.ndarray, ...]:
        results = reference_results(site, [np.asarray(v) for v in values])
        return tuple(results[name].reshape(shapes[name][0]) for name in site.results)

    return list(jax.pure_callback(host, result_types, *arrays))
