"""Where a call runs: the library version, the cuDNN library and the GPU, in one type.

:class:`Environment` is what the support table checks a configuration against and what a stored plan is
keyed by: the cuDNN backend version, the frontend version, the GPU's compute capability, name and SM count.
:func:`cudnn_version` is the one reader of the installed cuDNN's version (read once per process).

Nothing here imports cuDNN, CuPy or JAX at module import.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

VERSION = "0.1.0"
"""The library's version (``cudnn_attn.__version__``); part of every stored plan's key."""


def format_version(version: int) -> str:
    """``91900`` -> ``'9.19.0'``; ``8904`` -> ``'8.9.4'``."""
    if version >= 90000:
        return f"{version // 10000}.{version // 100 % 100}.{version % 100}"
    return f"{version // 1000}.{version // 100 % 10}.{version % 100}"


_read: dict[str, object] = {}


def cudnn_version() -> int | None:
    """``cudnn.backend_version()`` of the installed cuDNN, or ``None`` when none loads.  A version read is kept for
    the process; a failure is not (the frontend may still be importing on :mod:`cudnn_attn.engine.preload`'s thread,
    where a concurrent import can hand this thread the half-made module)."""
    found = _read.get("cudnn")
    if found is None:
        try:
            import cudnn

            found = _read["cudnn"] = int(cudnn.backend_version())
        except Exception:  # no frontend, no libcudnn, or a broken install: all mean "no cuDNN here" (for now)
            return None
    return found


def frontend_version() -> str | None:
    """``cudnn.__version__`` of the installed frontend, or ``None`` (kept once read, as :func:`cudnn_version`)."""
    found = _read.get("frontend")
    if found is None:
        try:
            import cudnn

            found = _read["frontend"] = str(cudnn.__version__)
        except Exception:
            return None
    return found


def _forget() -> None:
    """Tests: read the versions again."""
    _read.clear()


@dataclass(frozen=True)
class Environment:
    """The cuDNN library and GPU a configuration is checked against and a plan is built for.

    ``cudnn_version`` is ``None`` when no cuDNN library loads; ``compute_capability`` is ``None`` when there
    is no usable CUDA GPU.  ``device_name``, ``sm_count`` and ``frontend_version`` describe the build target
    further (a stored plan is keyed by them); the support table reads only the first two fields.
    """

    cudnn_version: int | None
    compute_capability: tuple[int, int] | None
    device_name: str | None = None
    sm_count: int | None = None
    frontend_version: str | None = None

    def __post_init__(self):
        version, capability = self.cudnn_version, self.compute_capability
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ValueError(f"cudnn_version: an int as cudnn.backend_version() returns it (91900 is 9.19.0) or "
                             f"None, got {version!r}")
        if capability is not None and not (isinstance(capability, tuple) and len(capability) == 2 and all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in capability)):
            raise ValueError(f"compute_capability: a (major, minor) pair of ints or None, got {capability!r}")
        if self.device_name is not None and not isinstance(self.device_name, str):
            raise ValueError(f"device_name: a str or None, got {self.device_name!r}")

    @classmethod
    def detect(cls, device: int | None = None) -> "Environment":
        """The installed cuDNN and CUDA ``device`` (default: the current CuPy device); never raises: absent
        parts are ``None``."""
        return _detect(device)

    @classmethod
    def sm90(cls, cudnn_version: int = 91900) -> "Environment":
        """The deviceless H200 target: cuDNN 9.19.0, compute capability 9.0."""
        return cls(cudnn_version, (9, 0), "NVIDIA H200, deviceless")

    @classmethod
    def for_deviceless(cls, target: Any) -> "Environment":
        """The installed cuDNN and a :class:`~cudnn_attn.graphs.DevicelessTarget`'s described GPU (name and SM
        count from its device-properties JSON)."""
        props = json.loads(target.device_properties_json)
        return cls(cudnn_version(), (target.sm_version // 10, target.sm_version % 10),
                   str(props.get("deviceName", target.name)), int(props.get("multiProcessorCount", 0)),
                   frontend_version())

    def __str__(self) -> str:
        cudnn = f"cuDNN {format_version(self.cudnn_version)}" if self.cudnn_version else "no cuDNN"
        if self.compute_capability is None:
            return f"{cudnn}, no CUDA GPU"
        device = f" ({self.device_name})" if self.device_name else ""
        major, minor = self.compute_capability
        return f"{cudnn}, sm{major}{minor}{device}"


def _detect(device: int | None) -> Environment:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return Environment(cudnn_version(), None)
        if device is None:
            device = cupy.cuda.runtime.getDevice()
        capability, name, sm_count = _device_facts(int(device))
    except Exception:  # no CuPy, no driver or no device
        return Environment(cudnn_version(), None)
    return Environment(cudnn_version(), capability, name, sm_count, frontend_version())


@functools.lru_cache(maxsize=None)
def _device_facts(device: int) -> tuple[tuple[int, int], str, int]:
    """Compute capability, name and SM count of CUDA ``device`` (read once per device)."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device)
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return (int(props["major"]), int(props["minor"])), name, int(props["multiProcessorCount"])
