"""``python -m cudnn_attn precompile --target sm90`` on a machine without a GPU: the command line loads
the stub driver itself (built once into the store's folder), plans real cuDNN 9.19 sm90 plans, and
a later process finds and deserializes them (``persist_worker.py``)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from cudnn_attn.persist.store import PlanStore

from .test_persist_deviceless import run as run_worker

pytestmark = pytest.mark.deviceless


def precompile(store, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}      # no stub on the loader path
    return subprocess.run([sys.executable, "-m", "cudnn_attn", "precompile", "--dir", str(store), *argv],
                          env=env, capture_output=True, text=True, timeout=600)


def test_precompiled_plans_are_found_and_deserialized_by_the_next_process(deviceless_env, tmp_path):
    store = tmp_path / "plans"
    out = precompile(store, "--shape", "2,128,128,4,4,64", "--dtype", "fp16", "--mask", "causal", "--backward",
                     "--target", "sm90")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("built    fwd 2,128,128,4,4,64 fp16 causal BTNH +backward: plan eng")
    assert lines[1].startswith("built    bwd") and lines[2] == f"2 of 2 plans in {store}"
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
    assert [e.plan for e in PlanStore(store).entries()] and all(e.error is None for e in PlanStore(store).entries())
    loaded = run_worker(deviceless_env, store, "build", "causal:fwd", "causal:bwd")
    assert [g["origin"] for g in loaded["graphs"].values()] == ["loaded", "loaded"], loaded
    assert loaded["warnings"] == []
    again = precompile(store, "--shape", "2,128,128,4,4,64", "--dtype", "fp16", "--mask", "causal", "--backward",
                       "--target", "sm90")
    assert again.returncode == 0 and again.stdout.startswith("loaded   fwd"), again.stdout


def test_cudnn_refusals_are_reported_and_the_rest_is_planned(deviceless_env, tmp_path):
    """An FP8 head dim of 72 (not a multiple of 16, which cuDNN requires) is reported with the reason,
    the other call is still planned, and the exit status says that one could not be planned."""
    store = tmp_path / "plans"
    calls = tmp_path / "calls.json"
    calls.write_text('[{"shape": "1,128,128,4,4,64", "dtype": "fp16", "mask": "causal"},'
                     ' {"shape": "1,128,128,4,4,72", "dtype": "fp8", "mask": "causal"}]')
    out = precompile(store, "--from", str(calls), "--target", "sm90")
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("built    fwd 1,128,128,4,4,64")
    assert lines[1].startswith("refused  fwd 1,128,128,4,4,72 fp8 causal") and "72" in lines[1]
    assert lines[2] == f"1 of 2 plans in {store}; 1 could not be planned (above)"
