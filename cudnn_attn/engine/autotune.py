"""Opt-in autotuning: time every execution plan cuDNN offers for a graph and keep the fastest.

cuDNN's heuristic usually ranks the fastest plan first, but not always: for causal bf16 forward at
``T = S = 16k`` on the H200 the best plan reaches 630 TFLOP/s against 568 for the heuristic's choice.
Autotuning builds every backend plan once (``plan=ALL_PLANS``), runs each on the call's own buffers
(inputs as given, outputs as scratch: the real call runs afterwards and overwrites them), times it
with CUDA events on the call's stream (one warm-up, then the median of ``repeats`` runs), and
rebuilds the graph pinned to the winner.  The result lives in the graph cache under
``PlanChoice.AUTOTUNED``, so the cost (a few seconds) is paid once per configuration and process.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any, Callable, NamedTuple

from cudnn_attn.core.errors import UnsupportedConfigurationError
from cudnn_attn.core.support import check_supported
from cudnn_attn.persist.store import default_store

from . import runtime
from .cache import build_plan
from .plan import CallPlan

logger = logging.getLogger("cudnn_attn")


class PlanTiming(NamedTuple):
    index: int
    name: str
    milliseconds: float


def time_plans(candidates: Any, launch_arguments: Callable[[Any], tuple], *, repeats: int = 5) -> list[PlanTiming]:
    """Median device time of every plan of the all-plans graph ``candidates.built`` (fastest first).

    ``candidates`` is a :class:`~cudnn_attn.engine.plan.CallPlan` of that graph; ``launch_arguments(plan)``
    returns ``(pointers, stream, scalars)`` for a launch of ``plan``.
    """
    import cupy


    timings = []
    for info in candidates.built.plans:
        plan = CallPlan(candidates.built, candidates.context, plan_index=info.index)
        pointers, stream, scalars = launch_arguments(plan)
        external = candidates.context.stream(stream)
        plan.launch(pointers, stream, scalars=scalars)                   # warm-up (first-launch costs)
        samples = []
        for _ in range(repeats):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(external)
            plan.launch(pointers, stream, scalars=scalars)
            end.record(external)
            end.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, end))
        timings.append(PlanTiming(info.index, info.name, statistics.median(samples)))
    return sorted(timings, key=lambda t: t.milliseconds)


def tuned_plan(key: Any, launch_arguments: Callable[[Any], tuple] | None) -> Any:
    """Cache builder for ``PlanChoice.AUTOTUNED`` keys: build every plan, time them, return the
    :class:`~cudnn_attn.engine.plan.CallPlan` pinned to the fastest (support checked first).  Without
    ``launch_arguments`` the plans are timed on scratch buffers (:meth:`CallPlan.scratch`: zeros, full
    lengths); attention's run time does not depend on the values, only on the shapes and lengths."""
    import cupy

    from cudnn_attn.graphs.builder import ALL_PLANS, build_graph
    from cudnn_attn.persist.build import autotuned_engine_plan, environment_for, remember_autotuned

    context = runtime.device_context(key.device)
    check_supported(key.config, context.environment, kind=key.kind)
    store = default_store()
    with cupy.cuda.Device(key.device):
        environment = environment_for(None)
        winner = autotuned_engine_plan(store, key.config, key.kind, environment=environment, rng_dump=key.rng_dump)
        if winner is not None:                 # tuned by an earlier process: its winner, without timing again
            try:
                return build_plan(key, plan_name=winner)
            except UnsupportedConfigurationError:
                logger.info("the remembered autotuned engine plan %s is no longer offered; tuning again", winner)
        with context.planning() as handle:
            built = build_graph(key.config, key.kind, handle, rng_dump=key.rng_dump, plan=ALL_PLANS)
    candidates = CallPlan(built, context, rng_dump=key.rng_dump)
    if launch_arguments is not None:
        timings = time_plans(candidates, launch_arguments)
    else:                                      # no call's buffers (a bound call tunes when bound): scratch ones
        with candidates.scratch() as (pointers, stream, _):
            timings = time_plans(candidates, lambda plan: (pointers, stream.ptr, (0,) * len(plan.scalar_ids)))
    logger.info("autotuned %s %s (heuristic choice %s): %s", key.kind, key.config.describe(), built.plan_name,
                ", ".join(f"{t.name} {t.milliseconds:.3f} ms" for t in timings))
    with cupy.cuda.Device(key.device):
        remember_autotuned(store, key.config, key.kind, timings[0].name, environment=environment,
                           rng_dump=key.rng_dump, timings={t.name: t.milliseconds for t in timings})
    return build_plan(key, plan_name=timings[0].name)
