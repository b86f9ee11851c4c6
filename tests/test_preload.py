"""The background import of the cuDNN frontend (:mod:`cudnn_attn.engine.preload`), each case in a fresh process:
it runs after ``import cudnn_attn`` and nothing else does; a ``fork()`` waits for it, so the child finds the
frontend whole; a failed background import is raised by the caller's own import; it can be turned off."""

from __future__ import annotations

import ast
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
        from cudnn_attn.engine import preload
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
        from cudnn_attn.engine import preload
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
        from cudnn_attn.engine import preload
        preload.wait()
        try:
            import cudnn
        except ImportError as exc:
            print('raised:', exc)
    """, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "raised: a broken frontend" and "Traceback" not in out.stderr


def _mapped(substring: str) -> str:
    return f"any({substring!r} in line for line in open('/proc/self/maps'))"


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc")
def test_engine_libraries_load_where_a_driver_is_present():
    # The machine decides what the import's thread does: with a driver it loads cuDNN's engine libraries.
    out = _run(f"""
        import os, cudnn_attn
        from cudnn_attn.engine import preload
        preload.wait()
        print(repr((os.path.exists('/dev/nvidiactl'), {_mapped('libcudnn_engines_precompiled')},
                    [os.path.basename(p).split('.so')[0] for p in preload.engines_loaded],
                    preload.engines_seconds is not None)))
    """)
    assert out.returncode == 0, out.stderr
    driver, mapped, loaded, timed = ast.literal_eval(out.stdout.strip())
    from cudnn_attn.engine.preload import ENGINE_LIBRARIES

    assert (mapped, loaded, timed) == ((True, list(ENGINE_LIBRARIES), True) if driver else (False, [], False))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc")
@pytest.mark.parametrize("engines", ["1", "0"])
def test_the_thread_loads_the_engine_libraries_unless_turned_off(engines):
    # The thread's work run synchronously, the driver check pointed at a path that exists.
    out = _run(f"""
        import os, cudnn_attn
        from cudnn_attn.engine import preload
        assert preload._thread is None and not {_mapped('libcudnn_graph')}
        preload._DRIVER_DEVICE = '/'
        preload._import()
        print({_mapped('libcudnn_engines_runtime_compiled')}, len(preload.engines_loaded))
    """, CUDNN_ATTN_PRELOAD="0", CUDNN_ATTN_PRELOAD_ENGINES=engines)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("True 4" if engines == "1" else "False 0")


def test_a_deserialized_plan_runs_its_checks_on_preloaded_libraries(tmp_path):
    # Libraries loaded by path before cuDNN asks for them by soname are the ones cuDNN then uses: a deviceless
    # plan built, then loaded in a new process that preloaded them (before the stub driver, as on a CPU).
    pytest.importorskip("cudnn")
    build = subprocess.run([sys.executable, "-m", "cudnn_attn", "precompile", "--shape", "1,128,128,2,2,64",
                            "--target", "sm90", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    if build.returncode != 0 and "--target sm90" in build.stderr:
        pytest.skip(f"deviceless planning unavailable here: {build.stderr.strip()[-200:]}")
    assert build.returncode == 0, build.stderr
    out = _run(f"""
        import cudnn_attn
        from cudnn_attn.tools import cli
        from cudnn_attn.engine import preload
        from cudnn_attn.graphs import DevicelessTarget, driver_stub
        from cudnn_attn.persist import build as persist
        from cudnn_attn.persist.store import PlanStore
        preload.wait()
        assert len(preload.load_engine_libraries()) == 4
        store = PlanStore({str(tmp_path)!r})
        driver_stub.preload(store.directory)
        config = cli.CommandLineCall.parse("1,128,128,2,2,64").config()
        print(persist.build_or_load(config, "fwd", DevicelessTarget.h200(), store=store).origin)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "loaded"


def test_cudnn_library_path_and_suffix(tmp_path):
    from cudnn_attn.engine import preload

    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n"
                    "7f02-7f03 r-xp 00000000 08:01 13 /opt/my libs/libcudnn.so.9.19.0\n")
    assert preload.cudnn_library_path(str(maps)) == "/opt/my libs/libcudnn.so.9.19.0"
    assert preload.cudnn_library_path(str(tmp_path / "absent")) is None
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 12 /usr/lib/libcudnn_graph.so.9\n")
    assert preload.cudnn_library_path(str(maps)) is None
    # only existing siblings with the same suffix are opened
    assert preload.load_engine_libraries(str(tmp_path / "libcudnn.so.9.19.0")) == ()
