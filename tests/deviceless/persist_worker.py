"""One deviceless process of the plan-store tests: ``python persist_worker.py STORE ACTION [CASES...]``.

Started by ``test_persist_deviceless.py`` with the stub ``libcuda.so.1`` on ``LD_LIBRARY_PATH`` (where
there is no driver), so every action runs in a fresh process, as a user's next program would.  It
prints one JSON object on its last stdout line (cuDNN's console output goes to stderr):

* ``build CASE...``   -- ``build_or_load`` each case (``name:kind``) against the store: origin, plan,
  workspace, uids, and for loaded graphs what the launch path reads of them;
* ``remember CASE PLAN`` / ``recall CASE`` -- the autotuning record.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))      # tests/: the matrix configurations

from deviceless.matrix import (  # noqa: E402
    BR_PADDING_CAUSAL,
    CAUSAL,
    PADDING_CAUSAL,
    config,
    fp8,
    packed,
    paged,
)

CASES = {
    "causal": config(mask=CAUSAL),
    "causal-T256": config(mask=CAUSAL, q_len=256, kv_len=256),
    "causal-T384": config(mask=CAUSAL, q_len=384, kv_len=384),
    "causal-T512": config(mask=CAUSAL, q_len=512, kv_len=512),
    "plain": config(),
    "plain-T256": config(q_len=256, kv_len=256),
    "plain-T384": config(q_len=384, kv_len=384),
    "dropout": config(dropout_rate=0.1, mask=CAUSAL),
    "packed": config(packing=packed(), mask=PADDING_CAUSAL),
    "paged-decode": config(q_len=1, training=False, paging=paged(), mask=BR_PADDING_CAUSAL),
    "fp8-causal": fp8(mask=CAUSAL),
}


def _case(text: str):
    name, _, kind = text.partition(":")
    return CASES[name], kind or "fwd"


def _describe(built) -> dict:
    from cudnn_attn.engine.launch import Launcher

    graph = built.graph
    facts = {"origin": built.origin, "plan": built.plan_name, "workspace": built.workspace_size,
             "uids": {t.name: uid for t, uid in built.uids.items()}, "launch_path": Launcher(built).path,
             "variant_pack": list(graph._variant_pack_uids() or ())}
    if built.origin == "loaded":
        facts.update(ranked_plans=len(graph._plans),
                     raw_execute=hasattr(graph._lowered_graph, "_execute_with_raw_ptrs"))
    return facts


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)                                   # cuDNN's printf output must not corrupt the reply
    store_dir, action, *args = sys.argv[1:]
    from cudnn_attn.graphs import DevicelessTarget
    from cudnn_attn.persist.build import autotuned_engine_plan, build_or_load, environment_for, remember_autotuned
    from cudnn_attn.persist.store import PlanStore, PlanStoreWarning

    store, target = PlanStore(store_dir), DevicelessTarget.h200()
    env = environment_for(target)
    reply: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if action == "build":
            reply["graphs"] = {text: _describe(build_or_load(*_case(text), target, store=store)) for text in args}
        elif action == "remember":
            remember_autotuned(store, *_case(args[0]), args[1], environment=env, timings={args[1]: 1.0})
        elif action == "recall":
            reply["plan"] = autotuned_engine_plan(store, *_case(args[0]), environment=env)
        else:
            raise SystemExit(f"unknown action {action!r}")
    reply["warnings"] = [str(w.message) for w in caught if issubclass(w.category, PlanStoreWarning)]
    replies.write(json.dumps(reply) + "\n")
    replies.flush()


if __name__ == "__main__":
    main()
