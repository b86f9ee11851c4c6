"""The command line on the GPU: ``check`` passes on this GPU, ``precompile`` fills the store for this
GPU and a second run finds every plan there."""

from __future__ import annotations

import pytest

from cudnn_attn.tools import cli

pytestmark = pytest.mark.gpu


def test_check_agrees_with_the_reference_on_this_gpu(capsys):
    status = cli.main(["check", "--seed", "3"])
    out = capsys.readouterr().out
    assert status == cli.EXIT_OK, out
    assert "MISMATCH" not in out and "ERROR" not in out and "configurations agree with the reference" in out


def test_precompile_on_this_gpu_then_every_plan_is_loaded(capsys, tmp_path):
    argv = ["precompile", "--shape", "2,256,256,8,2,64", "--dtype", "fp16", "--mask", "causal", "--backward",
            "--dir", str(tmp_path / "plans")]
    assert cli.main(argv) == cli.EXIT_OK
    first = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in first[:2]] == ["built", "built"], first
    assert cli.main(argv) == cli.EXIT_OK
    second = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in second[:2]] == ["loaded", "loaded"], second
