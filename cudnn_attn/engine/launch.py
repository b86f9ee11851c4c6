"""Executing a built graph with as little host work as possible.

The frontend's ``pygraph.execute`` inspects and normalises every buffer on every call: about 35 us
of host time on the H200 for a 5-tensor graph (55 us with dropout's host scalars).  Everything it
works out - which uids the backend needs, in which order, which plan - is fixed once the graph is
built, so :class:`Launcher` works it out once:

* the variant-pack order (ascending uids, exactly what cuDNN's C++ graph expects - read from the
  lowered graph), as a permutation of the caller's fixed tensor order;
* the backend plan index of the selected (or a given) plan;

and each call only permutes the addresses into a preallocated ``void*`` array and hands it to the
lowered graph's ``_execute_with_raw_ptrs`` (one C++ call that builds the variant pack and calls
``cudnnBackendExecute``).

That entry point is private to ``nvidia-cudnn-frontend`` (verified with 1.32.0).  When it is absent,
the graph came back from a form that lacks it, the selected plan is one of the frontend's python
engines, or ``path=FRONTEND`` is asked for, :class:`Launcher` uses the public ordered
``BuiltGraph.execute`` instead; ``Launcher.path`` says which one is in use.

A launcher is not thread-safe (it reuses one pointer array): callers hold the device lock
(:class:`cudnn_attn.engine.runtime.DeviceContext`), as they must for the cuDNN handle anyway.
"""

from __future__ import annotations

import ctypes
import operator
import struct
from typing import Any, Callable, Mapping, Sequence

FAST = "fast"
FRONTEND = "frontend"


class Launcher:
    """Runs one :class:`~cudnn_attn.graphs.builder.BuiltGraph` from addresses given in a fixed order.

    Args:
        built: the graph.
        ids: the :class:`~cudnn_attn.graphs.tensors.TensorId` of each address a call passes, in the
            order it passes them; exactly the graph's tensors.
        plan_index: an index of ``built.plans`` to run instead of the selected plan (autotuning).
        path: :data:`FAST` (default; falls back to :data:`FRONTEND` where it cannot be used) or
            :data:`FRONTEND`.
    """

    def __init__(self, built: Any, ids: Sequence[Any] | None = None, *, plan_index: int | None = None,
                 path: str = FAST):
        if path not in (FAST, FRONTEND):
            raise ValueError(f"path: must be {FAST!r} or {FRONTEND!r}, got {path!r}")
        self.built = built
        self.ids = tuple(built.uids) if ids is None else tuple(ids)
        if set(self.ids) != set(built.uids) or len(self.ids) != len(built.uids):
            raise ValueError(f"ids: the {built.kind} graph binds exactly {sorted(t.name for t in built.uids)}, "
                             f"got {[getattr(t, 'name', t) for t in self.ids]}")
        self.plan_index = plan_index
        self._raw_execute = None
        self.path = FAST if path == FAST and self._resolve_fast_path() else FRONTEND

    def _resolve_fast_path(self) -> bool:
        """Read the variant-pack order and backend plan index; False when this graph can't use them."""
        graph = self.built.graph
        try:
            if graph._plans:
                index = graph._plan_index if self.plan_index is None else self.plan_index
                if graph._engine_for(graph._plans[index]) is not None:
                    return False                  # a python engine: only the frontend can run it
                cpp_index = graph._materialize_backend_plan(index).cpp_index
            elif self.plan_index is None:
                cpp_index = None                  # deserialized (persist.build): the lowered graph's only plan
            else:
                return False
            order = list(graph._variant_pack_uids() or ())
            raw_execute = graph._lowered_graph._execute_with_raw_ptrs
        except (AttributeError, IndexError, TypeError):
            return False
        position = {int(self.built.uids[t]): i for i, t in enumerate(self.ids)}
        if sorted(order) != sorted(position):     # the pack must be exactly the graph's tensors
            return False
        self._setup_fast_path(tuple(position[uid] for uid in order), -1 if cpp_index is None else int(cpp_index),
                              raw_execute)
        return True

    def _setup_fast_path(self, order: tuple[int, ...], cpp_index: int, raw_execute: Any) -> None:
        """``order[j]``: the caller's position of the pack's ``j``-th pointer."""
        self._order = operator.itemgetter(*order) if len(order) > 1 else (lambda a, i=order[0]: (a[i],))
        self._pointers = (ctypes.c_void_p * len(order))()
        self._pointers_address = ctypes.addressof(self._pointers)
        self._fill = struct.Struct(f"{len(order)}P").pack_into     # 25 % cheaper than a ctypes slice assignment
        self._count = len(order)
        self._cpp_index = cpp_index
        self._raw_execute = raw_execute

    def bound(self, context: Any) -> Callable[[Sequence[int], int], None] | None:
        """``run(addresses, workspace)`` on ``context.handle`` (a :class:`~cudnn_attn.engine.runtime.DeviceContext`'s)
        with every lookup done once; ``None`` when this launcher has no raw path (it then needs
        :meth:`__call__`).  The caller holds the device lock."""
        if self._raw_execute is None:
            return None
        fill, order, pointers, address = self._fill, self._order, self._pointers, self._pointers_address
        raw_execute, count, cpp_index = self._raw_execute, self._count, self._cpp_index
        backend = context.handle.backend_handle

        def run(addresses: Sequence[int], workspace: int) -> None:
            fill(pointers, 0, *order(addresses))
            raw_execute(address, count, workspace, backend, cpp_index)

        return run

    def __call__(self, addresses: Sequence[int] | Mapping[Any, int], workspace: int, handle: Any) -> None:
        """Run on ``handle``'s stream.  ``addresses`` follow :attr:`ids` (or map every id to its address):
        device addresses, and host addresses for the pass-by-value scalars (``built.host_scalar_ids``).
        ``handle`` is the ``cudnn.Handle``; the caller holds its device lock."""
        if type(addresses) is dict:
            addresses = [addresses[t] for t in self.ids]
        if self._raw_execute is not None:
            self._fill(self._pointers, 0, *self._order(addresses))
            self._raw_execute(self._pointers_address, self._count, workspace, handle.backend_handle, self._cpp_index)
            return
        self.built.execute(dict(zip(self.ids, addresses)), workspace, handle, plan_index=self.plan_index)
