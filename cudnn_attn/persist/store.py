"""The persistent plan store: built cuDNN plans that survive the process.

Building an attention graph costs 0.4-1.1 s on the H200 (heuristics and NVRTC compilation);
deserializing the same plan from ``pygraph.serialize()`` costs about 4 ms (research notes §5).  The
store keeps those serialized plans on disk, next to what is needed to use them again: the plan
name, the workspace size and the tensor uids.

Location
    ``$CUDNN_ATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/cudnn_attn``, else ``~/.cache/cudnn_attn``;
    ``CUDNN_ATTN_CACHE_DIR=off`` turns the store off (:meth:`PlanStore.from_env` returns ``None``).
    The folder is created on the first write, mode 0700 (plans embed compiled kernels and the
    device description; nothing in them is secret, but nothing in them is anyone else's either).

Key
    :class:`PlanKey`: everything that changes a plan - the :class:`~cudnn_attn.core.config.AttentionConfig`
    (an explicit field-by-field serialization, :func:`config_fields`; a ``score_mod`` is keyed by its
    program fingerprint, never by the function object), the graph kind, the plan choice (cuDNN's
    heuristic, a named plan, or an autotuning record), ``rng_dump``, and :func:`environment_fields`
    (cuDNN, frontend and library versions, a digest of the graph builder's sources, and the GPU's
    compute capability, name and SM count).  The file name is the SHA-256 of the key's canonical
    JSON; the file holds the key itself, compared on every load.

Files
    Plain bytes and JSON, never pickle: ``MAGIC | u32 header length | header JSON | payload |
    SHA-256 of everything before it``.  Writes go to a temporary file in the same folder, are synced
    and moved into place with ``os.replace``, so a reader sees a whole old or a whole new entry and
    two processes filling the same key at once both succeed (the last rename wins; both entries are
    equal).  A corrupt, truncated, foreign-format or unreadable entry is ignored with **one**
    :class:`PlanStoreWarning` (``warnings.warn``, once per file and process) and the caller rebuilds
    and overwrites it.  A store that cannot be written warns once and the process carries on
    without persisting.

Nothing here imports cuDNN, CuPy or JAX.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import json
import math
import numbers
import os
import struct
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Protocol

from cudnn_attn.core import settings
from cudnn_attn.core.config import ScoreModSpec
from cudnn_attn.core.environment import VERSION, Environment

ENV_VAR = settings.CACHE_DIR
OFF = "off"
FORMAT_VERSION = 1
MAGIC = b"CUDNNATTN-STORE\n"
SUFFIX = ".entry"
_LENGTH = struct.Struct("<I")
_DIGEST_BYTES = hashlib.sha256().digest_size
_MAX_HEADER = 1 << 24


class PlanStoreWarning(UserWarning):
    """A store entry was ignored (corrupt, truncated, foreign, unreadable) or the store cannot be written."""


class NotPersistable(ValueError):
    """A configuration that cannot be keyed stably (a ``score_mod`` without a program fingerprint)."""


# ---------------------------------------------------------------------------------------------------
# The key
# ---------------------------------------------------------------------------------------------------
def config_fields(config: Any) -> dict[str, Any]:
    """``config`` (a frozen dataclass) as plain JSON values, field by field, recursively.

    Enums become ``"Type.MEMBER"``, nested dataclasses dicts tagged with their type, tuples lists,
    floats stay floats (JSON writes the shortest repr, which round-trips exactly).  A
    ``ScoreModSpec`` is represented by its program fingerprint (:func:`score_mod_fingerprint`) and
    its other non-callable fields.  Any other type raises :class:`NotPersistable`: the key must never
    depend on ``repr`` or object identity.
    """
    return _plain(config, "config")


def score_mod_fingerprint(spec: Any) -> str:
    """The stable program fingerprint of a ``ScoreModSpec``: its ``fingerprint`` attribute or method.

    Raises :class:`NotPersistable` when the spec has none (a graph keyed by a function object cannot
    be found again by another process)."""
    value = getattr(spec, "fingerprint", None)
    if callable(value):
        value = value()
    if isinstance(value, bytes):
        value = value.hex()
    if not isinstance(value, str) or not value:
        raise NotPersistable(
            f"score_mod {getattr(spec, 'name', spec)!r} has no program fingerprint: its graph is kept for this "
            "process only")
    return value


def _plain(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else repr(number)
    if isinstance(value, (tuple, list)):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        score_mod = isinstance(value, ScoreModSpec)
        fields = {"__type__": ScoreModSpec.__name__ if score_mod else type(value).__name__}
        if score_mod:
            fields["fingerprint"] = score_mod_fingerprint(value)
        for field in dataclasses.fields(value):
            item = getattr(value, field.name)
            if field.name in fields or (score_mod and callable(item)):     # the program, not the function
                continue
            fields[field.name] = _plain(item, f"{where}.{field.name}")
        return fields
    raise NotPersistable(f"{where}: a {type(value).__name__} has no stable serialization for the plan store")


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


@functools.lru_cache(maxsize=None)
def builder_digest() -> str:
    """SHA-256 of the graph builder's sources (``cudnn_attn/graphs/*.py``), so that a development
    checkout never loads a plan its current builder would declare differently."""
    import importlib.util

    spec = importlib.util.find_spec("cudnn_attn.graphs")
    digest = hashlib.sha256()
    for folder in spec.submodule_search_locations or ():
        for path in sorted(Path(folder).glob("*.py")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def environment_fields(environment: Environment) -> dict[str, Any]:
    """What outside the configuration changes a serialized plan: the build target (``environment``), the
    library's version and a digest of the graph builder's sources."""
    fields = {f.name: _plain(getattr(environment, f.name), f.name) for f in dataclasses.fields(environment)}
    return {**fields, "library_version": VERSION, "builder_digest": builder_digest()}


class StoreKey(Protocol):
    """What :class:`PlanStore` needs of a key: a JSON description and a one-line summary."""

    entry: str

    def to_json(self) -> dict[str, Any]: ...

    def describe(self) -> str: ...


HEURISTIC = "heuristic"
AUTOTUNED = "autotuned"


@dataclass(frozen=True)
class PlanKey:
    """One stored plan (or autotuning record) of ``config``'s ``kind`` graph in ``environment``.

    ``choice`` is :data:`HEURISTIC` (cuDNN's best-ranked plan), a plan name such as ``"eng2_k24=7"``
    (that plan, pinned) or :data:`AUTOTUNED` (a record of the autotuning winner's name, no plan).
    """

    config: Any
    kind: str
    choice: str
    environment: Environment
    rng_dump: bool = False

    @property
    def entry(self) -> str:
        return "choice" if self.choice == AUTOTUNED else "plan"

    def to_json(self) -> dict[str, Any]:
        return {"entry": self.entry, "config": config_fields(self.config), "kind": self.kind,
                "choice": self.choice, "rng_dump": self.rng_dump, "environment": environment_fields(self.environment)}

    def describe(self) -> str:
        return f"{self.kind} {self.config.describe()} [{self.choice}]"


def key_digest(key: StoreKey) -> str:
    """The SHA-256 (hex) of the key's canonical JSON with the store format version."""
    return hashlib.sha256(_canonical({"format": FORMAT_VERSION, "key": key.to_json()})).hexdigest()


# ---------------------------------------------------------------------------------------------------
# Entry files
# ---------------------------------------------------------------------------------------------------
class Entry(NamedTuple):
    """A verified entry: the key it was saved under (JSON), its metadata and payload bytes."""

    path: Path
    key: dict[str, Any]
    meta: dict[str, Any]
    payload: bytes


class EntryInfo(NamedTuple):
    """One file of the store as listed by :meth:`PlanStore.entries` (``error`` is set for a bad file)."""

    path: Path
    size: int
    entry: str
    description: str
    plan: str
    environment: str
    created: float
    error: str | None


class StoreInfo(NamedTuple):
    directory: Path
    entries: int
    bad_entries: int
    bytes: int


class _BadEntry(Exception):
    pass


def encode_entry(key: StoreKey, payload: bytes, meta: dict[str, Any]) -> bytes:
    """The bytes of one entry file (see the module doc)."""
    header = _canonical({"format": FORMAT_VERSION, "digest": key_digest(key), "key": key.to_json(),
                         "meta": meta, "payload_bytes": len(payload)})
    body = MAGIC + _LENGTH.pack(len(header)) + header + bytes(payload)
    return body + hashlib.sha256(body).digest()


def decode_entry(data: bytes) -> tuple[dict[str, Any], bytes]:
    """``(header, payload)`` of an entry file's bytes; raises ``_BadEntry`` saying what is wrong."""
    if not data.startswith(MAGIC):
        raise _BadEntry("not a cudnn_attn store entry (bad magic)")
    if len(data) < len(MAGIC) + _LENGTH.size + _DIGEST_BYTES:
        raise _BadEntry(f"truncated ({len(data)} bytes)")
    body, checksum = data[:-_DIGEST_BYTES], data[-_DIGEST_BYTES:]
    (length,) = _LENGTH.unpack_from(body, len(MAGIC))
    start = len(MAGIC) + _LENGTH.size
    if length > _MAX_HEADER or start + length > len(body):
        raise _BadEntry(f"truncated or corrupt (header of {length} bytes in a {len(data)}-byte file)")
    if hashlib.sha256(body).digest() != checksum:
        raise _BadEntry("checksum mismatch (corrupt or truncated)")
    try:
        header = json.loads(body[start:start + length])
    except ValueError as exc:
        raise _BadEntry(f"unreadable header ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION:
        found = header.get("format") if isinstance(header, dict) else None
        raise _BadEntry(f"written in store format {found!r}; this library reads format {FORMAT_VERSION}")
    payload = body[start + length:]
    if header.get("payload_bytes") != len(payload):
        raise _BadEntry("payload length does not match its header")
    return header, payload


class PlanStore:
    """A folder of store entries (see the module doc).  Thread-safe; safe across processes."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory).expanduser()
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._writable = True

    @classmethod
    def from_env(cls) -> "PlanStore | None":
        """The store the environment names, or ``None`` when ``CUDNN_ATTN_CACHE_DIR=off``."""
        directory = default_directory()
        return None if directory is None else cls(directory)

    def __repr__(self) -> str:
        return f"PlanStore({str(self.directory)!r})"

    def path(self, key: StoreKey) -> Path:
        return self.directory / f"{key.entry}-{key_digest(key)[:40]}{SUFFIX}"

    # -- reading -------------------------------------------------------------------------------
    def load(self, key: StoreKey) -> Entry | None:
        """The entry saved under ``key``, or ``None`` when there is none or it is unusable (then one
        :class:`PlanStoreWarning` says why; the caller rebuilds and :meth:`save` overwrites it)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.reject(path, f"unreadable ({exc.strerror or exc})")
            return None
        try:
            header, payload = decode_entry(data)
            if header.get("digest") != key_digest(key) or header.get("key") != key.to_json():
                raise _BadEntry("saved under a different key (hash collision or edited file)")
        except _BadEntry as exc:
            self.reject(path, str(exc))
            return None
        return Entry(path, header["key"], header.get("meta", {}), payload)

    def reject(self, path: Path, reason: str) -> None:
        """Warn (once per file and process) that the entry at ``path`` is ignored and will be rebuilt."""
        self._warn(f"ignoring plan store entry {path}: {reason}; it is rebuilt", str(path))

    def _warn(self, message: str, once_key: str) -> None:
        with self._lock:
            if once_key in self._warned:
                return
            self._warned.add(once_key)
        warnings.warn(message, PlanStoreWarning, stacklevel=3)

    # -- writing -------------------------------------------------------------------------------
    def save(self, key: StoreKey, payload: bytes, meta: dict[str, Any]) -> Path | None:
        """Write the entry atomically; returns its path, or ``None`` (one warning) when the store
        cannot be written."""
        if not self._writable:
            return None
        data = encode_entry(key, payload, {**meta, "created": time.time()})
        path = self.path(key)
        try:
            self.make_directory()
            descriptor, temporary = tempfile.mkstemp(prefix=".tmp-", suffix=SUFFIX, dir=self.directory)
            try:
                with os.fdopen(descriptor, "wb") as file:
                    file.write(data)
                    file.flush()
                    os.fsync(file.fileno())
                os.replace(temporary, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise
        except OSError as exc:
            self._writable = False
            self._warn(f"cannot write the plan store {self.directory} ({exc.strerror or exc}); plans are not "
                       f"persisted by this process (set {ENV_VAR}=off to silence this)", "write")
            return None
        return path

    def make_directory(self) -> None:
        """Create the folder (mode 0700, whatever the umask) unless it exists; parents as usual."""
        if self.directory.is_dir():
            return
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(self.directory, 0o700)
        except FileExistsError:
            return
        os.chmod(self.directory, 0o700)          # whatever the umask

    # -- listing and clearing ------------------------------------------------------------------
    def _files(self) -> Iterator[Path]:
        try:
            yield from sorted(p for p in self.directory.iterdir() if p.suffix == SUFFIX and not p.name.startswith("."))
        except (FileNotFoundError, NotADirectoryError):
            return

    def entries(self) -> list[EntryInfo]:
        """Every entry file, oldest first, with a description; unusable files carry ``error``."""
        rows = []
        for path in self._files():
            try:
                data = path.read_bytes()
                header, _ = decode_entry(data)
                meta, key = header.get("meta", {}), header.get("key", {})
                env = key.get("environment", {})
                cc = env.get("compute_capability") or ["?", "?"]
                environment = f"{env.get('device_name', '?')} sm{cc[0]}{cc[1]} cuDNN {env.get('cudnn_version', '?')}"
                rows.append(EntryInfo(path, len(data), key.get("entry", "?"), meta.get("description", ""),
                                      meta.get("plan_name", ""), environment, float(meta.get("created", 0.0)), None))
            except (OSError, _BadEntry, AttributeError, TypeError, ValueError) as exc:
                size = path.stat().st_size if path.exists() else 0
                rows.append(EntryInfo(path, size, "?", "", "", "", 0.0, str(exc) or type(exc).__name__))
        return sorted(rows, key=lambda row: (row.error is not None, row.created, row.path.name))

    def clear(self) -> int:
        """Delete every entry (and leftover temporary files); returns how many entries were deleted."""
        removed = 0
        try:
            files = list(self.directory.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            return 0
        for path in files:
            if path.suffix == SUFFIX:
                with contextlib.suppress(OSError):
                    path.unlink()
                    removed += not path.name.startswith(".")
        return removed

    def info(self) -> StoreInfo:
        rows = self.entries()
        return StoreInfo(self.directory, sum(r.error is None for r in rows), sum(r.error is not None for r in rows),
                         sum(r.size for r in rows))


def default_directory() -> Path | None:
    """``$CUDNN_ATTN_CACHE_DIR`` (``None`` for ``off``), else ``$XDG_CACHE_HOME/cudnn_attn`` (an
    absolute ``XDG_CACHE_HOME`` only, as the XDG spec says), else ``~/.cache/cudnn_attn``."""
    value, xdg, _ = settings.cache_location()
    value, xdg = (value or "").strip(), xdg or ""
    if value.lower() == OFF:
        return None
    if value:
        return Path(value).expanduser()
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "cudnn_attn"


_default: tuple[tuple, "PlanStore | None"] | None = None
_default_lock = threading.Lock()


def default_store() -> PlanStore | None:
    """The process's store (:meth:`PlanStore.from_env`), one instance per location so that each bad
    entry warns once per process; the environment is read again when its variables change."""
    global _default
    marker = settings.cache_location()
    with _default_lock:
        if _default is None or _default[0] != marker:
            _default = (marker, PlanStore.from_env())
        return _default[1]
