"""Decode in transformers' ``generate()``: torch SDPA against this library through ``AttentionInterface`` (not a test).

    python benchmarks/bench_generate.py [--out OUT_DIR] [--quick] [--dry-run] [--tokens 64]

A randomly initialised Llama (4 layers, 16 query / 4 K/V heads, head dim 64, hidden 1024, bf16, seed 0), batch 4,
a 128-token random prompt, greedy decoding of ``--tokens`` tokens (``min_new_tokens`` = ``max_new_tokens``, so
every run makes the same number).  With the dynamic cache every decode step is one query against one more key
than the last (a new signature per step); with the static cache the keys are the cache's full length under a
mask (one signature).  Prompts unpadded, and left-padded by 0, 3, 7, 11 tokens.

Implementations, on the same model (its weights shared; ``set_attn_implementation`` between runs):

* ``sdpa``            - transformers' ``sdpa_attention_forward`` (torch SDPA), wrapped to count and time calls;
* ``ours keep-mask``  - ``cudnn_attn.torch.register_transformers`` when that module exists, else the minimal
                        function here: no mask -> causal over the first T keys (sdpa's rule; one query: every key);
                        a boolean mask -> ``attention(mask=keep(m))``;
                        a float mask -> ``bias``; BNTH layout, torch tensors in and out through DLPack;
* ``ours segments``   - the minimal function, with a one-query step's boolean mask turned into one segment per
                        row (its first kept key and the number kept; the mask's kept keys must be one run).

Every name gets transformers' ``sdpa_mask``.  Caches: ``dynamic``; ``static+compile``, the static cache as
``generate(cache_implementation="static")`` runs it by default (transformers compiles the decoding forward with
``torch.compile``, CUDA graphs included); ``static``, the same with ``generation_config.disable_compile`` (eager).
Under compile each implementation runs unwrapped (a timing wrapper would break the graph: no ``attn us`` there),
and ``ours segments`` does not run (the CuPy front is not traceable).  Per cache and prompt: a cold ``generate()``
of each implementation (graphs built), then ``--rounds`` warm ones of each (``--compiled-rounds`` for the compiled
cache, whose token is mostly ``generate()``'s own loop: 2.49-2.92 ms from one run to the next for torch SDPA on the
H200's host) in a rotating order (``run_group``): ms per generated token (the median of wall / tokens, prefill
included), attention calls and the host time inside the attention function per call, graph-cache hits
and misses of the warm run, and the share of generated tokens equal to sdpa's (random weights: near-ties may
flip a greedy choice).  Each ``static+compile`` row also profiles one more warm run (``kernel_profile``): GPU
time per token of attention kernels and of the rest, kernels and CUDA graph launches per token, and inductor's
CUDA graph skips; and one more times the compiled decode step apart from ``generate()``'s loop (``step_profile``:
its host time and GPU time per step).  Target: ours' ms per token <= sdpa's.

Writes ``bench_generate.json`` into OUT_DIR and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BATCH, PROMPT = 4, 16, 4, 64, 4, 128
PADS = (0, 3, 7, 11)
IMPLS = ("sdpa", "ours keep-mask", "ours segments")
CACHES = ("dynamic", "static+compile", "static")
COMPILED = "static+compile"


@dataclass
class Row:
    cache: str
    padded: bool
    impl: str
    ms_per_token: float | None = None
    attention_calls: int | None = None
    attention_host_us: float | None = None     # inside the attention function, per call, warm run
    cache_hits: int | None = None
    cache_misses: int | None = None
    same_tokens: float | None = None           # share of generated tokens equal to sdpa's
    cold_s: float | None = None
    error: str | None = None
    notes: dict = field(default_factory=dict)


class Timed:
    """An attention function that counts its calls and their host time, also by kind of call: prefill or decode
    step (one query), with a mask or without."""

    def __init__(self, fn):
        self.fn, self.calls, self.ns = fn, 0, 0
        self.kinds: dict = {}

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return self.fn(module, query, key, value, attention_mask, *args, **kwargs)
        finally:
            ns = time.perf_counter_ns() - start
            self.ns += ns
            self.calls += 1
            kind = ("decode" if query.shape[2] == 1 else "prefill") + (" masked" if attention_mask is not None else "")
            calls, total = self.kinds.get(kind, (0, 0))
            self.kinds[kind] = (calls + 1, total + ns)

    def reset(self) -> None:
        self.calls = self.ns = 0
        self.kinds = {}

    def by_kind(self) -> dict:
        """Calls and host us per call of each kind."""
        return {kind: {"calls": n, "host_us": round(ns / 1e3 / n, 1)} for kind, (n, ns) in sorted(self.kinds.items())}


def ours(segmented: bool):
    """The minimal transformers attention function over cudnn_attn (query ``(B, N, T, D)``, key/value
    ``(B, K, S, D)``; returns ``(B, T, N, D)`` and no weights)."""
    import torch

    import cudnn_attn
    from cudnn_attn import MaskType, keep, segments

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        T = query.shape[2]
        if attention_mask is None:
            if T > 1:       # sdpa's rule: causal over the first T keys (a static cache's prefill: the rest are empty)
                key, value = key[:, :, :T], value[:, :, :T]
            out = cudnn_attn.dot_product_attention(query, key, value, scale=scaling, mask_type=MaskType.CAUSAL,
                                                   diagonal_alignment="bottom_right", qkv_layout="BNTH")
        elif attention_mask.dtype != torch.bool:
            out = cudnn_attn.dot_product_attention(query, key, value, bias=attention_mask, scale=scaling,
                                                   qkv_layout="BNTH")
        elif segmented and T == 1:
            kept = attention_mask[:, 0, 0, :]
            B = kept.shape[0]
            start = kept.int().argmax(-1).to(torch.int32)
            minus = torch.full((B, 1), -1, dtype=torch.int32, device=kept.device)
            lengths = kept.sum(-1, dtype=torch.int32).reshape(B, 1)
            mask = segments(torch.ones((B, 1), dtype=torch.int32, device=kept.device), lengths,
                            torch.cat([torch.zeros_like(minus), minus], 1), torch.cat([start[:, None], minus], 1))
            out = cudnn_attn.attention(query, key, value, mask=mask, scale=scaling, layout="BNTH").output
        else:
            out = cudnn_attn.attention(query, key, value, mask=keep(attention_mask), scale=scaling,
                                       layout="BNTH").output
        return out.transpose(1, 2).contiguous(), None
    return attend


def register() -> dict:
    """Register the implementations with transformers; name -> Timed."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    fns = {"sdpa": sdpa_attention_forward, "ours keep-mask": ours(False), "ours segments": ours(True)}
    source = "benchmark"
    try:
        from cudnn_attn import torch as cudnn_torch          # the library's own integration, when present

        cudnn_torch.register_transformers()
        fns["ours keep-mask"] = AttentionInterface._global_mapping["cudnn_attn"]
        source = "cudnn_attn.torch.register_transformers"
    except (ImportError, AttributeError, KeyError):
        pass
    timed = {}
    for impl, fn in fns.items():
        name = "bench_" + impl.replace(" ", "_").replace("-", "_")
        timed[impl] = Timed(fn)
        AttentionInterface.register(name, timed[impl])
        AttentionInterface.register(name + "_raw", fn)
        for registered in (name, name + "_raw"):
            ALL_MASK_ATTENTION_FUNCTIONS.register(registered, sdpa_mask)
        timed[impl].name, timed[impl].raw_name = name, name + "_raw"
    timed["source"] = source
    return timed


def build_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=HEADS * HEAD_DIM, intermediate_size=2816,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=HEAD_DIM, max_position_embeddings=4096)
    return LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()


def prompts(padded: bool):
    import torch

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 4096, (BATCH, PROMPT), generator=generator)
    mask = torch.ones((BATCH, PROMPT), dtype=torch.long)
    if padded:
        for b, pad in enumerate(PADS):
            ids[b, :pad], mask[b, :pad] = 0, 0
    return ids.cuda(), mask.cuda()


def set_implementation(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def generate(model, ids, mask, tokens: int, cache: str):
    import torch

    kwargs = dict(attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                  pad_token_id=0)
    model.generation_config.disable_compile = cache != COMPILED     # only the dynamic cache never compiles
    if cache != "dynamic":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        out = model.generate(ids, **kwargs)
    torch.cuda.synchronize()
    return out[:, ids.shape[1]:]


def run_group(rows: list[Row], model, timed: dict, tokens: int, rounds: int) -> None:
    """The rows of one cache and prompt: a cold ``generate()`` per implementation (its graphs built), then
    ``rounds`` rounds of one warm ``generate()`` each, the implementations in a rotating order, so that a slow
    spell of the host falls on all of them; ``ms_per_token`` is the median, ``notes["vs_sdpa_paired"]`` the median
    of each round's ratio to sdpa's run of the same round.  Then a cProfile of one more run of each of ours."""
    import cudnn_attn

    ids, mask = prompts(rows[0].padded)
    cache = rows[0].cache
    live = []
    def name(row: Row) -> str:
        return timed[row.impl].raw_name if cache == COMPILED else timed[row.impl].name

    for row in rows:
        try:
            set_implementation(model, name(row))
            start = time.perf_counter()
            generate(model, ids, mask, tokens, cache)
            row.cold_s = time.perf_counter() - start
            timed[row.impl].reset()
            row.notes["ms_per_token_rounds"] = []
            live.append(row)
        except Exception as exc:              # one implementation failing must not hide the others
            fail(row, exc)
    outputs: dict = {}
    for r in range(rounds):
        for row in live[r % len(live):] + live[:r % len(live)] if live else ():
            if row.error:
                continue
            try:
                set_implementation(model, name(row))
                before = cudnn_attn.graph_cache.stats()
                start = time.perf_counter()
                outputs[row.impl] = generate(model, ids, mask, tokens, cache)
                row.notes["ms_per_token_rounds"].append((time.perf_counter() - start) * 1e3 / tokens)
                after = cudnn_attn.graph_cache.stats()
                row.cache_hits = (row.cache_hits or 0) + after.hits - before.hits
                row.cache_misses = (row.cache_misses or 0) + after.misses - before.misses
            except Exception as exc:
                fail(row, exc)
    sdpa = next((row for row in live if row.impl == "sdpa" and not row.error), None)
    for row in live:
        times = row.notes["ms_per_token_rounds"]
        if row.error or not times:
            continue
        fn = timed[row.impl]
        row.ms_per_token = statistics.median(times)
        if cache != COMPILED:
            row.attention_calls = fn.calls // len(times)
            row.attention_host_us = fn.ns / 1e3 / max(fn.calls, 1)
            row.notes["by_kind"] = fn.by_kind()
        if sdpa is not None and row is not sdpa and len(sdpa.notes["ms_per_token_rounds"]) == len(times):
            row.notes["vs_sdpa_paired"] = statistics.median(
                t / base for t, base in zip(times, sdpa.notes["ms_per_token_rounds"]))
            row.same_tokens = float((outputs[row.impl] == outputs["sdpa"]).float().mean())
        if row.impl != "sdpa" and cache != COMPILED:
            profile(row, model, timed, ids, mask, tokens)
        if cache == COMPILED:
            set_implementation(model, name(row))
            row.notes["kernels"] = kernel_profile(lambda: generate(model, ids, mask, tokens, cache), tokens)
            print(f"  kernels {cache} {'padded' if row.padded else 'plain'} {row.impl}: {row.notes['kernels']}",
                  flush=True)
            row.notes["steps"] = step_profile(model, lambda: generate(model, ids, mask, tokens, cache), tokens)
            print(f"  steps {cache} {'padded' if row.padded else 'plain'} {row.impl}: {row.notes['steps']}",
                  flush=True)


def fail(row: Row, exc: Exception) -> None:
    row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    row.notes["traceback"] = traceback.format_exc()[-2500:]


def profile(row: Row, model, timed: dict, ids, mask, tokens: int) -> None:
    """Where the host time goes: cProfile of one more warm run, the library's functions and what they call."""
    import cProfile
    import pstats

    fn = timed[row.impl]
    set_implementation(model, fn.name)
    profiler, calls_before = cProfile.Profile(), fn.calls
    profiler.enable()
    generate(model, ids, mask, tokens, row.cache)
    profiler.disable()
    profiled = max(fn.calls - calls_before, 1)
    stats = pstats.Stats(profiler).stats
    ours = {where: timing for where, timing in stats.items()
            if "cudnn_attn" in where[0] or "cupy" in where[0] or "cupy" in where[2] or "cuda" in where[2]}
    top = sorted(ours.items(), key=lambda item: -item[1][2])[:16]
    row.notes["profile_library_own_us_per_call"] = [
        f"{os.path.basename(where[0])}:{where[1]}:{where[2]} {own * 1e6 / profiled:.1f} "
        f"({calls / profiled:.2f} per call)" for where, (_, calls, own, _, _) in top]
    print(f"  profile {row.cache} {'padded' if row.padded else 'plain'} {row.impl} (us per attention call): "
          + "; ".join(row.notes["profile_library_own_us_per_call"][:10]), flush=True)


_ATTENTION = re.compile(r"(?i)sdpa|fmha|flash|attn|attention|cudnn")


def kernel_profile(run, tokens: int) -> dict:
    """One more warm ``run()`` under ``torch.profiler``, per generated token: the GPU us of attention kernels
    (names matching :data:`_ATTENTION`) and of the rest, kernels and CUDA graph launches, the five longest kernels
    of each kind, and inductor's count of CUDA graph skips (a step torch could not hold in one graph)."""
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    skips_before = _cudagraph_skips()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    found = {"attention_us": 0.0, "other_us": 0.0, "kernels": 0.0, "graph_launches": 0.0,
             "attention_top": [], "other_top": []}
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total):
        if e.key == "cudaGraphLaunch":
            found["graph_launches"] += e.count / tokens
        if e.self_device_time_total <= 0 or e.key.startswith("cuda"):
            continue
        kind = "attention" if _ATTENTION.search(e.key) else "other"
        us = e.self_device_time_total / tokens
        found[f"{kind}_us"] += us
        found["kernels"] += e.count / tokens
        if len(found[f"{kind}_top"]) < 5:
            found[f"{kind}_top"].append(f"{e.key[:80]} x{e.count / tokens:.1f}: {us:.1f} us")
    found["cudagraph_skips"] = _cudagraph_skips() - skips_before
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in found.items()}


def step_profile(model, run, tokens: int) -> dict:
    """One more warm ``run()`` with ``generate()``'s compiled decode step timed apart from its loop: ``generate()``
    calls what ``model.get_compiled_call`` returns once per decode step, and a wrapper around that call reads, per
    step, the host clock around it (the compiled call: guards, the CUDA graph tree's input copies, the replay's
    launch) and CUDA events around it (the GPU time from the step's first enqueued work to its last).  Medians over
    the steps; ``loop_us`` is the rest of a token's wall time (``generate()``'s own host work around the step)."""
    import torch

    compiled_call = model.get_compiled_call
    host_ns, events = [], []

    def timed(compile_config):
        compiled = compiled_call(compile_config)

        def step(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            began = time.perf_counter_ns()
            out = compiled(*args, **kwargs)
            host_ns.append(time.perf_counter_ns() - began)
            end.record()
            events.append((start, end))
            return out
        return step

    model.get_compiled_call = timed
    try:
        began = time.perf_counter()
        run()
        wall_us = (time.perf_counter() - began) * 1e6 / tokens
    finally:
        del model.get_compiled_call                      # the class's method again
    torch.cuda.synchronize()
    if not host_ns:
        return {"steps": 0}
    host_us = statistics.median(host_ns) / 1e3
    return {"steps": len(host_ns), "step_host_us": round(host_us, 1),
            "step_gpu_us": round(statistics.median(s.elapsed_time(e) * 1e3 for s, e in events), 1),
            "wall_us_per_token": round(wall_us, 1), "loop_us": round(wall_us - host_us, 1)}


def _cudagraph_skips() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["inductor"]["cudagraph_skips"])


def _f(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(rows: list[Row], tokens: int, rounds: int, source: str, compiled_rounds: int | None = None) -> str:
    runs = f"{rounds}" if compiled_rounds in (None, rounds) else f"{rounds} ({compiled_rounds} compiled)"
    lines = [f"== generate(): random Llama {LAYERS} layers, {HEADS}/{KV_HEADS} heads, d={HEAD_DIM}, batch {BATCH}, "
             f"{PROMPT}-token prompt, {tokens} tokens, median of {runs} warm runs in rotating order (ours' "
             f"keep-mask function: {source})",
             f"{'cache':14s} {'prompt':7s} {'impl':15s} {'ms/token':>8s} {'x sdpa':>6s} {'attn us':>8s} {'calls':>6s} "
             f"{'hits':>5s} {'miss':>5s} {'same':>5s} {'cold s':>6s}"]
    for r in rows:
        ratio = r.notes.get("vs_sdpa_paired")
        verdict = "" if r.impl == "sdpa" or ratio is None else ("  OK" if ratio <= 1.0 else "  MISS")
        lines.append(f"{r.cache:14s} {'padded' if r.padded else 'plain':7s} {r.impl:15s} {_f(r.ms_per_token):>8s} "
                     f"{_f(ratio):>6s} {_f(r.attention_host_us, 1):>8s} {r.attention_calls or '-':>6} "
                     f"{'-' if r.cache_hits is None else r.cache_hits:>5} "
                     f"{'-' if r.cache_misses is None else r.cache_misses:>5} {_f(r.same_tokens):>5s} "
                     f"{_f(r.cold_s, 1):>6s}{verdict}" + (f"  FAILED {r.error}" if r.error else ""))
    kinds = [r for r in rows if r.notes.get("by_kind")]
    if kinds:
        lines.append("attention host us per call by kind: " + "; ".join(
            f"{r.cache} {'padded' if r.padded else 'plain'} {r.impl}: " + ", ".join(
                f"{kind} {v['calls']} x {v['host_us']}" for kind, v in r.notes["by_kind"].items()) for r in kinds))
    for r in rows:
        k = r.notes.get("kernels")
        if k:
            lines.append(f"{r.cache} {'padded' if r.padded else 'plain'} {r.impl}, per token: attention "
                         f"{k['attention_us']} us, other {k['other_us']} us GPU; {k['kernels']} kernels, "
                         f"{k['graph_launches']} graph launches, {k['cudagraph_skips']} cudagraph skips; "
                         f"attention: {'; '.join(k['attention_top'][:3])}")
    for r in rows:
        k = r.notes.get("steps")
        if k and k.get("steps"):
            lines.append(f"{r.cache} {'padded' if r.padded else 'plain'} {r.impl}, the compiled decode step apart from "
                         f"generate()'s loop ({k['steps']} steps, medians): host {k['step_host_us']} us, GPU "
                         f"{k['step_gpu_us']} us; wall {k['wall_us_per_token']} us per token, of which the loop "
                         f"{k['loop_us']} us")
    lines.append("x sdpa: the median of each round's ratio to sdpa's run in the same round; attn us: host time inside "
                 "the attention function per call; target: x sdpa <= 1.00 (OK/MISS)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--quick", action="store_true", help="16 tokens")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: the table's rows, not run")
    parser.add_argument("--tokens", type=int, default=None, help="generated tokens (default 64, quick 16)")
    parser.add_argument("--rounds", type=int, default=15, help="timed generate() runs per implementation (median)")
    parser.add_argument("--compiled-rounds", type=int, default=None,
                        help="the same for the compiled static cache (default 45, quick --rounds)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    tokens = args.tokens or (16 if args.quick else 64)
    compiled_rounds = args.compiled_rounds or (args.rounds if args.quick else 45)
    rows = [Row(cache, padded, impl) for cache in CACHES for padded in (False, True) for impl in IMPLS
            if not (cache == COMPILED and impl == "ours segments")]
    source = "-"
    if args.dry_run:
        for r in rows:
            r.error = "not run (--dry-run)"
    else:
        try:
            timed = register()
            source = timed["source"]
            model = build_model()
        except Exception as exc:             # no torch / transformers: every row says so
            for r in rows:
                r.error = f"{type(exc).__name__}: {exc}"[:200]
            model = None
        groups = {}
        for r in rows:
            groups.setdefault((r.cache, r.padded), []).append(r)
        for group in groups.values() if model is not None else ():
            compiled = group[0].cache == COMPILED
            run_group(group, model, timed, tokens, compiled_rounds if compiled else args.rounds)
            for r in group:
                print(f"  {r.cache:14s} {'padded' if r.padded else 'plain':7s} {r.impl:15s} {_f(r.ms_per_token)} "
                      f"ms/token (rounds {[round(t, 2) for t in r.notes.get('ms_per_token_rounds', [])]})"
                      + (f"  ERROR {r.error}" if r.error else ""), flush=True)
    with open(os.path.join(args.out, "bench_generate.json"), "w") as f:
        json.dump({"dry_run": args.dry_run, "tokens": tokens, "rounds": args.rounds,
                   "compiled_rounds": compiled_rounds, "source": source,
                   "rows": [asdict(r) for r in rows]},
                  f, indent=1)
    if not args.dry_run:
        plot(os.path.join(args.out, "bench_generate.json"), os.path.join(args.out, "bench_generate.png"))
    print()
    print(table(rows, tokens, args.rounds, source, compiled_rounds))
    return 0


def plot(report: str, path: str) -> None:
    """ms per token of each implementation by cache and prompt (bars, the paired ratio to sdpa on each), from a
    ``bench_generate.json``; nothing without matplotlib.  ``python benchmarks/bench_generate.py --plot REPORT.json
    OUT.png`` draws it again from a saved report."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = json.load(open(report))["rows"]
    groups = list(dict.fromkeys((r["cache"], r["padded"]) for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(IMPLS)
    for i, impl in enumerate(IMPLS):
        for g, group in enumerate(groups):
            row = next((r for r in rows if (r["cache"], r["padded"]) == group and r["impl"] == impl), None)
            if row is None or not row.get("ms_per_token"):
                continue
            x = g + i * width
            ax.bar(x, row["ms_per_token"], width, color=f"C{i}", label=impl if g == 0 else None)
            ratio = row["notes"].get("vs_sdpa_paired")
            if ratio:
                ax.text(x, row["ms_per_token"], f"{ratio:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))],
                  [f"{cache}, {'left-padded' if padded else 'unpadded'}" for cache, padded in groups])
    ax.set_ylabel("ms per generated token (median)")
    ax.set_title("transformers generate(): sdpa against cudnn_attn (labels: paired ratio to sdpa)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plot"] and len(sys.argv) == 4:
        plot(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
