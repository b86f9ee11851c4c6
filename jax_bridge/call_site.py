"""What an attention call site is: the static description the FFI handler looks up at run time.

An XLA FFI call carries typed attributes, not Python objects.  Each call site therefore carries one
int64 attribute, ``key``, into a process-local :class:`CallRegistry` of :class:`AttentionCall` entries
(configuration, forward or backward, dropout seed).  Registration happens when the call site is
lowered; the handler only reads the entry.  Consequence: a lowered or compiled computation is only
meaningful in the process that lowered it - it cannot be serialised with ``jax.export`` or reloaded
from a persistent compilation cache by another process (the key would point nowhere; the handler
then fails with a clear error rather than guessing).

:class:`CallOptions` is the static "how to run" companion of the configuration on the primitives:
the dropout seed (cuDNN binds it by value on the host, so under XLA it is a compile-time constant, as
in JAX's own cuDNN attention), the backend (a named FFI target, or ``jax.pure_callback``) and whether
XLA may capture the call into a CUDA graph (by default it may).
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import Any

from cudnn_attn.config import AttentionConfig

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


class CallRegistry:
    """Process-local, thread-safe ``key <-> AttentionCall`` table.  Equal call sites share one key, so
    lowering the same computation twice produces the same HLO."""

    def __init__(self):
        self._lock = threading.Lock()
        self._keys: dict[AttentionCall, int] = {}
        self._calls: list[AttentionCall] = []

    def key(self, call: AttentionCall) -> int:
        with self._lock:
            key = self._keys.get(call)
            if key is None:
                key = self._keys[call] = len(self._calls)
                self._calls.append(call)
            return key

    def call(self, key: int) -> AttentionCall:
        if not 0 <= key < len(self._calls):
            raise LookupError(
                f"attention call-site key {key} is not registered in this process: the computation was lowered "
                "in another process (cudnn_attn's JAX lowering is process-local and cannot be exported)")
        return self._calls[key]

    def __len__(self) -> int:
        return len(self._calls)


registry = CallRegistry()
