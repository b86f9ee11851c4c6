"""The persistent plan store (``cudnn_attn.persist.store``) on the CPU: keys, files, failure modes.

Nothing here needs cuDNN: entries are written with fixed payload bytes, and the environment is a
fixed :class:`~cudnn_attn.core.environment.Environment`.  Building and loading real cuDNN plans through the store is the
deviceless tier's (``tests/deviceless/test_persist_deviceless.py``) and the GPU tier's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from cudnn_attn.core.config import (
    AttentionConfig,
    BiasSpec,
    DiagonalAlignment,
    InputStrides,
    PackingSpec,
    PagingSpec,
    ScoreModSpec,
    StaticMask,
)
from cudnn_attn.core.environment import Environment
from cudnn_attn.core.types import AttentionLayout
from cudnn_attn.persist.store import (
    AUTOTUNED,
    FORMAT_VERSION,
    HEURISTIC,
    MAGIC,
    NotPersistable,
    PlanKey,
    PlanStore,
    PlanStoreWarning,
    config_fields,
    default_directory,
    default_store,
    encode_entry,
    key_digest,
)

ENV = Environment(cudnn_version=91900, compute_capability=(9, 0), device_name="NVIDIA H200", sm_count=132,
                  frontend_version="1.32.0")
BASE = AttentionConfig(batch=2, q_heads=4, kv_heads=4, q_len=128, kv_len=128, qk_dim=64, v_dim=64,
                       dtype="float16", scale=0.125, training=True)
PAYLOAD = bytes(np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8))


def key(config=BASE, kind="fwd", choice=HEURISTIC, environment=ENV, rng_dump=False) -> PlanKey:
    return PlanKey(config, kind, choice, environment, rng_dump)


def softcap(score, cap):
    return cap * score


@dataclass(frozen=True)
class FingerprintedScoreMod(ScoreModSpec):
    """A ScoreModSpec with the program fingerprint the score_mod tracer provides."""

    fingerprint: str = ""


@pytest.fixture
def store(tmp_path) -> PlanStore:
    return PlanStore(tmp_path / "plans")


# -- the key -------------------------------------------------------------------------------------------
def _changed(value):
    """Another valid value of the same kind as ``value``."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 0.5 + 0.25
    if isinstance(value, str):
        return "bfloat16" if value != "bfloat16" else "float16"
    if isinstance(value, AttentionLayout):
        return AttentionLayout.BNTH if value is AttentionLayout.BTNH else AttentionLayout.BTNH
    raise AssertionError(f"no variant for {value!r}")


NESTED = {
    "q_heads": [8], "kv_heads": [2],                  # query heads stay a multiple of key/value heads
    "mask": [StaticMask(right_bound=0), StaticMask(right_bound=0, alignment=DiagonalAlignment.BOTTOM_RIGHT),
             StaticMask(left_bound=16, right_bound=0), StaticMask(padding=True),
             StaticMask(right_bound=0, alibi=True)],
    "bias": [BiasSpec((1, 4, 128, 128), True), BiasSpec((1, 4, 128, 128), False), BiasSpec((2, 1, 128, 128), True)],
    "packing": [PackingSpec(2), PackingSpec(3)],
    "paging": [PagingSpec(8, 8, 32, 4), PagingSpec(9, 8, 32, 4), PagingSpec(8, 8, 64, 2)],
    "score_mod": [FingerprintedScoreMod(softcap, (((), "float32"),), fingerprint="a1"),
                  FingerprintedScoreMod(softcap, (((), "float32"),), fingerprint="b2"),
                  FingerprintedScoreMod(softcap, (), fingerprint="a1")],
    "strides": [InputStrides(query=(128 * 4 * 64, 64, 4 * 64 * 2, 1)), InputStrides(key=(128 * 4 * 64, 64, 4 * 64, 1))],
}


# Fields that exist only beside another: device_seed with dropout (AttentionConfig clears it otherwise).
NEEDS = {"device_seed": {"dropout_rate": 0.1}}


def test_every_config_field_changes_the_key():
    digests = {key_digest(key())}
    for field in dataclasses.fields(AttentionConfig):
        variants = NESTED.get(field.name) or [_changed(getattr(BASE, field.name))]
        base = BASE.replace(**NEEDS.get(field.name, {}))
        for variant in variants:
            digest = key_digest(key(base.replace(**{field.name: variant})))
            assert digest not in digests, f"{field.name}={variant!r} does not change the key"
            digests.add(digest)
    assert len(digests) == 1 + sum(len(NESTED.get(f.name) or [0]) for f in dataclasses.fields(AttentionConfig))


def test_kind_choice_rng_dump_and_every_environment_field_change_the_key():
    variants = [key(kind="bwd"), key(choice="eng2_k24=7"), key(choice="eng9_k24=7"), key(choice=AUTOTUNED),
                key(rng_dump=True)]
    for field in dataclasses.fields(Environment):
        value = getattr(ENV, field.name)
        changed = (9, 0) if value == (10, 0) else (10, 0) if isinstance(value, tuple) else _changed(value)
        variants.append(key(environment=dataclasses.replace(ENV, **{field.name: changed})))
    digests = [key_digest(k) for k in [key(), *variants]]
    assert len(set(digests)) == len(digests)


def test_the_key_is_plain_json_of_named_fields():
    fields = config_fields(BASE.replace(mask=StaticMask(right_bound=0), layout=AttentionLayout.BNTH))
    assert fields["__type__"] == "AttentionConfig" and fields["layout"] == "AttentionLayout.BNTH"
    assert fields["mask"] == {"__type__": "StaticMask", "right_bound": 0, "left_bound": None,
                              "alignment": "DiagonalAlignment.TOP_LEFT", "padding": False, "alibi": False}
    assert fields["scale"] == 0.125
    json.dumps(key().to_json(), allow_nan=False)       # plain JSON, nothing else


def test_score_mod_is_keyed_by_its_fingerprint_not_the_function():
    def other(score, cap):
        return score
    one = BASE.replace(score_mod=FingerprintedScoreMod(softcap, (), fingerprint="same-program"))
    two = BASE.replace(score_mod=FingerprintedScoreMod(other, (), fingerprint="same-program"))
    assert key_digest(key(one)) == key_digest(key(two))
    method = type("WithMethod", (ScoreModSpec,), {"fingerprint": lambda self: "same-program"})
    assert key_digest(key(BASE.replace(score_mod=method(softcap, ())))) == key_digest(key(one))


def test_score_mod_without_fingerprint_is_not_persistable():
    config = BASE.replace(score_mod=ScoreModSpec(softcap, (((), "float32"),)))
    with pytest.raises(NotPersistable, match="score_mod"):
        key_digest(key(config))


def test_objects_without_a_stable_form_are_not_persistable():
    with pytest.raises(NotPersistable, match="config.mask"):
        config_fields(BASE.replace(mask=object()))


def test_the_key_is_stable_across_processes():
    """Another interpreter with another hash seed computes the same digest."""
    script = textwrap.dedent("""
        from cudnn_attn.core.config import AttentionConfig, StaticMask, BiasSpec
        from cudnn_attn.core.environment import Environment
        from cudnn_attn.persist.store import PlanKey, key_digest
        env = Environment(91900, (9, 0), "NVIDIA H200", 132, "1.32.0")
        config = AttentionConfig(batch=2, q_heads=4, kv_heads=4, q_len=128, kv_len=128, qk_dim=64, v_dim=64,
                                 dtype="float16", scale=0.125, training=True, mask=StaticMask(right_bound=0),
                                 bias=BiasSpec((1, 4, 128, 128), True))
        print(key_digest(PlanKey(config, "bwd", "heuristic", env)))
    """)
    here = key_digest(key(BASE.replace(mask=StaticMask(right_bound=0), bias=BiasSpec((1, 4, 128, 128), True)), "bwd"))
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert out.stdout.strip() == here


# -- saving and loading --------------------------------------------------------------------------------
def test_save_then_load_round_trips(store):
    meta = {"plan_name": "eng2_k24=7", "workspace_size": 256, "uids": {"Q": 1}}
    path = store.save(key(), PAYLOAD, meta)
    entry = store.load(key())
    assert entry is not None and entry.path == path and entry.payload == PAYLOAD
    assert entry.meta["plan_name"] == "eng2_k24=7" and entry.key == key().to_json()
    assert store.load(key(kind="bwd")) is None                      # another key: nothing, no warning


def test_folder_is_created_0700_and_files_0600(tmp_path):
    old = os.umask(0)
    try:
        store = PlanStore(tmp_path / "a" / "b" / "plans")
        path = store.save(key(), PAYLOAD, {})
    finally:
        os.umask(old)
    assert stat.S_IMODE(store.directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_an_existing_folder_keeps_its_permissions(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    PlanStore(folder).save(key(), PAYLOAD, {})
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755


def test_writes_are_atomic(store, monkeypatch):
    """A write that fails before the rename leaves the old entry intact and no temporary file."""
    store.save(key(), PAYLOAD, {"plan_name": "old"})

    def broken_replace(source, target):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.warns(PlanStoreWarning, match="No space left"):
        assert store.save(key(), b"new" * 100, {"plan_name": "new"}) is None
    monkeypatch.undo()
    assert store.load(key()).meta["plan_name"] == "old"
    assert [p.name for p in store.directory.iterdir()] == [store.path(key()).name]


def test_an_unwritable_store_warns_once(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    store = PlanStore(blocker / "plans")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.save(key(), PAYLOAD, {}) is None
        assert store.save(key(kind="bwd"), PAYLOAD, {}) is None
    assert [w.category for w in caught] == [PlanStoreWarning]


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flipped-payload-byte":
        data[-100] ^= 0x01
    elif how == "flipped-header-byte":
        data[len(MAGIC) + 10] ^= 0x20
    elif how == "truncated":
        data = data[: len(data) // 2]
    elif how == "empty":
        data = bytearray()
    elif how == "bad-magic":
        data[:4] = b"XXXX"
    elif how == "garbage":
        data = bytearray(np.random.default_rng(3).integers(0, 256, 500, dtype=np.uint8).tobytes())
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flipped-payload-byte", "flipped-header-byte", "truncated", "empty", "bad-magic",
                                 "garbage"])
def test_a_damaged_entry_is_ignored_with_one_warning_then_overwritten(store, how):
    store.save(key(), PAYLOAD, {"plan_name": "first"})
    _damage(store.path(key()), how)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.load(key()) is None
        assert store.load(key()) is None                            # the same file again: no second warning
    assert [w.category for w in caught] == [PlanStoreWarning], [str(w.message) for w in caught]
    assert str(store.path(key())) in str(caught[0].message)
    store.save(key(), PAYLOAD, {"plan_name": "rebuilt"})             # what the caller does next
    assert store.load(key()).meta["plan_name"] == "rebuilt"


def _rewrite_header(path: Path, change) -> None:
    """Re-encode an entry with a changed header and a *valid* checksum (a file from another version)."""
    import hashlib
    import struct

    data = path.read_bytes()
    (length,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    header = json.loads(data[start:start + length])
    change(header)
    payload = data[start + length:-32]
    new_header = json.dumps(header).encode()
    body = MAGIC + struct.pack("<I", len(new_header)) + new_header + payload
    path.write_bytes(body + hashlib.sha256(body).digest())


@pytest.mark.parametrize("change, reason", [
    (lambda h: h.update(format=FORMAT_VERSION + 1), "format"),
    (lambda h: h["key"]["environment"].update(cudnn_version=92800), "different key"),
    (lambda h: h.update(payload_bytes=1), "payload length"),
], ids=["foreign-format-version", "foreign-key", "inconsistent-length"])
def test_a_foreign_entry_is_ignored_with_one_warning(store, change, reason):
    store.save(key(), PAYLOAD, {})
    _rewrite_header(store.path(key()), change)
    with pytest.warns(PlanStoreWarning, match=reason):
        assert store.load(key()) is None


def test_an_unreadable_entry_is_ignored_with_one_warning(store):
    store.save(key(), PAYLOAD, {})
    path = store.path(key())
    path.unlink()
    path.mkdir()                                                    # reading a folder fails with an OSError
    with pytest.warns(PlanStoreWarning, match="unreadable"):
        assert store.load(key()) is None


def test_encoded_entries_carry_a_sha256_of_everything():
    data = encode_entry(key(), PAYLOAD, {"a": 1})
    import hashlib

    assert data.startswith(MAGIC) and data[-32:] == hashlib.sha256(data[:-32]).digest()
    assert PAYLOAD in data


WRITER = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("error")
    from cudnn_attn.core.config import AttentionConfig
    from cudnn_attn.core.environment import Environment
    from cudnn_attn.persist.store import PlanKey, PlanStore
    env = Environment(91900, (9, 0), "NVIDIA H200", 132, "1.32.0")
    config = AttentionConfig(batch=2, q_heads=4, kv_heads=4, q_len=128, kv_len=128, qk_dim=64, v_dim=64,
                             dtype="float16", scale=0.125, training=True)
    key = PlanKey(config, "fwd", "heuristic", env)
    store = PlanStore(sys.argv[1])
    payload = bytes(range(256)) * 2000
    for i in range(int(sys.argv[2])):
        assert store.save(key, payload, {"writer": sys.argv[3]}) is not None
        entry = store.load(key)
        assert entry is not None and entry.payload == payload, "a reader saw a partial entry"
    print("ok")
""")


def test_two_processes_filling_one_key_both_succeed(tmp_path):
    folder = tmp_path / "plans"
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(folder), "40", name], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    results = [w.communicate(timeout=120) for w in writers]
    assert [w.returncode for w in writers] == [0, 0], results
    entry = PlanStore(folder).load(key())
    assert entry is not None and entry.meta["writer"] in ("a", "b")
    assert [p.name for p in folder.iterdir()] == [PlanStore(folder).path(key()).name]   # no temporaries left


# -- location, listing, clearing -----------------------------------------------------------------------
@pytest.mark.parametrize("value", ["off", "OFF", " off "])
def test_cache_dir_off_turns_the_store_off(monkeypatch, value):
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", value)
    assert PlanStore.from_env() is None and default_directory() is None


def test_the_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", str(tmp_path / "mine"))
    assert PlanStore.from_env().directory == tmp_path / "mine"
    monkeypatch.delenv("CUDNN_ATTN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert PlanStore.from_env().directory == tmp_path / "xdg" / "cudnn_attn"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")          # ignored, as the XDG spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert PlanStore.from_env().directory == tmp_path / "home" / ".cache" / "cudnn_attn"


def test_entries_info_and_clear(store):
    store.save(key(), PAYLOAD, {"description": "fwd a", "plan_name": "eng2_k24=7"})
    store.save(key(kind="bwd"), PAYLOAD, {"description": "bwd a", "plan_name": "eng6_k24=26"})
    _damage(store.path(key(kind="bwd")), "truncated")
    rows = store.entries()
    assert [(r.entry, r.plan, r.error is None) for r in rows] == [
        ("plan", "eng2_k24=7", True), ("?", "", False)]
    assert rows[0].environment == "NVIDIA H200 sm90 cuDNN 91900"
    info = store.info()
    assert (info.entries, info.bad_entries) == (1, 1) and info.bytes == sum(r.size for r in rows)
    (store.directory / ".tmp-leftover.entry").write_bytes(b"x")
    assert store.clear() == 2
    assert list(store.directory.iterdir()) == [] and store.entries() == []


def test_a_missing_folder_lists_nothing(tmp_path):
    store = PlanStore(tmp_path / "never")
    assert store.entries() == [] and store.clear() == 0 and store.info().entries == 0
    assert not store.directory.exists()


def test_the_default_store_is_one_instance_per_location(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", str(tmp_path / "one"))
    first = default_store()
    assert default_store() is first and first.directory == tmp_path / "one"
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", str(tmp_path / "two"))
    assert default_store().directory == tmp_path / "two"
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", "off")
    assert default_store() is None
