"""Plans that survive the process, deviceless: real cuDNN 9.19 sm90 plans saved by one process and
deserialized by the next (``graphs.persist.build_or_load`` over a ``PlanStore``), cuDNN's kernel cache
with dynamic shapes, and the autotuning record.

Every step runs in a fresh process (``persist_worker.py``) with the stub libcuda, as a user's next
program would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cudnn_attn.persist.store import PlanStore

pytestmark = pytest.mark.deviceless

WORKER = Path(__file__).with_name("persist_worker.py")
ROUND_TRIP = ["causal:fwd", "causal:bwd", "dropout:fwd", "dropout:bwd", "packed:bwd", "paged-decode:fwd",
              "fp8-causal:fwd", "fp8-causal:bwd"]


def run(env: dict, store: Path, action: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, str(WORKER), str(store), action, *args], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, f"persist_worker {action} {args} failed:\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def round_trip(deviceless_env, tmp_path_factory):
    """One process builds and saves every case; a second one loads them all."""
    store = tmp_path_factory.mktemp("plans")
    first = run(deviceless_env, store, "build", *ROUND_TRIP)
    second = run(deviceless_env, store, "build", *ROUND_TRIP)
    return store, first, second


@pytest.mark.parametrize("case", ROUND_TRIP)
def test_a_saved_plan_is_loaded_by_the_next_process(round_trip, case):
    _, first, second = round_trip
    built, loaded = first["graphs"][case], second["graphs"][case]
    assert built["origin"] == "built" and loaded["origin"] == "loaded"
    for fact in ("plan", "workspace", "uids"):
        assert loaded[fact] == built[fact], fact
    assert loaded["variant_pack"] == sorted(built["uids"].values())
    assert first["warnings"] == second["warnings"] == []


def test_a_loaded_graph_offers_what_the_fast_launch_reads(round_trip):
    """The deserialized pygraph has no ranked plan list (``_plans == []``) but the lowered graph's raw
    execute and the variant-pack order: the fast path runs it with plan index -1 (its only plan)."""
    _, _, second = round_trip
    for case, facts in second["graphs"].items():
        assert facts["ranked_plans"] == 0 and facts["raw_execute"], case


def test_a_loaded_graph_takes_the_fast_launch_path(round_trip):
    _, first, second = round_trip
    assert all(f["launch_path"] == "fast" for f in first["graphs"].values())
    assert all(f["launch_path"] == "fast" for f in second["graphs"].values())


def test_a_stored_blob_names_its_engine_and_gpu_where_the_load_check_reads_them(round_trip):
    """``persist.build._mismatch`` reads cuDNN's engine JSON inside a serialized plan (a format cuDNN does not
    publish) to refuse an entry of another engine or GPU; when the format moves, this fails instead of the check
    going silent."""
    from cudnn_attn.persist.build import _ENGINE, _PLAN_ENGINE
    from cudnn_attn.persist.store import decode_entry

    store, _, _ = round_trip
    entries = [e for e in PlanStore(store).entries() if e.error is None]
    assert entries
    for entry in entries:
        header, blob = decode_entry(entry.path.read_bytes())
        engine, named = _ENGINE.search(blob), _PLAN_ENGINE.match(header["meta"]["plan_name"])
        assert engine is not None, f"no engine JSON in {entry.path.name}: the load check no longer sees engines"
        assert int(engine.group(2)) == 900 and named is not None and engine.group(1).decode() == named.group(1)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_entry_warns_once_and_is_rebuilt(deviceless_env, tmp_path, damage):
    store = tmp_path / "plans"
    run(deviceless_env, store, "build", "causal:fwd")
    (path,) = [e.path for e in PlanStore(store).entries()]
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) * 2 // 3]
    else:
        data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    rebuilt = run(deviceless_env, store, "build", "causal:fwd")
    assert rebuilt["graphs"]["causal:fwd"]["origin"] == "built"
    assert len(rebuilt["warnings"]) == 1 and str(path) in rebuilt["warnings"][0], rebuilt["warnings"]
    again = run(deviceless_env, store, "build", "causal:fwd")          # the rebuilt entry was saved over it
    assert again["graphs"]["causal:fwd"]["origin"] == "loaded" and again["warnings"] == []


def test_an_entry_whose_blob_does_not_match_its_record_is_rebuilt(deviceless_env, tmp_path):
    """A blob under another configuration's key (a valid entry with a valid checksum, wrong content):
    the loaded graph's tensor uids differ from the record, so it is refused and rebuilt."""
    from cudnn_attn.persist.store import decode_entry, encode_entry

    store = tmp_path / "plans"
    run(deviceless_env, store, "build", "causal:fwd", "dropout:fwd")
    entries = {e.description.split()[0] + (" dropout" if "dropout" in e.description else ""): e.path
               for e in PlanStore(store).entries()}
    causal, dropout = entries["fwd"], entries["fwd dropout"]
    header, _ = decode_entry(causal.read_bytes())
    _, dropout_blob = decode_entry(dropout.read_bytes())

    class Key:          # re-encode the causal entry's key and record around the dropout graph's blob
        entry = header["key"]["entry"]

        @staticmethod
        def to_json():
            return header["key"]

    causal.write_bytes(encode_entry(Key, dropout_blob, header["meta"]))
    rebuilt = run(deviceless_env, store, "build", "causal:fwd")
    assert rebuilt["graphs"]["causal:fwd"]["origin"] == "built"
    assert len(rebuilt["warnings"]) == 1 and "tensor uids" in rebuilt["warnings"][0], rebuilt["warnings"]


def test_autotuned_winner_is_remembered_across_processes(deviceless_env, tmp_path):
    store = tmp_path / "plans"
    assert run(deviceless_env, store, "recall", "causal:fwd")["plan"] is None
    run(deviceless_env, store, "remember", "causal:fwd", "eng9_k24=7")
    assert run(deviceless_env, store, "recall", "causal:fwd")["plan"] == "eng9_k24=7"
    assert run(deviceless_env, store, "recall", "causal:bwd")["plan"] is None
