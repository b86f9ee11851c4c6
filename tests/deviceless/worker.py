"""Deviceless build worker: plans attention graphs for the H200 (sm90) and reports cuDNN's verdicts.

Started by ``conftest.py`` as ``python worker.py`` with ``LD_LIBRARY_PATH`` naming the stub
``libcuda.so.1`` (only on machines without a driver).  Protocol on stdin/stdout: length-prefixed
pickles.  Each request is ``(config, kind, options)`` (``options`` are ``build_graph`` keywords);
each reply a dict: ``ok``, ``plan``, ``plans``, ``workspace``, ``seconds``; for a refusal
``refused_by`` (``"cudnn"``, or ``"builder"`` for the builder's own structural rules) and ``message``;
``error`` (anything else, which fails the test that asked).  The first reply announces
the cuDNN version.  cuDNN's own console output is sent to stderr so it cannot corrupt the protocol.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import time
import traceback
from pathlib import Path
from typing import Any, BinaryIO

_HEADER = struct.Struct("<Q")


def send(stream: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def receive(stream: BinaryIO) -> Any:
    """The next message, or ``None`` at end of stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    return pickle.loads(stream.read(_HEADER.unpack(header)[0]))


def _protocol_streams() -> tuple[BinaryIO, BinaryIO]:
    """Keep the original stdout for replies; point fd 1 (C/C++ printf) and ``sys.stdout`` at stderr."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return sys.stdin.buffer, replies


def _verdict(config: Any, kind: str, options: dict, target: Any) -> dict:
    from cudnn_attn.core.errors import UnsupportedConfigurationError
    from cudnn_attn.graphs import build_graph

    start = time.perf_counter()
    try:
        built = build_graph(config, kind, target, **options)
    except UnsupportedConfigurationError as e:
        refused_by = "cudnn" if e.cudnn_message else "builder"
        return {"ok": False, "refused_by": refused_by, "message": e.cudnn_message or "; ".join(e.reasons),
                "seconds": time.perf_counter() - start}
    except Exception:  # noqa: BLE001 -- reported to the test, which fails
        return {"ok": False, "error": traceback.format_exc(), "seconds": time.perf_counter() - start}
    return {
        "ok": True, "plan": built.plan_name, "workspace": built.workspace_size, "num_plans": built.num_plans,
        "plans": [tuple(p) for p in built.plans], "uids": {t.name: uid for t, uid in built.uids.items()},
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    requests, replies = _protocol_streams()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # tests/: score_mod functions in configs
    import cudnn

    from cudnn_attn.graphs import DevicelessTarget

    target = DevicelessTarget.h200()
    send(replies, {"cudnn_version": cudnn.backend_version()})
    while (request := receive(requests)) is not None:
        config, kind, options = request
        send(replies, _verdict(config, kind, options, target))


if __name__ == "__main__":
    main()
