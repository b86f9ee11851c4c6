"""Executing a built graph with as little host work as possible.

The frontend's ``pygraph.execute`` inspects and normalises every buffer on every call: about 35 us
of host time on the H200 for a 5-tensor graph (55 us with dropout's host scalars).  Everything it
works out - which uids the backend needs, in which order, which plan - is fixed once the graph is
built, so :class:`Launcher` works it out once:

* the variant-pack order (ascending uids, exactly what cuDNN's C++ graph expects - read from the
  lowered graph), as a slot per :class:`~cudnn_attn.graphs.tensors.TensorId`;
* the backend plan index of the selected plan;

and each call only writes the pointers into a ``void*`` array and hands it to the lowered graph's
``_execute_with_raw_ptrs`` (one C++ call that builds the variant pack and calls
``cudnnBackendExecute``): about 9 us on the H200, measured in ``benchmarks/bench_attention.py``.

That entry point is private to ``nvidia-cudnn-frontend`` (verified with 1.32.0).  When it is absent,
or the selected plan is one of the frontend's python engines, or ``CUDNN_ATTN_EXECUTE=frontend`` is
set, :class:`Launcher` uses the public ``BuiltGraph.execute`` (the frontend's ordered path) instead;
``Launcher.path`` says which one is in use.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Mapping

FAST = "fast"
FRONTEND = "frontend"


def _default_path() -> str:
    path = os.environ.get("CUDNN_ATTN_EXECUTE", FAST)
    if path not in (FAST, FRONTEND):
        raise ValueError(f"CUDNN_ATTN_EXECUTE: must be {FAST!r} or {FRONTEND!r}, got {path!r}")
    return path


class Launcher:
    """Runs one :class:`~cudnn_attn.graphs.builder.BuiltGraph` from ``{TensorId: address}`` maps.

    Args:
        built: the graph.
        plan_index: an index of ``built.plans`` to run instead of the selected plan (autotuning).
        path: :data:`FAST` or :data:`FRONTEND`; default from ``CUDNN_ATTN_EXECUTE`` (``fast``).
    """

    def __init__(self, built: Any, *, plan_index: int | None = None, path: str | None = None):
        self.built = built
        self.plan_index = plan_index
        self.path = path or _default_path()
        self._slots: dict[Any, int] = {}
        self._raw_execute = None
        self._cpp_index = -1
        if self.path == FAST:
            self.path = FAST if self._resolve_fast_path() else FRONTEND

    def _resolve_fast_path(self) -> bool:
        """Read the variant-pack order and backend plan index; False when this graph can't use them."""
        graph = self.built.graph
        try:
            index = graph._plan_index if self.plan_index is None else self.plan_index
            if graph._engine_for(graph._plans[index]) is not None:
                return False                      # a python engine: only the frontend can run it
            cpp_index = graph._materialize_backend_plan(index).cpp_index
            order = list(graph._variant_pack_uids() or ())
            raw_execute = graph._lowered_graph._execute_with_raw_ptrs
        except (AttributeError, IndexError, TypeError):
            return False
        by_uid = {uid: tid for tid, uid in self.built.uids.items()}
        if set(order) != set(by_uid):             # the pack must be exactly the graph's tensors
            return False
        self._slots = {by_uid[uid]: slot for slot, uid in enumerate(order)}
        self._cpp_index = -1 if cpp_index is None else int(cpp_index)
        self._raw_execute = raw_execute
        return True

    def __call__(self, buffers: Mapping[Any, int], workspace: int, handle: Any) -> None:
        """Run on ``handle``'s stream.  ``buffers`` binds every tensor of the graph: device addresses,
        and host addresses for the pass-by-value scalars (``built.host_scalar_ids``)."""
        if self._raw_execute is None:
            self.built.execute(buffers, workspace, handle, plan_index=self.plan_index)
            return
        slots = self._slots
        if len(buffers) != len(slots):
            self._refuse(buffers)
        pointers = (ctypes.c_void_p * len(slots))()
        try:
            for tid, address in buffers.items():
                pointers[slots[tid]] = address
        except KeyError:
            self._refuse(buffers)
        self._raw_execute(ctypes.addressof(pointers), len(slots), workspace, handle.backend_handle, self._cpp_index)

    def _refuse(self, buffers: Mapping[Any, int]) -> None:
        expected = set(self._slots)
        missing = sorted(t.name for t in expected - buffers.keys())
        extra = sorted(getattr(t, "name", str(t)) for t in buffers.keys() - expected)
        raise ValueError(f"buffers: the {self.built.kind} graph binds exactly {sorted(t.name for t in expected)}; "
                         f"missing {missing}, not in the graph {extra}")
