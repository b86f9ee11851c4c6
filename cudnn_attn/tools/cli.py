"""The command line: ``python -m cudnn_attn {info,check,bench,precompile,cache}``.

* ``info`` -- versions (Python, JAX and its backend, CuPy, cuDNN, frontend, driver), the GPUs and
  their compute capability, the plan store, and the packages a first call imports that lack bytecode
  this interpreter will not write (:func:`bytecode_status`); with ``--shape`` the support checklist of
  that call (``--target sm90`` answers for the H200 on any machine).
* ``check`` -- about twenty configurations on this GPU against the NumPy reference (:mod:`.selftest`).
* ``bench`` -- the side-by-side benchmark of the source tree (``benchmarks/bench_attention.py --quick``:
  ours, a hand-built cuDNN graph, torch SDPA and ``jax.nn`` where importable; table and PNG).
* ``precompile`` -- fills the plan store (:mod:`.plan_store`) for ``--shape``/``--from`` calls, on this
  GPU or, with ``--target sm90``, for the H200 on a machine without one (cuDNN's deviceless planning;
  without an NVIDIA driver a stub ``libcuda.so.1`` is built once into the store's folder, which needs
  a C compiler).
* ``cache list|clear|info [--dir DIR]`` -- the plan store.

Exit status: 0 success; 1 a failure (``check``: a mismatch or an error; ``precompile``: a configuration
could not be planned, cuDNN's reason printed; ``bench``: the benchmark failed); 2 a bad command line or
configuration file; 3 this machine cannot do it (no usable GPU for ``check``/``bench``/``precompile``
without ``--target``, the plan store is off, or deviceless planning is impossible here).

Long operations show a progress line on an interactive terminal and log each step otherwise.  Imports
are lazy: ``--help``, ``info`` and ``cache`` never import JAX (``info --jax`` does, to ask JAX for its
backend), and only ``check``/``bench``/``precompile`` on a GPU import CuPy.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Sequence

from cudnn_attn.core import support
from cudnn_attn.core.environment import VERSION as __version__
from cudnn_attn.core.errors import UnsupportedConfigurationError
from cudnn_attn.core.support import format_version
from cudnn_attn.core.types import Kind, MaskType
from cudnn_attn.engine import runtime
from cudnn_attn.engine.cache import _bytes  # the graph cache's byte formatting (one spelling of sizes)
from cudnn_attn.graphs import driver_stub
from cudnn_attn.persist.store import ENV_VAR, PlanStore

from . import selftest
from .selftest import call_config

logger = logging.getLogger("cudnn_attn")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}
MASKS = ("none", "causal", "padding", "padding_causal", "alibi")
TARGETS = ("sm90",)


class UsageError(Exception):
    """A bad command line or configuration file (exit status 2)."""

class Unavailable(Exception):
    """This machine cannot do what was asked (exit status 3)."""

# ---------------------------------------------------------------------------------------------------
# Calls described on the command line
# ---------------------------------------------------------------------------------------------------
class CommandLineCall(NamedTuple):
    """One attention call: ``shape`` = (B, T, S, N, K, H), names as on the command line."""
    shape: tuple[int, int, int, int, int, int]
    dtype: str = "bf16"
    mask: str = "none"
    layout: str = "BTNH"
    backward: bool = False
    scale: float | None = None

    @classmethod
    def parse(cls, shape: Any, dtype: str = "bf16", mask: str = "none", layout: str = "BTNH",
              backward: bool = False, scale: float | None = None, where: str | None = None) -> "CommandLineCall":
        """The call of the command line's flags (``where=None``: a bad value is named by its flag, ``--scale``)
        or of one entry of a ``--from`` file (``where`` names the entry, the message the field)."""
        def bad(field: str, rule: str) -> UsageError:
            return UsageError(f"--{field}: {rule}" if where is None else f"{where}: {field} {rule}")

        values = shape.split(",") if isinstance(shape, str) else shape
        try:
            dims = tuple(int(v) for v in values)
        except (TypeError, ValueError):
            dims = ()
        if len(dims) != 6 or min(dims) < 1:
            raise bad("shape", f"must be six positive integers B,T,S,N,K,H, got {shape!r}")
        if dtype not in DTYPES:
            raise bad("dtype", f"must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if mask not in MASKS:
            raise bad("mask", f"must be one of {', '.join(MASKS)}, got {mask!r}")
        if str(layout).upper() not in ("BTNH", "BNTH"):
            raise bad("layout", f"must be BTNH or BNTH, got {layout!r}")
        if not isinstance(backward, bool):
            raise bad("backward", f"must be true or false, got {backward!r}")
        if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                      and math.isfinite(scale) and scale > 0):
            raise bad("scale", f"must be a finite positive number, got {scale!r}")
        return cls(dims, dtype, mask, str(layout).upper(), backward, None if scale is None else float(scale))

    @property
    def kinds(self) -> tuple[Kind, ...]:
        return tuple(Kind) if self.backward else (Kind.FORWARD,)

    def config(self) -> Any:
        """The :class:`~cudnn_attn.core.config.AttentionConfig` of this call (``training`` with ``backward``;
        the scale defaults to ``1/sqrt(H)``, which is part of the plan)."""

        B, T, S, N, K, H = self.shape
        try:
            return call_config(B=B, T=T, S=S, N=N, K=K, H=H, dtype=DTYPES[self.dtype], layout=self.layout,
                               training=self.backward, scale=self.scale, mask_type=MaskType[self.mask.upper()]
                               if self.mask != "none" else MaskType.NO_MASK)
        except ValueError as exc:
            raise UsageError(f"invalid call {self.describe()}:\n{exc}") from None

    def describe(self) -> str:
        return (f"{','.join(map(str, self.shape))} {self.dtype} {self.mask} {self.layout}"
                + (" +backward" if self.backward else ""))


def _specs_from_file(path: str) -> list[CommandLineCall]:
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--from {path}: cannot read a JSON list ({exc})") from None
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"--from {path}: expected a non-empty JSON list of calls, "
                         'e.g. [{"shape": "2,1024,1024,8,8,128", "dtype": "bf16", "mask": "causal"}]')
    specs = []
    allowed = set(CommandLineCall._fields)
    for i, entry in enumerate(entries):
        where = f"--from {path} [{i}]"
        if not isinstance(entry, dict) or "shape" not in entry or set(entry) - allowed:
            raise UsageError(f"{where}: expected an object with 'shape' and optionally {sorted(allowed - {'shape'})}, "
                             f"got {entry!r}")
        specs.append(CommandLineCall.parse(**entry, where=where))
    return specs


def _specs(args: argparse.Namespace) -> list[CommandLineCall]:
    if getattr(args, "from_file", None):
        if args.shape:
            raise UsageError("give --shape or --from, not both")
        return _specs_from_file(args.from_file)
    if not args.shape:
        raise UsageError("give --shape B,T,S,N,K,H (or --from FILE.json)")
    return [CommandLineCall.parse(args.shape, args.dtype, args.mask, args.layout, args.backward, args.scale)]


# ---------------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------------
class Progress:
    """``[i/n] label: step`` rewritten in place on a terminal, one log line per step otherwise."""
    def __init__(self, total: int, label: str, stream: Any = None):
        self.total, self.label, self.count = total, label, 0
        self.stream = stream or sys.stderr
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())

    def step(self, message: str) -> None:
        self.count += 1
        line = f"[{self.count}/{self.total}] {self.label}: {message}"
        if self.interactive:
            self.stream.write("\r\033[K" + line[:200])
            self.stream.flush()
        else:
            logger.info("%s", line)

    def close(self) -> None:
        if self.interactive and self.count:
            self.stream.write("\r\033[K")
            self.stream.flush()


def _log_to_stderr() -> None:
    """INFO lines of the ``cudnn_attn`` logger to stderr when stderr is not a terminal."""
    if sys.stderr.isatty() or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


# ---------------------------------------------------------------------------------------------------
# Facts about this machine (lazy, never JAX unless asked)
# ---------------------------------------------------------------------------------------------------
def _distribution_versions(prefixes: Sequence[str]) -> dict[str, str]:
    from importlib import metadata

    found = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(tuple(prefixes)):
            found[name] = dist.version
    return dict(sorted(found.items()))


class GPU(NamedTuple):
    index: int
    name: str
    compute_capability: tuple[int, int]
    sm_count: int


def _driver() -> tuple[str | None, list[GPU], str | None]:
    """``(driver description, GPUs, why none)``: the CUDA driver API through ``cuda.bindings`` (fast to
    import), else through CuPy."""
    release = None
    try:
        release = Path("/proc/driver/nvidia/version").read_text().split("Kernel Module")[1].split()[0]
    except (OSError, IndexError):
        pass
    try:
        try:
            cuda, gpus = _driver_api_gpus()
        except ImportError:
            cuda, gpus = _cupy_gpus()
    except Exception as exc:  # noqa: BLE001 -- no driver, no bindings, no device: all "none here"
        return release, [], f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    described = f"{release or 'release unknown'} (CUDA {cuda // 1000}.{cuda % 1000 // 10})"
    return described, gpus, None if gpus else "the driver reports no CUDA device"


def _driver_api_gpus() -> tuple[int, list[GPU]]:
    from cuda.bindings import driver as cu

    def ok(result: tuple) -> Any:
        error, *values = result
        if error != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(cu.cuGetErrorName(error)[1].decode())
        return values[0] if values else None

    ok(cu.cuInit(0))
    attr, gpus = cu.CUdevice_attribute, []
    for index in range(ok(cu.cuDeviceGetCount())):
        device = ok(cu.cuDeviceGet(index))
        name = ok(cu.cuDeviceGetName(128, device)).split(b"\0")[0].decode()
        major = ok(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device))
        minor = ok(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device))
        sms = ok(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device))
        gpus.append(GPU(index, name, (major, minor), sms))
    return ok(cu.cuDriverGetVersion()), gpus


def _cupy_gpus() -> tuple[int, list[GPU]]:
    import cupy

    runtime, gpus = cupy.cuda.runtime, []
    for index in range(runtime.getDeviceCount()):
        props = runtime.getDeviceProperties(index)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        gpus.append(GPU(index, name, (props["major"], props["minor"]), props["multiProcessorCount"]))
    return runtime.driverGetVersion(), gpus


def _cudnn_version() -> str:
    try:
        import cudnn


        return format_version(int(cudnn.backend_version()))
    except Exception as exc:  # noqa: BLE001 -- the frontend without libcudnn, or neither
        return f"not loadable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"


def _store_line(store_dir: str | None) -> str:
    try:
        store = _store(store_dir, required=False)
    except UsageError as exc:
        return f"unusable: {exc}"
    if store is None:
        return f"off ({ENV_VAR}=off)"
    info = store.info()
    bad = f", {info.bad_entries} unusable" if info.bad_entries else ""
    return f"{info.directory} ({info.entries} entries, {_bytes(info.bytes)}{bad})"


def _store(directory: str | None, *, required: bool = True) -> Any:
    """The plan store of ``--dir`` (else of the environment); a path that exists and is not a folder is a
    usage error, named as the user gave it."""

    store = PlanStore(directory) if directory else PlanStore.from_env()
    if store is None:
        if required:
            raise Unavailable(f"the plan store is off ({ENV_VAR}=off): pass --dir DIR or unset {ENV_VAR}")
        return None
    if store.directory.exists() and not store.directory.is_dir():
        raise UsageError(f"{_store_origin(directory)} {store.directory}: exists and is not a directory")
    return store


def _store_origin(directory: str | None) -> str:
    return "--dir" if directory else f"the plan store ({ENV_VAR} or the user cache directory)"


def _make_store_directory(store: Any, directory: str | None) -> None:
    """Create the store's folder, or a usage error naming where its path came from."""
    try:
        store.make_directory()
    except OSError as exc:
        found = next((p for p in store.directory.parents if p.exists()), None)
        why = f"{found} is not a directory" if found is not None and not found.is_dir() else exc.strerror or exc
        raise UsageError(f"{_store_origin(directory)} {store.directory}: cannot create it ({why})") from None


# ---------------------------------------------------------------------------------------------------
# info
# ---------------------------------------------------------------------------------------------------
def cmd_info(args: argparse.Namespace) -> int:
    spec = _specs(args)[0] if args.shape else None       # a bad call fails before anything is printed
    out = []
    out.append(f"cudnn_attn   {__version__} ({Path(__file__).resolve().parents[1]})")
    out.append(f"Python       {sys.version.split()[0]} ({sys.executable})")
    jax_dists = _distribution_versions(["jax"])
    plugins = [f"{n} {v}" for n, v in jax_dists.items() if "cuda" in n or "rocm" in n]
    if "jax" not in jax_dists:
        out.append("JAX          not installed")
    elif args.jax:
        import jax

        out.append(f"JAX          {jax.__version__}, backend {jax.default_backend()} "
                   f"({', '.join(str(d) for d in jax.devices())})")
    else:
        backend = "GPU plugin " + ", ".join(plugins) if plugins else "no GPU plugin: cpu"
        out.append(f"JAX          {jax_dists['jax']} ({backend}; --jax asks JAX itself)")
    cupy = _distribution_versions(["cupy"])
    out.append("CuPy         " + (", ".join(f"{v} ({n})" for n, v in cupy.items()) or "not installed"))
    cudnn_wheels = _distribution_versions(["nvidia-cudnn-cu"])
    frontend = _distribution_versions(["nvidia-cudnn-frontend"]).get("nvidia-cudnn-frontend", "not installed")
    wheels = ", ".join(f"{n} {v}" for n, v in cudnn_wheels.items())
    out.append(f"cuDNN        {_cudnn_version()}" + (f" ({wheels})" if wheels else ""))
    out.append(f"frontend     nvidia-cudnn-frontend {frontend}")
    driver, gpus, why = _driver()
    out.append(f"driver       {driver or 'none'}")
    for gpu in gpus:
        out.append(f"GPU {gpu.index}        {gpu.name}, sm{gpu.compute_capability[0]}{gpu.compute_capability[1]}, "
                   f"{gpu.sm_count} SMs")
    if not gpus:
        out.append(f"GPU          none ({why})")
    out.append(f"plan store   {_store_line(args.dir)}")
    out += _bytecode_lines()
    print("\n".join(out))
    if spec is not None:
        print()
        print(_checklist(spec, args.target))
    return EXIT_OK


# What ``import cudnn_attn`` and a first call import, besides the standard library.
FIRST_CALL_PACKAGES = ("numpy", "ml_dtypes", "cupy", "cupy_backends", "cudnn", "cudnn_attn", "cudnn_attn.graphs")


class Bytecode(NamedTuple):
    package: str
    folder: str
    modules: int          # .py files below the folder
    missing: int          # of those, without up-to-date bytecode where this interpreter looks for it
    written: bool         # whether this interpreter writes the missing bytecode when it imports them


def bytecode_status(package: str) -> Bytecode | None:
    """Whether ``package``'s modules have their bytecode (``None``: not installed).  Found, not imported.

    A package installed with ``pip install --no-compile`` and imported by an interpreter that writes no bytecode
    (``PYTHONDONTWRITEBYTECODE``, a read-only folder) compiles every module it imports in every new process: on
    the GPU machine's host ``import numpy`` took 265 ms so, and 40 ms once compiled."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = list(spec.submodule_search_locations)[0]
    modules = missing = 0
    for root, _, files in os.walk(folder):
        for name in files:
            if name.endswith(".py"):
                modules += 1
                source = os.path.join(root, name)
                cached = importlib.util.cache_from_source(source)
                try:
                    missing += os.stat(cached).st_mtime < os.stat(source).st_mtime
                except OSError:
                    missing += 1
    where = sys.pycache_prefix or folder
    return Bytecode(package, folder, modules, missing, not sys.dont_write_bytecode and os.access(where, os.W_OK))


def _bytecode_lines(packages: Sequence[str] = FIRST_CALL_PACKAGES) -> list[str]:
    """``info``'s bytecode line: ok, or each package whose missing bytecode every new process compiles again."""
    found = [b for b in map(bytecode_status, packages) if b is not None]
    slow = [b for b in found if b.missing and not b.written]
    if not slow:
        return [f"bytecode     ok ({', '.join(b.package for b in found)})"]
    why = "PYTHONDONTWRITEBYTECODE is set" if sys.dont_write_bytecode else "its folder is read-only"
    lines = [f"bytecode     {b.package}: {b.missing} of {b.modules} modules have none, and this interpreter "
             f"writes none ({why}): every new process compiles them again" for b in slow]
    lines.append("             fix: python -m compileall -q " + " ".join(b.folder for b in slow))
    return lines


def _checklist(spec: CommandLineCall, target: str | None) -> str:
    """Each support rule that concerns the call, ok or why not, then the verdict per graph."""
    config = spec.config()
    env = support.Environment.sm90(_installed_cudnn() or 91900) if target == "sm90" else support.Environment.detect()
    lines = [f"call: {spec.describe()}", f"  config: {config.describe()}", f"  environment: {env}"]

    def row(ok: bool, what: str, reasons: Iterable[str] = ()) -> None:
        lines.append(f"  {'ok ' if ok else 'NOT'}  {what}" + "".join(f"\n         {r}" for r in reasons))

    row(env.cudnn_version is not None, "cuDNN library")
    row(env.compute_capability is not None, "CUDA GPU" + ("" if target else " (--target sm90 asks for the H200)"))
    for rule in support.REQUIREMENTS:
        if rule.applies(config):
            unmet = rule.unmet(config, env)
            row(not unmet, f"{rule.feature}: cuDNN >= {support.format_version(rule.min_cudnn)}, "
                           f"sm{rule.min_compute[0]}{rule.min_compute[1]}+", unmet)
    restrictions: dict[str, list[str]] = {}
    for rule in support.RESTRICTIONS:
        if set(rule.kinds) & set(spec.kinds):
            restrictions.setdefault(f"{rule.feature} rules", []).extend(rule.unmet(config, env))
    for what, unmet in restrictions.items():
        row(not unmet, what, unmet)
    for kind in spec.kinds:
        reasons = support.not_supported_reasons(config, env, kind=kind)
        lines.append(f"  => {kind}: " + ("supported" if not reasons else "NOT supported: " + "; ".join(reasons)))
    return "\n".join(lines)


def _installed_cudnn() -> int | None:
    try:
        import cudnn

        return int(cudnn.backend_version())
    except Exception:  # noqa: BLE001
        return None


# ---------------------------------------------------------------------------------------------------
# cache
# ---------------------------------------------------------------------------------------------------
def cmd_cache(args: argparse.Namespace) -> int:
    store = _store(args.dir)
    if args.action == "clear":
        removed = store.clear()
        print(f"removed {removed} entries from {store.directory}")
        return EXIT_OK
    if args.action == "info":
        info = store.info()
        print(f"directory    {info.directory}{'' if info.directory.exists() else ' (not created yet)'}")
        bad = f" ({info.bad_entries} unusable: rebuilt on use)" if info.bad_entries else ""
        print(f"entries      {info.entries}{bad}")
        print(f"size         {_bytes(info.bytes)}")
        return EXIT_OK
    rows = store.entries()
    if not rows:
        print(f"plan store {store.directory}: empty")
        return EXIT_OK
    print(f"plan store {store.directory}: {len(rows)} entries")
    table = [("#", "entry", "plan", "environment", "size", "age", "description")]
    now = time.time()
    for i, row in enumerate(rows):
        if row.error:
            table.append((str(i), "UNUSABLE", "", "", _bytes(row.size), "", f"{row.path.name}: {row.error}"))
        else:
            table.append((str(i), row.entry, row.plan, row.environment, _bytes(row.size), _age(now - row.created),
                          row.description))
    print(_format_table(table))
    return EXIT_OK


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def _format_table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]).rstrip() for r in rows)


# ---------------------------------------------------------------------------------------------------
# precompile
# ---------------------------------------------------------------------------------------------------
class _Outcome(NamedTuple):
    spec: CommandLineCall
    kind: str
    status: str           # "built", "loaded", "refused", "failed"
    detail: str


def cmd_precompile(args: argparse.Namespace) -> int:
    specs = _specs(args)
    jobs = [(spec, spec.config(), kind) for spec in specs for kind in spec.kinds]     # every call valid first
    store = _store(args.dir)
    _make_store_directory(store, args.dir)
    plan = _deviceless_planner(store) if args.target else _device_planner()
    progress = Progress(len(jobs), "precompile")
    outcomes = []
    try:
        for spec, config, kind in jobs:
            progress.step(f"{kind} {spec.describe()}")
            outcomes.append(_precompile_one(spec, config, kind, store, plan))
    finally:
        progress.close()
    for o in outcomes:
        print(f"{o.status:8s} {o.kind} {o.spec.describe()}: {o.detail}")
    failed = [o for o in outcomes if o.status in ("refused", "failed")]
    print(f"{len(outcomes) - len(failed)} of {len(outcomes)} plans in {store.directory}"
          + (f"; {len(failed)} could not be planned (above)" if failed else ""))
    return EXIT_FAILURE if failed else EXIT_OK


Planner = Callable[[Any, str, Any], Any]


def _precompile_one(spec: CommandLineCall, config: Any, kind: str, store: Any, plan: Planner) -> _Outcome:
    try:
        built = plan(config, kind, store)
    except UnsupportedConfigurationError as exc:
        if exc.cudnn_message:
            return _Outcome(spec, kind, "refused", f"cuDNN refused it: {' '.join(exc.cudnn_message.split())}")
        return _Outcome(spec, kind, "refused", "not supported: " + "; ".join(exc.reasons))
    except Exception as exc:  # noqa: BLE001 -- report it and go on with the next configuration
        return _Outcome(spec, kind, "failed", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    status = "loaded" if built.origin == "loaded" else "built"
    return _Outcome(spec, kind, status, f"plan {built.plan_name}, workspace {_bytes(built.workspace_size)}, "
                                        f"{built.build_seconds * 1e3:.0f} ms")


def _deviceless_planner(store: Any) -> Planner:
    """Plans for the H200 (sm90) without using a GPU; loads the stub driver where there is none."""

    try:
        stub = driver_stub.preload(store.directory)
    except driver_stub.StubUnavailable as exc:
        raise Unavailable(f"--target sm90: {exc}") from None
    if stub is not None:
        logger.info("no NVIDIA driver: planning with the stub %s", stub)
    from cudnn_attn.graphs.target import DevicelessTarget  # imports the cuDNN frontend
    from cudnn_attn.persist.build import build_or_load

    target = DevicelessTarget.h200()
    env = support.Environment.sm90(_installed_cudnn() or 91900)

    def plan(config: Any, kind: str, store: Any) -> Any:
        support.check_supported(config, env, kind=kind)
        return build_or_load(config, kind, target, store=store)
    return plan


def _device_planner() -> Planner:
    """Plans on GPU 0 of this machine."""
    if not runtime.is_gpu_available():
        raise Unavailable("no usable CUDA GPU here: precompile for the H200 with --target sm90")
    import cupy

    from cudnn_attn.persist.build import build_or_load

    def plan(config: Any, kind: str, store: Any) -> Any:
        with cupy.cuda.Device(0):
            context = runtime.device_context(0)
            support.check_supported(config, context.environment, kind=kind)
            with context.planning() as handle:
                return build_or_load(config, kind, handle, store=store)
    return plan


# ---------------------------------------------------------------------------------------------------
# check and bench
# ---------------------------------------------------------------------------------------------------
def cmd_check(args: argparse.Namespace) -> int:
    if args.only:
        unknown = [name for name in args.only if name not in selftest.CASES]
        if unknown:
            raise UsageError(f"--only: unknown configurations {unknown}; choose from {list(selftest.CASES)}")
    if not runtime.is_gpu_available():
        print("no usable CUDA GPU here: nothing to check (exit status 3). The NumPy reference and the JAX "
              "bridge run on CPU; the test suite covers them (./scripts/test.sh).")
        return EXIT_UNAVAILABLE
    names = args.only or list(selftest.CASES)
    progress = Progress(len(names), "check")
    try:
        rows = selftest.run(seed=args.seed, only=args.only, progress=progress.step)
    finally:
        progress.close()
    print(selftest.table(rows))
    bad = [r for r in rows if r.status in ("MISMATCH", "ERROR")]
    print(f"{len(rows) - len(bad)} of {len(rows)} configurations agree with the reference"
          + (f"; {len(bad)} do not" if bad else ""))
    return EXIT_FAILURE if bad else EXIT_OK


def _bench_script() -> Path | None:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_attention.py"
    return script if script.is_file() else None


def cmd_bench(args: argparse.Namespace) -> int:
    import subprocess

    script = _bench_script()
    if script is None:
        print("bench runs the source tree's benchmarks/bench_attention.py, which this installation does not have "
              "(install from a checkout: pip install -e .)")
        return EXIT_UNAVAILABLE
    if not runtime.is_gpu_available():
        print("no usable CUDA GPU here: nothing to benchmark (exit status 3)")
        return EXIT_UNAVAILABLE
    command = [sys.executable, str(script), "--out", args.out] + ([] if args.full else ["--quick"])
    print(f"running {' '.join(command)} (table below; JSON and PNG in {args.out})", flush=True)
    return EXIT_OK if subprocess.run(command).returncode == 0 else EXIT_FAILURE


# ---------------------------------------------------------------------------------------------------
# The parser
# ---------------------------------------------------------------------------------------------------
def _call_arguments(parser: argparse.ArgumentParser, *, target: bool) -> None:
    group = parser.add_argument_group("the call (one configuration)")
    group.add_argument("--shape", metavar="B,T,S,N,K,H",
                       help="batch, query length, key length, query heads, key/value heads, head dim")
    group.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="io dtype (fp8: E4M3)")
    group.add_argument("--mask", choices=MASKS, default="none")
    group.add_argument("--layout", choices=("BTNH", "BNTH"), default="BTNH")
    group.add_argument("--backward", action="store_true",
                       help="training: the forward with its logsumexp, and the backward")
    group.add_argument("--scale", type=float, help="softmax scale, part of the plan (default 1/sqrt(H))")
    if target:
        group.add_argument("--target", choices=TARGETS,
                           help="plan for this GPU without using one (sm90: the H200, cuDNN deviceless planning)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cudnn_attn",
                                     description="cuDNN fused attention: facts about this machine, a self-test, "
                                                 "a benchmark, and the persistent plan store.",
                                     epilog="Exit status: 0 ok, 1 failure, 2 bad command line, 3 not possible here.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = commands.add_parser("info", help="versions, GPUs, plan store; with --shape the support checklist")
    _call_arguments(info, target=True)
    info.add_argument("--jax", action="store_true", help="import JAX to report its backend and devices")
    info.add_argument("--dir", help="plan store folder (default: $CUDNN_ATTN_CACHE_DIR or ~/.cache/cudnn_attn)")
    info.set_defaults(run=cmd_info)

    check = commands.add_parser("check", help="self-test of ~20 configurations on this GPU against the reference")
    check.add_argument("--seed", type=int, default=0, help="base seed of the random inputs")
    check.add_argument("--only", action="append", metavar="NAME", help="run this configuration (repeatable)")
    check.set_defaults(run=cmd_check)

    bench = commands.add_parser("bench", help="side-by-side benchmark (table and PNG) on this GPU")
    bench.add_argument("--out", default="bench_out", help="folder for the JSON and the PNG")
    bench.add_argument("--full", action="store_true", help="every shape (default: --quick)")
    bench.set_defaults(run=cmd_bench)

    precompile = commands.add_parser("precompile", help="fill the plan store for these calls")
    _call_arguments(precompile, target=True)
    precompile.add_argument("--from", dest="from_file", metavar="FILE.json",
                            help='a JSON list of calls: [{"shape": "B,T,S,N,K,H", "dtype": "bf16", "mask": "causal", '
                                 '"layout": "BTNH", "backward": true, "scale": 0.088}, ...]')
    precompile.add_argument("--dir", help="plan store folder (default: $CUDNN_ATTN_CACHE_DIR or ~/.cache/cudnn_attn)")
    precompile.set_defaults(run=cmd_precompile)

    cache = commands.add_parser("cache", help="list, clear or describe the plan store")
    cache.add_argument("action", choices=("list", "clear", "info"))
    cache.add_argument("--dir", help="plan store folder (default: $CUDNN_ATTN_CACHE_DIR or ~/.cache/cudnn_attn)")
    cache.set_defaults(run=cmd_cache)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("check", "precompile"):
        _log_to_stderr()
    try:
        return args.run(args)
    except UsageError as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Unavailable as exc:
        print(f"{parser.prog} {args.command}: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
