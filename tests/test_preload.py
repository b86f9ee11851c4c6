"""The background import of the cuDNN frontend (:mod:`cudnn_attn.preload`), each case in a fresh process:
it runs after ``import cudnn_attn`` and nothing else does; a ``fork()`` waits for it, so the child finds the
frontend whole; a failed background import is raised by the caller's own import; it can be turned off."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **env))


def test_import_starts_the_frontend_import_in_the_background():
    out = _run("""
        import sys, cudnn_attn
        from cudnn_attn import preload
        assert preload._thread is not None and 'jax' not in sys.modules and 'cupy' not in sys.modules
        preload.wait()
        import cudnn
        print(preload.running(), hasattr(cudnn, 'pygraph'), sorted(m for m in ('jax', 'cupy', 'torch') if m in sys.modules))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "False True []"


def test_turned_off():
    out = _run("""
        import sys, cudnn_attn
        from cudnn_attn import preload
        print(preload._thread, 'cudnn' in sys.modules)
    """, CUDNN_ATTN_PRELOAD="0")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None False"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_fork_waits_for_the_background_import():
    out = _run("""
        import os, sys, warnings
        warnings.simplefilter('error', DeprecationWarning)      # 3.12: fork() of a process with threads warns
        import cudnn_attn
        pid = os.fork()
        if pid == 0:
            import cudnn
            os._exit(0 if hasattr(cudnn, 'pygraph') and hasattr(cudnn, 'graph') else 3)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"


def test_a_failed_background_import_is_raised_by_the_callers_own(tmp_path):
    (tmp_path / "cudnn").mkdir()
    (tmp_path / "cudnn" / "__init__.py").write_text("raise ImportError('a broken frontend')\n")
    out = _run("""
        import cudnn_attn
        from cudnn_attn import preload
        preload.wait()
        try:
            import cudnn
        except ImportError as exc:
            print('raised:', exc)
    """, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "raised: a broken frontend" and "Traceback" not in out.stderr
