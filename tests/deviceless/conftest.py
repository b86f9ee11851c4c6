"""The deviceless tier: real cuDNN plans for the H200 (sm90) on a machine without a GPU.

Once per session this builds a stub ``libcuda.so.1`` (only where no NVIDIA driver exists) and starts
``worker.py`` in a subprocess whose ``LD_LIBRARY_PATH`` names the stub; the test process itself never
loads it.  Tests ask the :func:`deviceless` fixture for cuDNN's verdict on ``(config, kind)``.  The tier
is skipped, with the reason, when the cuDNN wheel or a C compiler is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .stub import build_stub, c_compiler, cudnn_library_dir, real_driver_present
from .worker import receive, send

WORKER = Path(__file__).with_name("worker.py")


@dataclass(frozen=True)
class Verdict:
    """cuDNN's answer for one graph: ``ok`` with the selected plan, or the refusal ``message``."""

    ok: bool
    seconds: float
    plan: str | None = None
    workspace: int | None = None
    num_plans: int = 0
    plans: tuple = ()
    uids: dict = field(default_factory=dict)
    refused_by: str = ""          # "cudnn", or "builder" for the builder's structural rules
    message: str = ""


class DevicelessBuilder:
    """A worker subprocess that builds graphs deviceless; verdicts are memoised per request."""

    def __init__(self, env: dict[str, str], log: Path):
        self._env, self._log = env, log
        self._verdicts: dict[tuple, Verdict] = {}
        self._start()

    def _start(self) -> None:
        self._stderr = open(self._log, "ab")
        self._process = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self._stderr, env=self._env)
        hello = receive(self._process.stdout)
        if hello is None:
            raise RuntimeError(f"the deviceless worker did not start:\n{self.log_tail()}")
        self.cudnn_version = hello["cudnn_version"]

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])

    def verdict(self, config: Any, kind: str, **options: Any) -> Verdict:
        key = (config, kind, tuple(sorted(options.items())))
        if key not in self._verdicts:
            send(self._process.stdin, (config, kind, options))
            reply = receive(self._process.stdout)
            if reply is None:                       # the worker died: restart it for the next request
                tail = self.log_tail()
                self._process.wait()
                self._start()
                raise RuntimeError(f"the deviceless worker died building {kind} {config.describe()}:\n{tail}")
            if "error" in reply:
                raise AssertionError(f"building {kind} {config.describe()} raised:\n{reply['error']}")
            self._verdicts[key] = Verdict(**reply)
        return self._verdicts[key]

    def close(self) -> None:
        self._process.stdin.close()
        self._process.wait(timeout=60)
        self._stderr.close()


_environment: dict[str, str] | None = None


def _stub_environment(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a subprocess that can plan deviceless (built once per session): the stub's
    folder first on ``LD_LIBRARY_PATH`` where there is no driver (the test process never loads it)."""
    global _environment
    if _environment is None:
        cudnn_lib = cudnn_library_dir()
        if cudnn_lib is None:
            pytest.skip("deviceless tier: no cuDNN wheel (pip install 'cudnn-attn[cudnn]')")
        env = dict(os.environ)
        if not real_driver_present():
            compiler = c_compiler()
            if compiler is None:
                pytest.skip("deviceless tier: no C compiler (cc/gcc or $CC) to build the stub libcuda.so.1")
            stub_dir = build_stub(tmp_path_factory.mktemp("libcuda_stub"), cudnn_lib, compiler)
            env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(stub_dir), env.get("LD_LIBRARY_PATH")]))
        _environment = env
    return _environment


@pytest.fixture(scope="session")
def deviceless_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a subprocess that can plan deviceless (see :func:`_stub_environment`)."""
    return _stub_environment(tmp_path_factory)


@pytest.fixture(scope="session")
def deviceless(tmp_path_factory: pytest.TempPathFactory) -> DevicelessBuilder:
    """cuDNN verdicts for the H200 from a worker subprocess (see the module doc)."""
    log = tmp_path_factory.mktemp("deviceless") / "worker.log"
    builder = DevicelessBuilder(_stub_environment(tmp_path_factory), log)
    yield builder
    builder.close()
