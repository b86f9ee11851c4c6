"""The command line (``python -m cudnn_attn``) on a CPU: info, the support checklist, cache, the
self-test and benchmark without a GPU, precompile's argument checks, progress output.

Deviceless planning through ``precompile --target sm90`` is the deviceless tier's
(``tests/deviceless/test_cli_deviceless.py``); ``check`` and ``bench`` on a GPU are the GPU tier's.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cudnn_attn.core.config import AttentionConfig
from cudnn_attn.core.environment import Environment
from cudnn_attn.engine import runtime
from cudnn_attn.persist.store import PlanKey, PlanStore
from cudnn_attn.tools import cli, selftest

ENV = Environment(91900, (9, 0), "NVIDIA H200", 132, "1.32.0")
CONFIG = AttentionConfig(batch=2, q_heads=4, kv_heads=4, q_len=128, kv_len=128, qk_dim=64, v_dim=64,
                         dtype="float16", scale=0.125, training=True)
no_gpu = pytest.mark.skipif(runtime.is_gpu_available(), reason="checks the behaviour without a GPU")


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    folder = tmp_path / "store"
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", str(folder))
    return folder


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    for command in ("info", "check", "bench", "precompile", "cache"):
        assert command in out


def test_python_dash_m_runs_without_importing_jax(store_dir):
    """``python -m cudnn_attn info`` runs in a fresh interpreter and never imports JAX or CuPy."""
    script = ("import runpy, sys\n"
              "sys.argv = ['cudnn_attn', 'info']\n"
              "try:\n    runpy.run_module('cudnn_attn', run_name='__main__')\n"
              "except SystemExit as e:\n    assert e.code == 0, e.code\n"
              "print('imported:', 'jax' in sys.modules, 'cupy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=os.environ, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "cudnn_attn" in out.stdout and out.stdout.strip().endswith("imported: False False")


def test_info_reports_versions_and_the_plan_store(capsys, store_dir):
    PlanStore(store_dir).save(PlanKey(CONFIG, "fwd", "heuristic", ENV), b"x" * 100, {"plan_name": "eng2_k24=7"})
    status, out, _ = run(capsys, "info")
    assert status == 0
    for label in ("cudnn_attn", "Python", "JAX", "CuPy", "cuDNN", "frontend", "driver", "GPU", "plan store", "bytecode"):
        assert any(line.startswith(label) for line in out.splitlines()), label
    assert f"{store_dir} (1 entries" in out


def test_info_says_when_the_store_is_off(capsys, monkeypatch):
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", "off")
    status, out, _ = run(capsys, "info")
    assert status == 0 and "plan store   off (CUDNN_ATTN_CACHE_DIR=off)" in out


def test_info_checklist_for_the_h200_on_any_machine(capsys, store_dir):
    status, out, _ = run(capsys, "info", "--shape", "2,1024,1024,8,2,128", "--mask", "causal", "--backward",
                         "--target", "sm90")
    assert status == 0
    assert "sm90 (NVIDIA H200, deviceless)" in out
    assert "=> fwd: supported" in out and "=> bwd: supported" in out
    assert "N=8/2kv T=1024 S=1024 d=128 mask=causal train" in out


def test_info_checklist_names_the_unmet_rule(capsys, store_dir):
    status, out, _ = run(capsys, "info", "--shape", "2,256,256,4,4,64", "--dtype", "fp8", "--mask", "causal",
                         "--backward", "--target", "sm90")
    assert status == 0
    not_ok = [line for line in out.splitlines() if line.strip().startswith("NOT")]
    assert not_ok == ["  NOT  FP8 attention rules"], out
    assert "=> bwd: NOT supported: FP8 attention: the sm90 backward needs qk_dim == v_dim == 128" in out


@pytest.mark.parametrize("argv, message", [
    (["info", "--shape", "2,128,128,4"], "--shape: must be six positive integers"),
    (["info", "--shape", "2,128,128,4,3,64"], "query heads N=4 must be a multiple of key/value heads K=3"),
    (["precompile", "--target", "sm90"], "give --shape"),
    (["info", "--shape", "2,128,128,4,4,64", "--scale", "nan"], "--scale: must be a finite positive number, got nan"),
    (["info", "--shape", "2,128,128,4,4,64", "--scale", "-1"], "--scale: must be a finite positive number"),
])
def test_bad_calls_exit_2_naming_the_problem(capsys, store_dir, argv, message):
    status, _, err = run(capsys, *argv)
    assert status == cli.EXIT_USAGE and message in err


def test_info_with_a_bad_call_prints_nothing_before_the_error(capsys, store_dir):
    status, out, err = run(capsys, "info", "--shape", "2,128,128,4")
    assert status == cli.EXIT_USAGE and out == "" and "--shape" in err


@pytest.mark.parametrize("argv", [["cache", "list"], ["cache", "info"], ["cache", "clear"],
                                  ["precompile", "--shape", "2,128,128,4,4,64", "--target", "sm90"]])
def test_a_store_path_that_is_a_file_exits_2_naming_it(capsys, tmp_path, argv):
    path = tmp_path / "a-file"
    path.write_text("not a store")
    status, out, err = run(capsys, *argv, "--dir", str(path))
    assert status == cli.EXIT_USAGE and f"--dir {path}: exists and is not a directory" in err, err
    assert out == "" and path.read_text() == "not a store"


def test_a_store_from_the_environment_that_is_a_file(capsys, monkeypatch, tmp_path):
    path = tmp_path / "a-file"
    path.write_text("not a store")
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", str(path))
    status, _, err = run(capsys, "cache", "list")
    assert status == cli.EXIT_USAGE and "CUDNN_ATTN_CACHE_DIR" in err and "is not a directory" in err
    status, out, _ = run(capsys, "info")                       # info reports it and carries on
    assert status == 0 and "plan store   unusable: " in out and str(path) in out


def test_precompile_into_a_folder_that_cannot_be_made_exits_2(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    status, out, err = run(capsys, "precompile", "--shape", "2,128,128,4,4,64", "--target", "sm90",
                           "--dir", str(blocker / "store"))
    assert status == cli.EXIT_USAGE and f"cannot create it ({blocker} is not a directory)" in err, err
    assert out == ""


@pytest.mark.parametrize("content, message", [
    ("not json", "cannot read a JSON list"),
    ("[]", "non-empty JSON list"),
    ('[{"shape": "1,2,3"}]', "[0]: shape must be six positive integers"),
    ('[{"shape": "2,128,128,4,4,64", "dtype": "fp32"}]', "dtype must be one of bf16, fp16, fp8"),
    ('[{"shape": "2,128,128,4,4,64"}, {"shape": "2,128,128,4,4,64", "window": 3}]', "[1]: expected an object"),
])
def test_precompile_from_a_bad_file_exits_2_before_any_work(capsys, store_dir, tmp_path, content, message):
    path = tmp_path / "calls.json"
    path.write_text(content)
    status, out, err = run(capsys, "precompile", "--from", str(path), "--target", "sm90")
    assert status == cli.EXIT_USAGE and message in err, err
    assert out == "" and not store_dir.exists()


def test_precompile_reports_a_well_formed_call_the_support_table_refuses(capsys, store_dir, tmp_path):
    path = tmp_path / "calls.json"
    path.write_text('[{"shape": "2,128,128,4,4,64", "dtype": "fp8", "mask": "alibi"}]')
    status, out, _ = run(capsys, "precompile", "--from", str(path), "--target", "sm90")
    assert status == cli.EXIT_FAILURE, out
    assert "refused" in out and "FP8 attention: no mask or a causal mask only, found ALiBi" in out, out


def test_precompile_needs_a_store(capsys, monkeypatch):
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", "off")
    status, _, err = run(capsys, "precompile", "--shape", "2,128,128,4,4,64", "--target", "sm90")
    assert status == cli.EXIT_UNAVAILABLE and "--dir" in err


@no_gpu
def test_precompile_without_gpu_or_target_exits_3(capsys, store_dir):
    status, _, err = run(capsys, "precompile", "--shape", "2,128,128,4,4,64")
    assert status == cli.EXIT_UNAVAILABLE and "--target sm90" in err


@no_gpu
@pytest.mark.parametrize("command", ["check", "bench"])
def test_check_and_bench_say_plainly_there_is_no_gpu(capsys, command):
    status, out, _ = run(capsys, command)
    assert status == cli.EXIT_UNAVAILABLE and "no usable CUDA GPU" in out


def test_check_refuses_unknown_configurations(capsys):
    status, _, err = run(capsys, "check", "--only", "fp16 nonsense")
    assert status == cli.EXIT_USAGE and "unknown configurations" in err


def test_cache_list_info_clear(capsys, store_dir):
    store = PlanStore(store_dir)
    store.save(PlanKey(CONFIG, "fwd", "heuristic", ENV), b"x" * 100,
               {"plan_name": "eng2_k24=7", "description": "fwd float16 BTNH causal"})
    store.save(PlanKey(CONFIG, "bwd", "heuristic", ENV), b"y" * 100, {"plan_name": "eng6_k24=26"})
    broken = store.path(PlanKey(CONFIG, "bwd", "heuristic", ENV))
    broken.write_bytes(broken.read_bytes()[:50])
    status, out, _ = run(capsys, "cache", "list")
    assert status == 0 and "2 entries" in out
    assert "eng2_k24=7" in out and "NVIDIA H200 sm90 cuDNN 91900" in out and "fwd float16 BTNH causal" in out
    assert "UNUSABLE" in out and broken.name in out
    status, out, _ = run(capsys, "cache", "info")
    assert status == 0 and "entries      1 (1 unusable" in out
    status, out, _ = run(capsys, "cache", "clear")
    assert status == 0 and f"removed 2 entries from {store_dir}" in out
    assert run(capsys, "cache", "list")[1].strip().endswith("empty")


def test_cache_with_dir_and_off(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", "off")
    status, _, err = run(capsys, "cache", "list")
    assert status == cli.EXIT_UNAVAILABLE and "CUDNN_ATTN_CACHE_DIR=off" in err
    status, out, _ = run(capsys, "cache", "info", "--dir", str(tmp_path / "elsewhere"))
    assert status == 0 and "(not created yet)" in out


def test_progress_rewrites_a_terminal_line_and_logs_otherwise(caplog):
    class Terminal(io.StringIO):
        def isatty(self):
            return True
    terminal = Terminal()
    progress = cli.Progress(2, "precompile", terminal)
    progress.step("first")
    progress.step("second")
    progress.close()
    assert "\r\033[K[1/2] precompile: first" in terminal.getvalue()
    assert terminal.getvalue().endswith("\r\033[K")
    with caplog.at_level("INFO", logger="cudnn_attn"):
        logged = cli.Progress(1, "check", io.StringIO())
        logged.step("only")
    assert [r.getMessage() for r in caplog.records] == ["[1/1] check: only"]


def test_specs_describe_the_configuration_prepare_makes():
    spec = cli.CommandLineCall.parse("2,1024,512,8,2,128", "fp16", "padding_causal", "bnth", True)
    config = spec.config()
    assert (config.batch, config.q_len, config.kv_len, config.q_heads, config.kv_heads, config.qk_dim) == (
        2, 1024, 512, 8, 2, 128)
    assert config.dtype == "float16" and config.layout.name == "BNTH" and config.training
    assert config.mask.causal and config.mask.padding and config.scale == pytest.approx(128 ** -0.5)
    assert spec.kinds == ("fwd", "bwd")
    fp8 = cli.CommandLineCall.parse([1, 256, 256, 4, 4, 128], "fp8", "causal", scale=0.1).config()
    assert fp8.fp8 and fp8.dtype == "float8_e4m3fn" and fp8.scale == 0.1 and not fp8.training


def test_selftest_cases_are_valid_and_about_twenty():
    assert 18 <= len(selftest.CASES) <= 24
    for name, (shape, _) in selftest.CASES.items():
        assert selftest.call_config(**shape).describe(), name


def test_selftest_comparison_fails_on_a_wrong_result():
    rng = np.random.default_rng(5)
    want = rng.standard_normal((2, 64, 4, 32))
    compare = selftest._Comparison()
    compare.tensor("output", want * (1 + 1e-4), want, "float16")
    assert not compare.failures and compare.worst < 1
    compare.tensor("dq", want[:, ::-1], want, "float16")                # rows in the wrong order
    assert compare.failures and compare.failures[0].startswith("dq: error") and compare.worst > 1
    with pytest.raises(AssertionError, match="not finite"):
        compare.tensor("dk", np.full_like(want, np.nan), want, "float16")
    rows = [selftest.CheckRow("fp16 BTNH", "fwd+bwd", "MISMATCH", 3.2, "dq: error 6e-3 > 2e-3", 0.5, 7)]
    assert "python -m cudnn_attn check --only 'fp16 BTNH' --seed 7" in selftest.table(rows)


def test_precompile_reports_each_configuration(capsys, store_dir, monkeypatch):
    """The planner's outcomes as the table prints them: built, loaded, refused by cuDNN (its message),
    refused by the support table, failed; exit 1 when any could not be planned."""
    from cudnn_attn.core.errors import UnsupportedConfigurationError

    class Built:
        def __init__(self, origin):
            self.origin, self.plan_name, self.workspace_size, self.build_seconds = origin, "eng2_k24=7", 256, 0.5

    answers = iter([Built("built"), Built("loaded"),
                    UnsupportedConfigurationError(["cuDNN does not support this"], cudnn_message="no engine\nat all"),
                    UnsupportedConfigurationError(["FP8 attention: needs d=128"]), RuntimeError("handle gone")])

    def planner(config, kind, store):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer
    monkeypatch.setattr(cli, "_deviceless_planner", lambda store: planner)
    path = store_dir.parent / "calls.json"
    path.write_text(json.dumps([{"shape": "2,128,128,4,4,64", "backward": True}, {"shape": "2,128,128,4,4,64"},
                                {"shape": "2,128,128,4,4,128", "dtype": "fp8"}, {"shape": "1,64,64,2,2,64"}]))
    status, out, _ = run(capsys, "precompile", "--from", str(path), "--target", "sm90")
    lines = out.splitlines()
    assert status == cli.EXIT_FAILURE
    assert lines[0].startswith("built    fwd 2,128,128,4,4,64 bf16 none BTNH +backward: plan eng2_k24=7")
    assert lines[1].startswith("loaded   bwd")
    assert lines[2] == "refused  fwd 2,128,128,4,4,64 bf16 none BTNH: cuDNN refused it: no engine at all"
    assert lines[3].endswith("not supported: FP8 attention: needs d=128")
    assert lines[4].startswith("failed   fwd 1,64,64,2,2,64") and "RuntimeError: handle gone" in lines[4]
    assert lines[5] == f"2 of 5 plans in {store_dir}; 3 could not be planned (above)"


@no_gpu
@pytest.mark.parametrize("bindings", [True, False], ids=["cuda.bindings", "cupy-fallback"])
def test_no_driver_is_reported_not_raised(monkeypatch, bindings):
    if not bindings:
        monkeypatch.setitem(sys.modules, "cuda.bindings", None)     # import fails: CuPy answers instead
    _, gpus, why = cli._driver()
    assert gpus == [] and why


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package of three modules on sys.path, without bytecode."""
    folder = tmp_path / "site" / "slowpkg"
    (folder / "sub").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "sub/__init__.py"):
        (folder / name).write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return folder


def test_info_names_a_package_every_process_compiles_again(package, monkeypatch):
    """Missing bytecode that this interpreter will not write is reported with the command that writes it;
    once compiled (or when the interpreter writes it itself), the line says ok."""
    import compileall

    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert cli.bytecode_status("slowpkg") == cli.Bytecode("slowpkg", str(package), 3, 3, False)
    lines = cli._bytecode_lines(("slowpkg", "no_such_package_here"))
    assert "slowpkg: 3 of 3 modules have none" in lines[0] and "PYTHONDONTWRITEBYTECODE" in lines[0]
    assert lines[-1].endswith(f"python -m compileall -q {package}")

    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert cli._bytecode_lines(("slowpkg",)) == ["bytecode     ok (slowpkg)"]    # written at the first import

    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert compileall.compile_dir(str(package), quiet=1)
    assert cli.bytecode_status("slowpkg").missing == 0
    assert cli._bytecode_lines(("slowpkg",)) == ["bytecode     ok (slowpkg)"]

    source = package / "a.py"                                   # edited after compiling: stale, compiled again
    os.utime(source, (source.stat().st_atime, source.stat().st_mtime + 10))
    assert cli.bytecode_status("slowpkg").missing == 1
