"""Where cuDNN builds execution plans: a live handle (GPU) or a deviceless architecture description.

A deviceless target lets cuDNN run its whole planning pipeline (heuristics, NVRTC compilation,
support checks) for a GPU that is not present, from the device's properties JSON and its SM version
(cuDNN >= 9.8).  The library ships the H200's properties (``cudnn_attn/data/h200_devprops.json``).
On a machine without a CUDA driver cuDNN's sub-libraries only load next to a stub ``libcuda.so.1``
(see ``tests/deviceless``); a machine with a driver needs nothing more.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from typing import Any

import cudnn


@dataclass(frozen=True)
class DevicelessTarget:
    """An architecture described by cuDNN device properties (JSON) and an SM version."""

    name: str
    sm_version: int
    device_properties_json: str

    @classmethod
    def h200(cls) -> "DevicelessTarget":
        """The NVIDIA H200 (sm90) the library is verified on."""
        text = resources.files("cudnn_attn").joinpath("data/h200_devprops.json").read_text()
        return cls(name="NVIDIA H200", sm_version=90, device_properties_json=text)

    def __repr__(self) -> str:
        return f"DevicelessTarget({self.name!r}, sm_version={self.sm_version})"


@functools.lru_cache(maxsize=8)
def _device_properties(text: str) -> Any:
    return cudnn.create_device_properties(text)


def graph_options(target: Any) -> dict[str, Any]:
    """The ``cudnn.pygraph`` keyword arguments that direct planning at ``target``."""
    if isinstance(target, DevicelessTarget):
        return {"device_property": _device_properties(target.device_properties_json), "sm_version": target.sm_version}
    if isinstance(target, cudnn.Handle):
        return {"handle": target}
    raise ValueError(
        f"target: expected a cudnn.Handle (from cudnn.create_handle()) or a DevicelessTarget, "
        f"got {type(target).__name__}"
    )
