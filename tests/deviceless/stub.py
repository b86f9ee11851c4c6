"""A do-nothing ``libcuda.so.1`` that lets cuDNN's libraries load on a machine without a CUDA driver.

cuDNN's runtime-compiled engine library opens ``libcuda.so.1`` and looks up driver entry points by
name; without the library it refuses to load, and with it cuDNN can plan graphs for a described
device (``pygraph(device_property=..., sm_version=...)``) without ever touching a GPU.  The stub
exports every ``cu*`` driver name found in the cuDNN libraries; each returns
``CUDA_ERROR_NO_DEVICE`` except ``cuDriverGetVersion`` (a CUDA 13.0 driver) and the error-string
getters.  Nothing can run on it.

Never put the stub where a real driver exists: it would shadow it.  :func:`real_driver_present`
tells; the deviceless tests load the stub only in a worker subprocess and only without a driver.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

CUDA_ERROR_NO_DEVICE = 100
DRIVER_VERSION = 13000

# Entry points that must answer something other than "no device".
_SPECIAL = {
    "cuDriverGetVersion": f"CUresult cuDriverGetVersion(int *v) {{ if (v) *v = {DRIVER_VERSION}; return 0; }}",
    "cuGetErrorString": 'CUresult cuGetErrorString(CUresult e, const char **s) '
                        '{ (void)e; if (s) *s = "no CUDA device (stub libcuda)"; return 0; }',
    "cuGetErrorName": 'CUresult cuGetErrorName(CUresult e, const char **s) '
                      '{ (void)e; if (s) *s = "CUDA_ERROR_NO_DEVICE"; return 0; }',
    "cuDeviceGetCount": f"CUresult cuDeviceGetCount(int *n) {{ if (n) *n = 0; return {CUDA_ERROR_NO_DEVICE}; }}",
}
# Driver API names: "cu" + an upper-case letter; runtime ("cuda*"), cuDNN and cuBLAS names are not driver calls.
_DRIVER_NAME = re.compile(rb"\x00(cu[A-Z][A-Za-z0-9_]{2,60})\x00")
_NOT_DRIVER = ("cudnn", "cuda", "cublas")


def real_driver_present() -> bool:
    """Whether this machine has an NVIDIA driver (the stub must then never be loaded)."""
    return os.path.exists("/dev/nvidiactl") or ctypes.util.find_library("cuda") is not None


def cudnn_library_dir() -> Path | None:
    """The ``lib`` folder of the ``nvidia-cudnn-cu*`` wheel, or ``None`` when it is not installed."""
    spec = importlib.util.find_spec("nvidia.cudnn")
    for root in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(root) / "lib"
        if any(lib.glob("libcudnn*.so*")):
            return lib
    return None


def c_compiler() -> str | None:
    """The C compiler to build the stub with (``$CC``, ``cc`` or ``gcc``), or ``None``."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def driver_entry_points(cudnn_lib: Path) -> list[str]:
    """Every driver function name the cuDNN libraries mention (they resolve them by name)."""
    names: set[str] = set()
    for library in sorted(cudnn_lib.glob("libcudnn*.so*")):
        names.update(m.decode() for m in _DRIVER_NAME.findall(library.read_bytes()))
    return sorted(n for n in names | _SPECIAL.keys() if not n.startswith(_NOT_DRIVER))


def stub_source(names: list[str]) -> str:
    lines = ["typedef int CUresult;"]
    lines += [_SPECIAL.get(n, f"CUresult {n}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}") for n in names]
    return "\n".join(lines) + "\n"


def build_stub(out_dir: Path, cudnn_lib: Path, compiler: str) -> Path:
    """Compile the stub into ``out_dir/libcuda.so.1`` and return its folder (for ``LD_LIBRARY_PATH``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    source = out_dir / "libcuda_stub.c"
    source.write_text(stub_source(driver_entry_points(cudnn_lib)))
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1",
                    "-o", str(out_dir / "libcuda.so.1"), str(source)], check=True, capture_output=True)
    return out_dir
