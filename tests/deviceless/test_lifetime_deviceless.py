"""Lifetimes of cuDNN frontend objects, deviceless: nothing outlives the interpreter, and the graph cache's
bound holds for the graphs themselves.

Each case is a fresh process (``lifetime_worker.py``) that builds real cuDNN 9.19 sm90 graphs through
the library's graph cache and plan store and exits normally; nanobind reports at exit every frontend
object still alive (``nanobind: leaked ...`` on stderr).  A score_mod graph kept alive by a reference cycle through cuDNN's C++ graph (its callbacks) is freed by
no eviction; nanobind reported 89 instances at the exit of the ``exit`` case when that cycle was there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cudnn_attn.engine.launch import FAST

pytestmark = pytest.mark.deviceless

WORKER = Path(__file__).with_name("lifetime_worker.py")


def run(env: dict, store: Path, action: str, *args: str) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, str(WORKER), str(store), action, *args], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, f"lifetime_worker {action} {args} failed:\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def _leaks(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(("nanobind:", " - leaked"))]


def test_no_frontend_object_outlives_the_interpreter(deviceless_env, tmp_path):
    """Graphs of every kind cached until exit, plus graphs loaded from the store held by a module: the
    atexit release and module teardown free them all before nanobind's own teardown."""
    reply, stderr = run(deviceless_env, tmp_path, "exit")
    assert reply["cached"] == len(reply["origins"]) == 8
    assert set(reply["launch_paths"]) == {FAST}, reply       # the launchers hold the lowered graphs' raw execute
    assert "loaded" in reply["loaded"], reply           # the store's deserialized graphs were exercised
    assert not _leaks(stderr), "\n".join(_leaks(stderr)[:20])


def test_evicted_graphs_are_freed(deviceless_env, tmp_path):
    """40 configurations through a 4-graph cache (every fourth with a score_mod): no more built graphs
    stay alive than the cache holds, without a garbage collection, and nothing leaks at exit."""
    reply, stderr = run(deviceless_env, tmp_path, "evict", "40")
    assert reply["cached"] == 4 and reply["evictions"] == 36, reply
    assert reply["alive_before_gc"] == [4, 4], reply
    assert reply["alive_after_gc"] == [4, 4], reply
    assert reply["live_graphs"] == 4, reply
    assert not _leaks(stderr), "\n".join(_leaks(stderr)[:20])
