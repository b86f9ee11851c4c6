"""cuDNN frontend graphs for attention (installed as ``cudnn_attn.graphs``).

* :mod:`.tensors`  -- stable :class:`TensorId` uids and the dims/strides cuDNN sees.
* :mod:`.builder`  -- :func:`build_graph`: one builder for forward/backward, FP8, paged and packed.
* :mod:`.target`   -- planning targets: a ``cudnn.Handle`` or a :class:`DevicelessTarget`.
* :mod:`.packing`  -- packed segments -> cuDNN's ragged batch (array-namespace generic).

The names below are imported on first use: importing the package (or :mod:`.tensors`, which the
execution path needs at import) does not import the cuDNN frontend (``import cudnn``: 20-30 ms here).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ALL_PLANS": "builder", "BWD": "builder", "FWD": "builder", "BuiltGraph": "builder",
    "DeclaredGraph": "builder", "PlanInfo": "builder", "build_graph": "builder", "declare_graph": "builder",
    "DevicelessTarget": "target", "TensorId": "tensors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
