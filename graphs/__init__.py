"""cuDNN frontend graphs for attention (installed as ``cudnn_attn.graphs``).

* :mod:`.tensors`  -- stable :class:`TensorId` uids and the dims/strides cuDNN sees.
* :mod:`.builder`  -- :func:`build_graph`: one builder for forward/backward, FP8, paged and packed.
* :mod:`.target`   -- planning targets: a ``cudnn.Handle`` or a :class:`DevicelessTarget`.
* :mod:`.packing`  -- packed segments -> cuDNN's ragged batch (array-namespace generic).
"""

from .builder import ALL_PLANS, BWD, FWD, BuiltGraph, DeclaredGraph, PlanInfo, build_graph, declare_graph
from .target import DevicelessTarget
from .tensors import TensorId

__all__ = [
    "ALL_PLANS", "BWD", "FWD", "BuiltGraph", "DeclaredGraph", "DevicelessTarget", "PlanInfo", "TensorId",
    "build_graph", "declare_graph",
]
