"""What an attention call site is: the static description the FFI handler looks up at run time.

An XLA FFI call carries typed attributes, not Python objects.  Each call site therefore carries one
int64 attribute, ``key``, into a process-local :class:`CallRegistry` of :class:`AttentionCall` entries
(configuration, forward or backward, dropout seed).  Registration happens when the call site is
lowered; the handler only reads the entry.  Consequence: a lowered or compiled computation is only
meaningful in the process that lowered it - it cannot be serialised with ``jax.export`` or reloaded
from a persistent compilation cache by another process (the key would point nowhere; the handler
then fails with a clear error rather than guessing).

Lifetime (:class:`Holds`).  A key is held by every live executable that calls it - the FFI targets are
registered with an *instantiate* stage whose state XLA destroys with the executable
(:func:`.ffi.make_handler`), which :meth:`Holds.pin` counts until the next instantiation (or
:func:`.ffi.release_destroyed_states`) finds it destroyed - and by the most recent lowerings, so that
a lowering compiled a little later still resolves.  When neither holds it the entry is released, and a
later lowering of the same call site gets a new key (keys are never reused).  The GPU target holds its
cuDNN plans the same way, with the graph cache's bound for recent lowerings (:mod:`.cudnn_target`).
Without the instantiate stage (a JAX without ``jax.ffi.register_ffi_type``) nothing is released:
executables could not say when they die.

:class:`CallOptions` is the static "how to run" companion of the configuration on the primitives:
the dropout seed (cuDNN binds it by value on the host, so under XLA it is a compile-time constant, as
in JAX's own cuDNN attention), the backend (a named FFI target, or ``jax.pure_callback``) and whether
XLA may capture the call into a CUDA graph (by default it may).
"""

from __future__ import annotations

import collections
import enum
import threading
from dataclasses import dataclass
from typing import Any, Callable

from cudnn_attn.core.config import AttentionConfig

from .signature import KINDS, operand_names, result_names

TARGET = "cudnn_attn"              # the FFI target: reference on CPU; cuDNN on CUDA, capturable into CUDA graphs
EAGER_TARGET = "cudnn_attn_eager"  # the same cuDNN handler without the command-buffer trait (cuda_graph=False)


class Backend(enum.Enum):
    """How the inner primitive is called from XLA.

    * ``FFI``: a named XLA FFI target whose handler is Python (ctypes).  Runs the cuDNN graph on
      XLA's stream and buffers on GPU, the NumPy reference on CPU host buffers (zero copy in both
      cases); works under ``jit``, ``vmap``, ``grad``, ``shard_map`` and automatic partitioning.
    * ``CALLBACK``: ``jax.pure_callback`` running the NumPy reference on host copies, for
      environments where an FFI target cannot be registered.  Not partitioned (under automatic
      sharding XLA gathers the operands to one device); ``shard_map`` works.
    """

    FFI = "ffi"
    CALLBACK = "callback"

    @classmethod
    def parse(cls, value: "str | Backend") -> "Backend":
        try:
            return value if isinstance(value, Backend) else cls(value)
        except ValueError:
            raise ValueError(f"backend: expected one of {[b.value for b in cls]}, got {value!r}") from None


@dataclass(frozen=True)
class CallOptions:
    """Static execution options of one attention call (hashable: a primitive parameter).

    ``seed`` is the dropout seed (0 when there is no dropout, so that it never splits caches);
    ``cuda_graph`` (default) lets XLA capture the GPU call into its CUDA graphs (command buffers);
    ``False`` makes XLA run the Python handler on every execution.  ``context`` says how a call whose
    sequence is split over devices runs (:mod:`.context_parallel`; ``None``: the default).
    """

    seed: int = 0
    backend: Backend = Backend.FFI
    cuda_graph: bool = True
    context: Any = None          # a context_parallel.ContextParallel: how a sequence-sharded call runs


@dataclass(frozen=True)
class AttentionCall:
    """One call site of the inner primitive: what to compute (``config``, ``kind``) and the dropout ``seed``."""

    config: AttentionConfig
    kind: str
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")

    @property
    def operands(self) -> tuple[str, ...]:
        return operand_names(self.config, self.kind)

    @property
    def results(self) -> tuple[str, ...]:
        return result_names(self.config, self.kind)


class Holds:
    """Which keys are still held: the ``recent()`` most recently :meth:`touch`-ed keys, and every key with a
    :meth:`pin` not yet released.  ``release(key)`` is called (under the lock, so that no pin can slip in
    between; it must not call back into this object) when neither holds a key, once :attr:`releasing` is
    set; until then nothing is released.  Thread-safe."""

    def __init__(self, recent: Callable[[], int], release: Callable[[int], None]):
        self._lock = threading.Lock()
        self._recent: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._recent_size = recent
        self.pins: collections.Counter[int] = collections.Counter()   # key -> pins (read-only outside)
        self._release = release
        self.releasing = False

    def touch(self, key: int) -> None:
        with self._lock:
            self._recent[key] = None
            self._recent.move_to_end(key)
            while len(self._recent) > max(1, self._recent_size()):
                oldest, _ = self._recent.popitem(last=False)
                self._release_if_free(oldest)

    def pin(self, key: int) -> Callable[[], None]:
        """Hold ``key`` until the returned function is called (once; later calls do nothing)."""
        with self._lock:
            self.pins[key] += 1
        done = []

        def unpin() -> None:
            with self._lock:
                if done:
                    return
                done.append(True)
                self.pins[key] -= 1
                if self.pins[key] <= 0:
                    del self.pins[key]
                self._release_if_free(key)

        return unpin

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"recent": len(self._recent), "pinned": len(self.pins), "pins": sum(self.pins.values())}

    def _release_if_free(self, key: int) -> None:
        """Release ``key`` when nothing holds it.  Under the lock: a pin or touch of another thread can come
        neither between the decision and the release nor half-way through it (the release hooks take their
        own locks, never this one)."""
        if self.releasing and key not in self._recent and self.pins.get(key, 0) <= 0:
            self._release(key)


class CallRegistry:
    """Process-local, thread-safe ``key <-> AttentionCall`` table whose entries live while :attr:`holds`
    holds them (see the module doc).  Equal call sites share one key while it lives, so lowering the same
    computation twice produces the same HLO.

    Args:
        recent: how many recent lowerings hold their key (read at each lowering).
    """

    def __init__(self, recent: Callable[[], int] = lambda: 1024):
        self._lock = threading.Lock()
        self._keys: dict[AttentionCall, int] = {}
        self._calls: dict[int, AttentionCall] = {}
        self._next = 0
        self._hooks: list[Callable[[int], None]] = []
        self.holds = Holds(recent, self._drop)

    def key(self, call: AttentionCall) -> int:
        """The key of ``call`` at a lowering: registered if new, and held as a recent lowering."""
        with self._lock:
            key = self._keys.get(call)
            if key is None:
                key = self._keys[call] = self._next
                self._calls[key] = call
                self._next += 1
        self.holds.touch(key)
        return key

    def call(self, key: int) -> AttentionCall:
        found = self._calls.get(key)
        if found is None:
            raise LookupError(
                f"attention call-site key {key} is not registered in this process: the computation was lowered "
                "in another process (cudnn_attn's JAX lowering is process-local and cannot be exported)")
        return found

    def on_release(self, hook: Callable[[int], None]) -> None:
        """Call ``hook(key)`` after an entry is released."""
        self._hooks.append(hook)

    def _drop(self, key: int) -> None:
        with self._lock:
            call = self._calls.pop(key, None)
            if call is not None and self._keys.get(call) == key:
                del self._keys[call]
        for hook in self._hooks:
            hook(key)

    def __len__(self) -> int:
        return len(self._calls)


registry = CallRegistry()
