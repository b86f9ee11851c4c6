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
from typing import Any, Callable, Mapping, NamedTuple

from .launch import Launcher

logger = logging.getLogger("cudnn_attn")


class PlanTiming(NamedTuple):
    index: int
    name: str
    milliseconds: float


def time_plans(built: Any, buffers: Mapping[Any, int], workspace: Callable[[int], int], handle: Any,
               stream: Any, *, repeats: int = 5) -> list[PlanTiming]:
    """Median device time of every plan in ``built.plans`` (fastest first).

    ``workspace(nbytes)`` returns a device address of at least ``nbytes`` ordered on ``stream`` (a
    CuPy stream object, already bound to ``handle``).
    """
    import cupy

    timings = []
    for plan in built.plans:
        launch = Launcher(built, plan_index=plan.index)
        scratch = workspace(plan.workspace_size)
        launch(buffers, scratch, handle)                       # warm-up (first-launch costs)
        samples = []
        for _ in range(repeats):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            launch(buffers, scratch, handle)
            end.record(stream)
            end.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, end))
        timings.append(PlanTiming(plan.index, plan.name, statistics.median(samples)))
    return sorted(timings, key=lambda t: t.milliseconds)


def tuned_graph(build: Callable[..., Any], buffers: Mapping[Any, int], workspace: Callable[[int], int],
                handle: Any, stream: Any) -> Any:
    """Build all plans with ``build(plan=ALL_PLANS)``, time them, and return ``build(plan=<fastest>)``."""
    from .graphs.builder import ALL_PLANS

    candidates = build(plan=ALL_PLANS)
    timings = time_plans(candidates, buffers, workspace, handle, stream)
    logger.info("autotuned %s %s (heuristic choice %s): %s", candidates.kind, candidates.config.describe(),
                candidates.plan_name, ", ".join(f"{t.name} {t.milliseconds:.3f} ms" for t in timings))
    return build(plan=timings[0].name)
