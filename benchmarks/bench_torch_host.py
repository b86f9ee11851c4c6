"""Host time of one eager torch decode call, by stage, and of a training call: ``cudnn_attn.torch.sdpa`` against
torch's SDPA (not a test).

    python benchmarks/bench_torch_host.py [--out OUT_DIR] [--quick] [--calls 2000] [--rounds 5]

The call: batch 4, 16 query / 4 key-value heads, head dim 64, bf16, one query against S keys in BNTH (a decode step
as transformers makes it), without a mask and with a boolean keep-mask ``(B, 1, 1, S)`` (left padding).  Two cache
kinds: ``fixed`` (S = 512, one signature) and ``growing`` (S = 512 .. 575, a new length every call, every length
seen before: what the dynamic cache's decode steps are in a warm ``generate()``).

Rows, each the host clock per call (``time.perf_counter_ns`` over ``--calls`` calls, the median of ``--rounds``
rounds; the GPU synchronised between rounds, never inside one):

* ``torch sdpa``         - ``torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask, enable_gqa=True)``;
* ``ours``               - ``cudnn_attn.torch.sdpa(q, k, v, keep=..., layout="BNTH")``, the whole call;
* ``ours: guard``        - the known call's tensor guard alone (``api._Fast.matches``: the query's, key's, value's
                           and keep-mask's type, shape, strides, dtype, device and ``requires_grad``);
* ``ours: launch``       - the direct launch of the known call (``api._Fast.launch``: fold, result, stream,
                           ``launch_into``);
* ``ours: fold``         - the keep-mask's fold into a bias alone (``ops._folded``: one ``torch.add``);
* ``ours: empty``        - torch's allocation of the result alone (the launch's: ``torch.empty_like`` of the query);
* ``ours: launch_into``  - ``PreparedCall.launch_into`` on fixed addresses (the engine's launch sequence and
                           cuDNN's execute);
* ``torch sdpa: cuDNN``  - torch SDPA's call with its cuDNN backend alone (``sdpa_kernel``; ``-`` where it refuses);
* ``ours: execute``      - cuDNN's execute alone on the same addresses (the launcher's raw launch under the device
                           lock): what no Python of ours can remove.

The stages on fixed addresses cycle through the lengths as the calls do.  Each row also lists the CUDA kernels one
call of each runs with their device us (``torch.profiler``): which backend torch SDPA chose, and whether the host
waits for the GPU.

What the whole call adds to ``guard`` and ``launch`` is the fast key, its lookup and the checks of the fast path
(``sdpa``'s own lines).
``torch sdpa`` and ``ours`` run their rounds alternately, each round in the other order than the last (a drift of
the host falls on both), and ``ours / torch sdpa`` is the median of the rounds' ratios.

A second table times one eager training call, forward and ``torch.autograd.grad`` of the query, key and value, as
transformers' Llama makes it (batch 2, 256 tokens, causal; the query a ``(B, N, T, H)`` view of ``(B, T, N, H)``
memory, the key and value dense ``(B, K, T, H)``): ``torch sdpa``, ``ours`` (``cudnn_attn.torch.sdpa``:
``AttentionFunction``, no dispatcher) and ``ours: operator`` (the same call through the custom operators,
``torch.ops.cudnn_attn.attention`` and its registered backward), the three alternating by rounds.  The problem is
small enough for its kernels to take less time than the host spends, so each figure is host time.  Its stages:
``ours: forward`` and ``ours: backward``, ``AttentionFunction``'s forward (on the caller's thread) and backward
(on autograd's device thread) timed in place, and ``ours: autograd``, the rest of the call (``torch.autograd.grad``,
the node, the handoff between the threads).  ``torch sdpa: forward call`` and ``ours: forward call`` time the
forward alone, recorded by autograd and its graph dropped with the output (what a training step's forward, which
a small model's GPU waits on, pays per call), alternating by rounds; ``forward / torch sdpa`` their ratio.

Writes ``bench_torch_host.json`` and ``bench_torch_host.png`` into OUT_DIR and prints the table last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

B, N, K, H = 4, 16, 4, 64
FIXED = 512
GROWING = range(512, 576)
TRAIN_B, TRAIN_T = 2, 256


def _timed(fn, calls: int, rounds: int) -> float:
    import torch

    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        for i in range(calls):
            fn(i)
        samples.append((time.perf_counter_ns() - start) / calls / 1e3)
    torch.cuda.synchronize()
    return statistics.median(samples)


def _paired(theirs, ours, calls: int, rounds: int) -> tuple[float, float, float]:
    """Rounds of ``theirs`` and ``ours`` alternating (:func:`_alternating`): each one's median us per call, and the
    median of the rounds' ours / theirs."""
    (first, second), (ratio,) = _alternating((theirs, ours), calls, rounds)
    return first, second, ratio


def _alternating(fns: tuple, calls: int, rounds: int) -> tuple[list[float], list[float]]:
    """Rounds of ``fns`` in turn, each round in the other order than the last (a drift of the host falls on all):
    each one's median us per call, and the median of the rounds' ratios of each later one over the first."""
    samples: dict = {fn: [] for fn in fns}
    for r in range(rounds):
        for fn in fns if r % 2 == 0 else fns[::-1]:
            samples[fn].append(_timed(fn, calls, 1))
    ratios = [statistics.median(a / b for a, b in zip(samples[fn], samples[fns[0]])) for fn in fns[1:]]
    return [statistics.median(samples[fn]) for fn in fns], ratios


def measure_training(calls: int, rounds: int) -> dict:
    """The training call's row (module doc): host us per forward and backward of each implementation."""
    import torch

    import cudnn_attn.torch as ct
    from cudnn_attn.torch import ops

    generator = torch.Generator(device="cuda").manual_seed(1)

    def normal(*shape):
        return torch.randn(shape, generator=generator, device="cuda", dtype=torch.bfloat16)

    q = normal(TRAIN_B, TRAIN_T, N, H).transpose(1, 2).requires_grad_()
    k, v = (normal(TRAIN_B, K, TRAIN_T, H).requires_grad_() for _ in range(2))
    grad = normal(TRAIN_B, TRAIN_T, N, H).transpose(1, 2)         # o_proj's gradient, through the transpose
    scale = H ** -0.5

    def theirs_forward(i):    # the forward alone, recorded by autograd (its graph is freed with the output)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def ours_forward(i):
        return ct.sdpa(q, k, v, causal=True, layout="BNTH")[0]

    def theirs(i):
        return torch.autograd.grad(theirs_forward(i), (q, k, v), grad)

    def ours(i):
        return torch.autograd.grad(ours_forward(i), (q, k, v), grad)

    def operator(i):          # what sdpa() ran before AttentionFunction: its running layout, BTNH, by the operator
        out, _ = ops.attention_op(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, None, scale,
                                  True, False, 0, 0.0, 0, "BTNH", True)
        return torch.autograd.grad(out.transpose(1, 2), (q, k, v), grad)

    before = {key for key, _ in ops.calls.items()}
    for i in range(3):
        theirs(i), ours(i), operator(i)
    paths = sorted(f"{key[0]} {type(known).__name__}" for key, known in ops.calls.items() if key not in before)
    (sdpa_us, ours_us, operator_us), (ratio, operator_ratio) = _alternating((theirs, ours, operator), calls, rounds)
    (sdpa_forward_us, ours_forward_us), (forward_ratio,) = _alternating((theirs_forward, ours_forward), calls, rounds)
    with _stage_timers() as spent:
        whole = _timed(ours, calls, 1)
    forward_us, backward_us = (spent[part] / calls / 1e3 for part in ("forward", "backward"))
    return {"torch sdpa": sdpa_us, "ours": ours_us, "ours: operator": operator_us, "ours / torch sdpa": ratio,
            "operator / torch sdpa": operator_ratio,
            "torch sdpa: forward call": sdpa_forward_us, "ours: forward call": ours_forward_us,
            "forward / torch sdpa": forward_ratio,
            "ours: forward": forward_us, "ours: backward": backward_us,
            "ours: autograd": whole - forward_us - backward_us,
            "paths": paths,
            "kernels": {"torch sdpa": _kernels(theirs), "ours": _kernels(ours)},
            "profile": _profile(ours, calls)}


def measure(calls: int, rounds: int) -> list[dict]:
    import torch

    import cudnn_attn.torch as ct
    from cudnn_attn.torch import api, ops

    generator = torch.Generator(device="cuda").manual_seed(0)

    def normal(*shape):
        return torch.randn(shape, generator=generator, device="cuda", dtype=torch.bfloat16)

    rows = []
    for cache in ("fixed", "growing"):
        lengths = [FIXED] if cache == "fixed" else list(GROWING)
        caches = {S: (normal(B, K, S, H), normal(B, K, S, H)) for S in lengths}
        keeps = {S: (torch.arange(S, device="cuda")[None, :] >= torch.tensor([0, 3, 7, 11], device="cuda")[:, None])
                 .view(B, 1, 1, S) for S in lengths}
        q = normal(B, N, 1, H)
        for masked in (False, True):
            def keep_of(S):
                return keeps[S] if masked else None

            def length(i):
                return lengths[i % len(lengths)]

            def theirs(i):
                S = length(i)
                return torch.nn.functional.scaled_dot_product_attention(q, *caches[S], attn_mask=keep_of(S),
                                                                        enable_gqa=True)

            def ours(i):
                S = length(i)
                return ct.sdpa(q, *caches[S], keep=keep_of(S), layout="BNTH")

            with torch.no_grad():
                for i in range(2 * len(lengths)):                     # graphs built, signatures known
                    theirs(i), ours(i)
                row = {"cache": cache, "mask": "keep" if masked else "none"}
                row["torch sdpa"], row["ours"], row["ours / torch sdpa"] = _paired(theirs, ours, calls, rounds)
                scalars = (None, False, False, 0, 0.0, "BNTH", None)   # sdpa()'s defaults, as ours() passes them
                known = {S: api._decided(api._signature((q, *caches[S], None, None, keep_of(S)), *scalars))
                         for S in lengths}
                # Whether ours() ran every length's fast entry (the stages below time its parts).
                row["fast entries"] = all(d is not None and d.fast is not None
                                          and any(f is d.fast for f in api._fast.values()) for d in known.values())
                if all(d is not None and d.fast is not None for d in known.values()):
                    direct = known[lengths[0]].direct
                    tensors_of = ((lambda S: (q, *caches[S], keep_of(S))) if masked else (lambda S: (q, *caches[S])))
                    row["ours: guard"] = _timed(lambda i: known[length(i)].fast.matches(*tensors_of(length(i))),
                                                calls, rounds)
                    shape, dtype = direct.results[0]
                    allocate = ops._allocation(q, tuple(shape), torch.empty(shape, device="meta").stride(), dtype,
                                               direct.device)
                    row["ours: empty"] = _timed(lambda i: allocate(q), calls, rounds)
                    if masked:
                        row["ours: fold"] = _timed(lambda i: ops._folded(keep_of(length(i)),
                                                                         known[length(i)].direct.prepared.config),
                                                   calls, rounds)

                    def launch(i):
                        S = length(i)
                        return known[S].fast.launch(q, *caches[S], keep_of(S))

                    row["ours: launch"] = _timed(launch, calls, rounds)
                    # Each length's launch on fixed addresses (its cache, one result buffer), cycling as the calls do.
                    stream = torch.cuda.current_stream().cuda_stream
                    fixed = {}
                    for S in lengths:
                        tensors = (q, *caches[S])
                        if masked:
                            tensors = (*tensors, ops._folded(keep_of(S), known[S].direct.prepared.config))
                        results = [torch.empty(*shape, dtype=dtype, device="cuda")
                                   for shape, dtype in known[S].direct.results]
                        workspace = torch.empty(max(known[S].direct.workspace, 1), dtype=torch.uint8, device="cuda")
                        fixed[S] = (known[S].direct.prepared, [x.data_ptr() for x in known[S].direct.order(tensors)]
                                    + [r.data_ptr() for r in results], workspace.data_ptr(),
                                    (tensors, results, workspace))
                    row["ours: launch_into"] = _timed(
                        lambda i: fixed[length(i)][0].launch_into(list(fixed[length(i)][1]), stream, 42, replay=False,
                                                                  workspace=fixed[length(i)][2]),
                        calls, rounds)
                    row["ours: execute"] = _execute_alone([fixed[S][:3] for S in lengths], stream, calls, rounds)
                row["kernels"] = {"torch sdpa": _kernels(theirs), "ours": _kernels(ours)}
                row["torch sdpa: cuDNN"] = _on_cudnn(theirs, calls, rounds)
                row["profile"] = _profile(ours, calls)
            rows.append(row)
            print("  " + json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()
                                     if k != "profile"}), flush=True)
    return rows


def _execute_alone(launches: list, stream: int, calls: int, rounds: int) -> float | None:
    """Host us of cuDNN's execute alone: call ``i`` runs ``launches[i % len(launches)]``, a ``(prepared call,
    addresses, workspace address)`` triple, through its launcher's raw launch (``Launcher.bound``) under the device
    lock with the handle on ``stream``: the floor under ``launch_into``.  ``None`` where a launcher has no raw launch
    (the frontend's public execute, ``Launcher.path == "frontend"``)."""
    from cudnn_attn.engine import runtime

    context = runtime.device_context(launches[0][0].device)
    runs = [(prepared.plan().launcher.bound(context), pointers, workspace)
            for prepared, pointers, workspace in launches]
    if any(run is None for run, _, _ in runs):
        return None
    with context.lock:
        context.bind_stream(stream)
    lock, count = context.lock, len(runs)

    def execute(i):
        run, pointers, workspace = runs[i % count]
        with lock:
            run(pointers, workspace)

    return _timed(execute, calls, rounds)


def _on_cudnn(fn, calls: int, rounds: int) -> float | None:
    """Host us per call of torch SDPA's call ``fn`` with its cuDNN backend alone (``sdpa_kernel``); ``None`` where
    torch's cuDNN backend refuses the call."""
    import warnings

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            fn(0)
            torch.cuda.synchronize()
        except RuntimeError:
            return None
        return _timed(fn, calls, rounds)


def _kernels(fn) -> list[str]:
    """The CUDA kernels one call of ``fn`` runs, each with its device us (``torch.profiler``): which backend torch
    SDPA chose, and whether a call's kernels take longer than its host time (then the host waits for the GPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiled:
        fn(0)
        torch.cuda.synchronize()
    return [f"{event.name[:80]} {event.time_range.elapsed_us():.1f} us" for event in profiled.events()
            if event.device_type.name == "CUDA"]


@contextlib.contextmanager
def _stage_timers():
    """Timers around :class:`~cudnn_attn.torch.eager.AttentionFunction`'s forward (the caller's thread) and its
    backward (autograd's device thread): yields ``{"forward": ns, "backward": ns}`` accumulated over the calls inside
    the block; the library's functions are restored on leaving."""
    from cudnn_attn.torch import eager

    spent = {"forward": 0, "backward": 0}
    forward, backward = eager.AttentionFunction.forward, eager._backward
    clock = time.perf_counter_ns

    def timed_forward(ctx, *arguments):
        start = clock()
        result = forward(ctx, *arguments)
        spent["forward"] += clock() - start
        return result

    def timed_backward(ctx, *arguments):
        start = clock()
        result = backward(ctx, *arguments)
        spent["backward"] += clock() - start
        return result

    eager.AttentionFunction.forward, eager._backward = staticmethod(timed_forward), timed_backward
    try:
        yield spent
    finally:
        eager.AttentionFunction.forward, eager._backward = staticmethod(forward), backward


def _profile(fn, calls: int) -> list[str]:
    """cProfile of ``calls`` calls: the 12 functions of most own time, in us per call (cProfile's overhead
    included: read the shares, not the sums)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(calls):
        fn(i)
    profiler.disable()
    stats = sorted(pstats.Stats(profiler).stats.items(), key=lambda item: -item[1][2])[:12]
    return [f"{os.path.basename(where[0])}:{where[1]}:{where[2]} {own * 1e6 / calls:.1f}"
            for where, (_, _, own, _, _) in stats]


COLUMNS = ("torch sdpa", "torch sdpa: cuDNN", "ours", "ours / torch sdpa", "ours: guard", "ours: launch",
           "ours: fold", "ours: empty", "ours: launch_into", "ours: execute")


def table(rows: list[dict], calls: int, rounds: int) -> str:
    lines = [f"== host us per eager decode call: B{B} {N}/{K} heads d{H} bf16 BNTH, one query; median of {rounds} "
             f"rounds of {calls} calls",
             f"{'cache':8s} {'mask':5s} " + " ".join(f"{c:>18s}" for c in COLUMNS)]
    for r in rows:
        lines.append(f"{r['cache']:8s} {r['mask']:5s} " + " ".join(
            f"{'-' if r.get(c) is None else format(r[c], '.2f'):>18s}" for c in COLUMNS))
    for r in rows:
        lines.append(f"profile {r['cache']} {r['mask']} (us per call): " + "; ".join(r.get("profile", [])))
    for r in rows:
        for who, names in r.get("kernels", {}).items():
            lines.append(f"kernels {r['cache']} {r['mask']} {who}: " + ", ".join(names))
    lines.append("ours / torch sdpa: the whole call's host time over torch SDPA's (target <= 1.00); the 'ours:' "
                 "columns are parts of ours' call timed alone")
    return "\n".join(lines)


TRAINING_COLUMNS = ("torch sdpa", "ours", "ours: operator", "ours / torch sdpa", "operator / torch sdpa",
                    "ours: forward", "ours: backward", "ours: autograd", "torch sdpa: forward call",
                    "ours: forward call", "forward / torch sdpa")


def training_table(row: dict, calls: int, rounds: int) -> str:
    lines = [f"== host us per eager training call (forward + autograd.grad of q, k, v): B{TRAIN_B} T=S={TRAIN_T} "
             f"{N}/{K} heads d{H} bf16 causal; median of {rounds} rounds of {calls} calls",
             " ".join(f"{c:>22s}" for c in TRAINING_COLUMNS),
             " ".join(f"{row[c]:22.2f}" for c in TRAINING_COLUMNS),
             f"paths (kind, how it runs): {', '.join(row['paths']) or '-'}",
             "profile ours (us per call): " + "; ".join(row["profile"]),
             *(f"kernels {who}: " + ", ".join(names) for who, names in row.get("kernels", {}).items()),
             "ours: AttentionFunction, no dispatcher; ours: operator: the same call through the custom operators; "
             "ours: forward / backward: AttentionFunction's forward (the caller's thread) and backward (autograd's "
             "device thread) timed in place; ours: autograd: the rest of ours' call (torch.autograd.grad, the "
             "node, the threads' handoff); forward call: the forward alone, recorded by autograd"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="500 calls per round, 3 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.rounds = 500, 3
    os.makedirs(args.out, exist_ok=True)
    rows = measure(args.calls, args.rounds)
    training = measure_training(args.calls, args.rounds)
    print("  " + json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in training.items()
                             if k != "profile"}), flush=True)
    with open(os.path.join(args.out, "bench_torch_host.json"), "w") as f:
        json.dump({"calls": args.calls, "rounds": args.rounds, "rows": rows, "training": training}, f, indent=1)
    plot(os.path.join(args.out, "bench_torch_host.json"), os.path.join(args.out, "bench_torch_host.png"))
    print()
    print(table(rows, args.calls, args.rounds))
    print(training_table(training, args.calls, args.rounds))
    return 0


def plot(report: str, path: str) -> None:
    """Host us per call of torch SDPA and ours for each row, ours' stages beside them (bars), from a
    ``bench_torch_host.json``; nothing without matplotlib.  ``python benchmarks/bench_torch_host.py --plot
    REPORT.json OUT.png`` draws it again from a saved report."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    report = json.load(open(report))
    rows, training = report["rows"], report.get("training")
    bars = [c for c in COLUMNS if c != "ours / torch sdpa"]
    fig, (ax, right) = plt.subplots(1, 2, figsize=(14, 4.5), gridspec_kw={"width_ratios": [4, 1]})
    width = 0.8 / len(bars)
    for i, column in enumerate(bars):
        labelled = False
        for g, row in enumerate(rows):
            if row.get(column) is None:
                continue
            ax.bar(g + i * width, row[column], width, color=f"C{i}", label=None if labelled else column)
            labelled = True
            if column == "ours":
                ax.text(g + i * width, row[column], f"{row['ours / torch sdpa']:.2f}x", ha="center", va="bottom",
                        fontsize=7)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(rows))], [f"{r['cache']}, {r['mask']}" for r in rows])
    ax.set_ylabel("host us per call (median)")
    ax.set_title("eager torch decode call: torch SDPA against cudnn_attn.torch.sdpa and its stages "
                 "(label: ours / torch sdpa)")
    ax.legend(fontsize=7, ncol=4)
    if training:
        names = ("torch sdpa", "ours", "ours: operator")
        right.bar(range(3), [training[c] for c in names], color=["C0", "C1", "C7"])
        right.set_xticks(range(3), ["torch sdpa", "ours", "operator"], fontsize=8)
        right.set_title(f"training call (fwd + bwd), ours {training['ours / torch sdpa']:.2f}x", fontsize=9)
        right.set_ylabel("host us per call (median)")
    else:
        right.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plot"] and len(sys.argv) == 4:
        plot(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
