"""The two attention primitives (forward, backward), registered once by :class:`AttentionPrimitive`.

Each kind is a pair of JAX primitives whose only static parameters are the
:class:`~cudnn_attn.core.config.AttentionConfig` (what to compute) and the
:class:`~.call_site.CallOptions` (dropout seed, backend, CUDA graphs):

* the *outer* primitive carries the transformation rules: abstract evaluation, batching
  (:mod:`.batching`), and a lowering through ``custom_partitioning`` with Shardy rules
  (:mod:`.partitioning`), so that under automatic sharding every device runs the inner primitive on its shard;
* the *inner* primitive is the call itself, lowered per platform: on CPU to the reference FFI
  target (:mod:`.reference_target`), on CUDA to the cuDNN FFI target (:mod:`.cudnn_target`).  With
  ``Backend.CALLBACK`` the outer primitive lowers to ``jax.pure_callback`` instead (no partitioning).

Operands and results are named (:mod:`.signature`); :meth:`AttentionPrimitive.__call__` takes and
returns ``name -> array`` dicts, so no rule ever indexes an operand list.

Both primitives are added to ``jax._src.dispatch.prim_requires_devices_during_lowering`` (a private
set, as in JAX's own cuDNN attention and TransformerEngine): ``custom_partitioning`` needs the device
assignment while lowering, and so does the cuDNN lowering, which builds the graph for those devices.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
from jax._src import dispatch
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from cudnn_attn.core.config import AttentionConfig

from . import batching as batching_rules
from . import context_parallel, cudnn_target, ffi, partitioning, reference_target
from .call_site import AttentionCall, Backend, CallOptions, registry
from .signature import (
    BWD,
    FWD,
    GRADIENT_OF,
    RESULT_FOLLOWS,
    dimension_roles,
    operand_names,
    result_names,
    result_shapes,
)


@functools.lru_cache(maxsize=256)
def _compiled(primitive: Primitive, config: AttentionConfig, options: CallOptions) -> Any:
    return jax.jit(functools.partial(primitive.bind, config=config, options=options))


def _eager(primitive: Primitive, *operands: Any, config: AttentionConfig, options: CallOptions) -> Any:
    """A primitive bound outside any trace: its ``jit`` (one per primitive and parameters), as JAX runs its own."""
    return _compiled(primitive, config, options)(*operands)


class AttentionPrimitive:
    """The forward or backward attention operation as a pair of JAX primitives (see the module doc)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.outer = Primitive(f"cudnn_attention_{kind}")
        self.inner = Primitive(f"cudnn_attention_{kind}_inner")
        for primitive in (self.outer, self.inner):
            primitive.multiple_results = True
            primitive.def_abstract_eval(self._abstract_eval)
            primitive.def_impl(functools.partial(_eager, primitive))
            dispatch.prim_requires_devices_during_lowering.add(primitive)
        batching.primitive_batchers[self.outer] = functools.partial(batching_rules.batch, self)
        mlir.register_lowering(self.outer, self._lower)
        mlir.register_lowering(self.inner, functools.partial(reference_target.lower, kind=kind), platform="cpu")
        mlir.register_lowering(self.inner, functools.partial(cudnn_target.lower, kind=kind), platform="cuda")
        self._partitioned = custom_partitioning(self._call_inner, static_argnums=(0, 1))
        self._partitioned.def_partition(
            partition=functools.partial(partitioning.partition, self),
            infer_sharding_from_operands=functools.partial(partitioning.infer_result_shardings, kind),
            sharding_rule=functools.partial(partitioning.sharding_rule, kind),
        )

    def __repr__(self) -> str:
        return f"AttentionPrimitive({self.kind!r})"

    # -- binding ----------------------------------------------------------------------------------
    def __call__(self, config: AttentionConfig, options: CallOptions, operands: Mapping[str, Any]) -> dict[str, Any]:
        """Bind the outer primitive on named operands; returns the named results."""
        return self._bind(self.outer, config, options, operands)

    def call_inner(self, config: AttentionConfig, options: CallOptions,
                    operands: Mapping[str, Any]) -> dict[str, Any]:
        """Bind the inner primitive directly (inside a partitioned computation: no further rules)."""
        return self._bind(self.inner, config, options, operands)

    def _bind(self, primitive: Primitive, config: AttentionConfig, options: CallOptions,
              operands: Mapping[str, Any]) -> dict[str, Any]:
        names = operand_names(config, self.kind)
        if set(operands) != set(names):
            raise ValueError(f"operands: the {self.kind} of {config.describe()} takes {list(names)}, "
                             f"got {sorted(operands)}")
        results = primitive.bind(*(operands[name] for name in names), config=config, options=options)
        return dict(zip(result_names(config, self.kind), results))

    def _call_inner(self, config: AttentionConfig, options: CallOptions, *arrays: Any) -> list[Any]:
        """The unpartitioned call (one device).  ``custom_partitioning`` also traces it on sharded operands
        but then runs :func:`~.partitioning.partition` instead, which handles their sequence split."""
        split = partitioning.unsharded_split(config, options)
        if split is not None and not partitioning.any_sharded(arrays):   # a load-balanced order, one device
            found = context_parallel.run(self.kind, config, split, dict(zip(operand_names(config, self.kind), arrays)),
                                         lambda block, ops: self.call_inner(block, options, ops))
            return list(found.values())
        return self.inner.bind(*arrays, config=config, options=options)

    # -- rules ------------------------------------------------------------------------------------
    def _abstract_eval(self, *avals: Any, config: AttentionConfig, options: CallOptions) -> list[Any]:
        named = dict(zip(operand_names(config, self.kind), avals))
        partitioning.check_types(config, self.kind, named, options)   # Explicit mesh axes: refuse bad sharding now
        return [_result_aval(config, name, shape, dtype, named)
                for name, (shape, dtype) in result_shapes(config, self.kind).items()]

    def _lower(self, ctx: Any, *args: Any, config: AttentionConfig, options: CallOptions) -> Any:
        if options.backend is Backend.CALLBACK:
            site = AttentionCall(config, self.kind, options.seed)
            return mlir.lower_fun(functools.partial(reference_target.reference_callback, site),
                                  multiple_results=True)(ctx, *args)
        return mlir.lower_fun(functools.partial(self._partitioned, config, options), multiple_results=True)(ctx, *args)


def _result_aval(config: AttentionConfig, name: str, shape: tuple[int, ...], dtype: Any,
                 operands: Mapping[str, Any]) -> Any:
    """The aval of result ``name``, derived from an operand aval with ``update`` so that it keeps the
    mesh and the shard_map manual axes (a fresh ``ShapedArray`` would drop them).

    A gradient is placed like its input; on other results the dimensions split on the operands (batch,
    heads) are split the same way.  The shard_map varying axes are those of all operands together (the
    result depends on every operand).
    """
    from jax.sharding import NamedSharding, PartitionSpec

    query = operands["query"]
    source = operands.get(RESULT_FOLLOWS.get(name, "query"), query)
    varying = frozenset().union(*(aval.mat.varying for aval in operands.values()))
    mat = source.mat if varying == source.mat.varying else source.mat.update(varying=varying)
    if name in GRADIENT_OF.values() and tuple(shape) == source.shape:      # a gradient: placed like its input
        return source.update(dtype=dtype, weak_type=False, manual_axis_type=mat)
    spec_of = {}
    for operand_name, aval in operands.items():
        spec = tuple(aval.sharding.spec) + (None,) * aval.ndim
        for role, entry in zip(dimension_roles(config, operand_name, aval.ndim), spec):
            if role is not None:
                spec_of.setdefault(role, entry)
    spec_of.setdefault("bm", spec_of.get("b"))
    roles = dimension_roles(config, name, len(shape))
    sharding = NamedSharding(source.sharding.mesh, PartitionSpec(*(spec_of.get(r) if r else None for r in roles)))
    return source.update(shape=tuple(shape), dtype=dtype, weak_type=False, sharding=sharding, manual_axis_type=mat)


forward = AttentionPrimitive(FWD)
backward = AttentionPrimitive(BWD)

# The FFI targets the inner primitive lowers to (CUDA registrations wait for the CUDA plugin, if any).  Call-site
# entries and plans are released only when every target reports the death of its executables (call_site.Holds).
_cpu_stateful = ffi.register(reference_target.HANDLER, "cpu")
_gpu_stateful = all([ffi.register(_handler, "CUDA") for _handler in cudnn_target.HANDLERS])
cudnn_target.plan_holds.releasing = _gpu_stateful
registry.holds.releasing = _cpu_stateful and _gpu_stateful
