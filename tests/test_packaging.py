"""The wheel as a user gets it: built by ``pip`` without a deprecation warning, installed into a fresh
environment, and the demo (what ``scripts/demo.sh`` runs) run from it outside the checkout.

The build runs in pip's isolated build environment (the newest setuptools from PyPI, as ``pip install .``
does for a user) on a copy of the checkout, so the checkout gets no ``build/`` or ``*.egg-info``.  The
fresh environment reuses this one's packages through a ``.pth`` file (no download of JAX or cuDNN) and
gets the wheel alone (``--no-deps``).  Every subprocess runs under a timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import cudnn_attn

ROOT = Path(__file__).resolve().parents[1]
_NOT_SOURCE = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                     "bench_out", ".whl", ".stub", "tests", "benchmarks")


def _run(*command: str | Path, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _site_packages() -> list[str]:
    """This interpreter's package folders (the test environment's, and those its ``.pth`` files add)."""
    return [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]


@pytest.mark.slow
def test_wheel_builds_without_warnings_installs_and_runs_the_demo(tmp_path: Path) -> None:
    source, wheels = tmp_path / "source", tmp_path / "wheels"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCE)
    build = _run(sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", wheels, source, cwd=tmp_path)
    log = build.stdout + build.stderr
    assert build.returncode == 0, log[-4000:]
    warnings = [line for line in log.splitlines() if re.search(r"deprecat", line, re.IGNORECASE)]
    assert not warnings, "the build printed deprecation warnings:\n" + "\n".join(warnings)
    (wheel,) = wheels.glob("cudnn_attn-*.whl")

    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path)
    Path(site.stdout.strip(), "zz_test_environment.pth").write_text("\n".join(_site_packages()) + "\n")
    install = _run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index",
                   wheel, cwd=tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr

    where = _run(python, "-c", "import cudnn_attn, cudnn_attn.graphs, cudnn_attn.jax_bridge as j; "
                 "print(cudnn_attn.__file__); print(j.__file__)", cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    for path in where.stdout.split():
        assert Path(path).resolve().is_relative_to(env_dir.resolve()), f"imported from {path}, not the wheel"
    demo = _run(python, "-m", "cudnn_attn.tools.demo", cwd=tmp_path)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-4000:]
    assert f"cudnn_attn {cudnn_attn.__version__}" in demo.stdout and ("matches the reference" in demo.stdout or "GPU found" in demo.stdout)


def test_demo_script_runs_the_demo_module() -> None:
    """``scripts/demo.sh`` names a module that exists."""
    line = (ROOT / "scripts" / "demo.sh").read_text().strip().splitlines()[-1]
    module = re.search(r"-m (\S+)", line).group(1)
    assert (ROOT / Path(*module.split("."))).with_suffix(".py").is_file(), line
