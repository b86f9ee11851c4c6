"""A do-nothing ``libcuda.so.1`` that lets cuDNN's libraries load on a machine without a CUDA driver.

cuDNN's runtime-compiled engine library opens ``libcuda.so.1`` and looks up driver entry points by
name; without the library it refuses to load, and with it cuDNN can plan graphs for a described
device (``pygraph(device_property=..., sm_version=...)``) without ever touching a GPU.  The stub
exports every ``cu*`` driver name found in the cuDNN libraries; each returns
``CUDA_ERROR_NO_DEVICE`` except ``cuDriverGetVersion`` (a CUDA 13.0 driver) and the error-string
getters.  Nothing can run on it.

Two ways to use it, both only where :func:`real_driver_present` is false (it would shadow a real
driver):

* a subprocess with the stub's folder on ``LD_LIBRARY_PATH`` (the deviceless test tier);
* :func:`preload` in this process, before cuDNN plans anything: the stub is loaded ``RTLD_GLOBAL``
  under its soname, so cuDNN's later ``dlopen("libcuda.so.1")`` finds it (``python -m cudnn_attn
  precompile --target sm90``).

Building it needs a C compiler (``$CC``, ``cc`` or ``gcc``) and the ``nvidia-cudnn-cu*`` wheel.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from cudnn_attn.core import settings

CUDA_ERROR_NO_DEVICE = 100
DRIVER_VERSION = 13000
LIBRARY = "libcuda.so.1"

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


class StubUnavailable(RuntimeError):
    """The stub cannot be built or loaded here; the message says what is missing."""


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
    for name in (settings.c_compiler(), "cc", "gcc"):
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
    """Compile the stub into ``out_dir/libcuda.so.1`` (atomically) and return its folder."""
    out_dir.mkdir(parents=True, exist_ok=True)
    source = out_dir / "libcuda_stub.c"
    source.write_text(stub_source(driver_entry_points(cudnn_lib)))
    descriptor, temporary = tempfile.mkstemp(prefix=".libcuda-", suffix=".so", dir=out_dir)
    os.close(descriptor)
    try:
        subprocess.run([compiler, "-shared", "-fPIC", "-O1", f"-Wl,-soname,{LIBRARY}", "-o", temporary, str(source)],
                       check=True, capture_output=True)
        os.replace(temporary, out_dir / LIBRARY)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return out_dir


def preload(cache_dir: Path) -> Path | None:
    """Make cuDNN loadable in this process without a driver: build the stub under ``cache_dir`` (once
    per cuDNN installation) and load it.  Returns the stub's path, or ``None`` where a real driver
    exists (nothing to do).  Raises :class:`StubUnavailable` saying what is missing."""
    if real_driver_present():
        return None
    cudnn_lib = cudnn_library_dir()
    if cudnn_lib is None:
        raise StubUnavailable("no NVIDIA driver here and no cuDNN wheel to plan with: "
                              "pip install 'cudnn-attn[cudnn]' (nvidia-cudnn-cu13, nvidia-cublas, nvidia-cuda-nvrtc)")
    libraries = sorted((p.name, p.stat().st_size) for p in cudnn_lib.glob("libcudnn*.so*"))
    stamp = hashlib.sha256(repr(libraries).encode()).hexdigest()[:16]     # one stub per cuDNN installation
    folder = Path(cache_dir) / f"libcuda-stub-{stamp}"
    if not (folder / LIBRARY).exists():
        compiler = c_compiler()
        if compiler is None:
            raise StubUnavailable("no NVIDIA driver here: planning for a GPU without one needs a stub libcuda.so.1, "
                                  "built with a C compiler (set $CC or install cc/gcc)")
        try:
            build_stub(folder, cudnn_lib, compiler)
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            raise StubUnavailable(f"building the stub libcuda.so.1 in {folder} failed: {exc} "
                                  f"{detail.decode(errors='replace')}") from exc
    ctypes.CDLL(str(folder / LIBRARY), mode=ctypes.RTLD_GLOBAL)
    return folder / LIBRARY
