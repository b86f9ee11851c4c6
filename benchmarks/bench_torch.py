"""A torch training step through transformers' Llama: ``cudnn_attn.torch`` against torch's default SDPA (not a test).

    python benchmarks/bench_torch.py [--out OUT_DIR] [--quick] [--steps 30] [--warmup 3]

Models: random-init ``LlamaForCausalLM`` (no download), bf16 parameters, AdamW, 16 query heads and 4 key/value heads
of dim 64 (GQA), hidden 1024, causal language-model loss.  Rows: (layers, batch, sequence) = (4, 8, 1024),
(4, 4, 4096) and (2, 1, 16384) (``--quick``: the first two).  Implementations: ``cudnn_attn``
(``register_transformers()``, the custom operators on cuDNN) and ``sdpa`` (transformers' ``sdpa``:
``torch.nn.functional.scaled_dot_product_attention`` with torch's own backend choice).

Method: each step is forward + backward + optimizer step + ``zero_grad``; *GPU ms* is the time between two CUDA
events recorded on torch's current stream around the step (host gaps between kernels included), the median of
``--steps`` steps after ``--warmup``; *wall ms* the host clock of the step with a synchronize at its end; *host ms*
the host clock until the step is issued (its last event recorded): where it is near the GPU ms, the GPU waited on
the host; *forward host ms* the host clock until the forward is issued (the loss returned), the part of the step in
which a small model's GPU waits on the host.  *ours:* the kinds of attention call the step made and how they ran
(``_Direct``: the direct launch; ``_General``: the CuPy front's path).  Both models live side by side and step
alternately (each step in the other order than the last), so that a drift of the GPU or the host falls on both; the
ratio is the median of each step's ours / sdpa GPU ms (below 1: ours faster), with a 95 % interval of that median
(a seeded bootstrap of the paired steps: an interval that excludes 1 is a difference, not noise).  The two
implementations start from the same parameters; the first step's losses are printed side by side (they differ only
by the two attention kernels' rounding).

*Back to back* (``chained``): after the paired steps, blocks of 10 steps issued without reading anything between
them (a training loop that does not read its loss every step), the blocks of the two alternating (6 blocks, each
pair in the other order than the last); GPU ms per step is the median of each implementation's blocks, the ratio
the median of the paired blocks' ours / sdpa.  Here the host runs ahead of the GPU, so a difference in host time
hides and the kernels decide; in the paired steps (each step synchronised, as a loop that reads its loss every step
is) a small model's GPU waits on the host in the forward.

After the timed steps one more step of each runs under ``torch.profiler``: the GPU time of its attention kernels
and of all the others (where a difference between the two implementations lies).

Writes ``bench_torch.json`` and ``bench_torch.png`` into OUT_DIR and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import time
import traceback

import torch

ROWS = ((4, 8, 1024), (4, 4, 4096), (2, 1, 16384))
CHAINED_BLOCKS, CHAINED_STEPS = 6, 10


def _model(layers: int, sequence: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                                      head_dim=64, max_position_embeddings=sequence)
    return transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).train()


class _Trainer:
    """One implementation's model (the shared initial parameters), its AdamW and its timed steps."""

    def __init__(self, implementation: str, layers: int, sequence: int):
        self.implementation = implementation
        self.model = _model(layers, sequence)
        self.model.set_attn_implementation(implementation)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.gpu, self.wall, self.host, self.forward, self.losses = [], [], [], [], []

    def _issue(self, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        """One training step issued (forward, backward, AdamW, ``zero_grad``): its loss and the host clock when
        the forward was issued."""
        loss = self.model(ids, labels=ids).loss
        forward = time.perf_counter()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, forward

    def step(self, ids: torch.Tensor, timed: bool) -> None:
        began = time.perf_counter()
        self.start.record()
        loss, forward = self._issue(ids)
        self.end.record()
        issued = time.perf_counter()
        self.end.synchronize()
        self.losses.append(float(loss))
        if timed:
            self.gpu.append(self.start.elapsed_time(self.end))
            self.wall.append((time.perf_counter() - began) * 1e3)
            self.host.append((issued - began) * 1e3)
            self.forward.append((forward - began) * 1e3)

    def chained(self, ids: torch.Tensor, steps: int) -> float:
        """GPU ms per step of ``steps`` steps issued back to back, nothing read between them (a training loop that
        does not read its loss every step): the host runs ahead, so its time hides behind the GPU's."""
        self.start.record()
        for _ in range(steps):
            self._issue(ids)
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / steps

    def result(self, ids: torch.Tensor) -> dict:
        result = {"gpu_ms": statistics.median(self.gpu), "wall_ms": statistics.median(self.wall),
                  "host_ms": statistics.median(self.host), "forward_host_ms": statistics.median(self.forward),
                  "first_loss": self.losses[0], "gpu_ms_steps": [round(x, 3) for x in self.gpu]}
        result["kernels"] = _kernel_split(lambda: self.step(ids, False))
        return result


_ATTENTION = re.compile(r"(?i)sdpa|fmha|flash|attn|attention|cudnn")


def _kernel_split(step) -> dict:
    """One more step under ``torch.profiler``: the GPU ms of its attention kernels (names matching
    :data:`_ATTENTION`) and of every other kernel, and the five longest of each."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [(e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()
               if e.self_device_time_total > 0]
    split = {"attention_ms": 0.0, "other_ms": 0.0, "attention_top": [], "other_top": []}
    for name, ms, count in sorted(kernels, key=lambda k: -k[1]):
        kind = "attention" if _ATTENTION.search(name) else "other"
        split[f"{kind}_ms"] += ms
        if len(split[f"{kind}_top"]) < 5:
            split[f"{kind}_top"].append(f"{name[:90]} x{count}: {ms:.3f} ms")
    return split


def measure(layers: int, batch: int, sequence: int, steps: int, warmup: int) -> dict:
    import cudnn_attn.torch as ct
    from cudnn_attn.torch import ops

    name = ct.register_transformers()
    before = {key for key, _ in ops.calls.items()}
    ids = torch.randint(0, 32000, (batch, sequence), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    row = {"layers": layers, "batch": batch, "sequence": sequence}
    try:
        trainers = [_Trainer(implementation, layers, sequence) for implementation in (name, "sdpa")]
        for step in range(warmup + steps):         # alternating, each step in the other order: a drift of the
            for trainer in trainers if step % 2 else trainers[::-1]:       # GPU or host falls on both alike
                trainer.step(ids, step >= warmup)
        chained = {trainer.implementation: [] for trainer in trainers}
        for block in range(CHAINED_BLOCKS):               # alternating blocks, each in the other order
            for trainer in trainers if block % 2 else trainers[::-1]:
                chained[trainer.implementation].append(trainer.chained(ids, CHAINED_STEPS))
        for trainer in trainers:
            row[trainer.implementation] = trainer.result(ids)
            row[trainer.implementation]["chained_ms"] = statistics.median(chained[trainer.implementation])
        ours, theirs = trainers
        ratios = [a / b for a, b in zip(ours.gpu, theirs.gpu)]
        row["ratio"], row["ratio_interval"] = statistics.median(ratios), median_interval(ratios)
        row["chained_ratio"] = statistics.median(a / b for a, b in zip(chained[name], chained["sdpa"]))
        row["paths"] = sorted({f"{key[0]} {type(known).__name__}" for key, known in ops.calls.items()
                               if key not in before})
    except Exception as error:                        # a row that fails is reported, the others still run
        traceback.print_exc()
        for implementation in (name, "sdpa"):
            row.setdefault(implementation, {"error": f"{type(error).__name__}: {error}"})
    finally:
        trainers = None
        torch.cuda.empty_cache()
    return row


def median_interval(values: list[float], resamples: int = 4000, level: float = 0.95) -> list[float]:
    """The percentile bootstrap interval of the median of ``values`` at ``level`` (seeded, so a report's interval
    is recomputed exactly from its ``gpu_ms_steps``)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = int(resamples * (1 - level) / 2)
    return [medians[tail], medians[resamples - 1 - tail]]


def table(rows: list[dict]) -> str:
    lines = [f"{'layers B T':16s} {'ours GPU ms':>12s} {'sdpa GPU ms':>12s} {'ratio':>6s} {'95% interval':>13s} "
             f"{'ours wall':>10s} {'sdpa wall':>10s} {'ours host':>10s} {'sdpa host':>10s} {'ours fwd host':>14s} "
             f"{'sdpa fwd host':>14s} {'back to back':>13s}  first loss ours / sdpa"]
    for r in rows:
        ours, theirs = r["cudnn_attn"], r["sdpa"]
        label = f"{r['layers']} {r['batch']} {r['sequence']}"
        if "error" in ours or "error" in theirs:
            lines.append(f"{label:16s} FAILED: {ours.get('error') or theirs.get('error')}")
            continue
        lines.append(f"{label:16s} {ours['gpu_ms']:12.2f} {theirs['gpu_ms']:12.2f} {r['ratio']:6.3f} "
                     f"{'%.3f-%.3f' % tuple(r['ratio_interval']):>13s} "
                     f"{ours['wall_ms']:10.2f} {theirs['wall_ms']:10.2f} {ours['host_ms']:10.2f} "
                     f"{theirs['host_ms']:10.2f} {ours['forward_host_ms']:14.2f} {theirs['forward_host_ms']:14.2f}"
                     f" {r['chained_ratio']:13.3f}"
                     f"  {ours['first_loss']:.4f} / {theirs['first_loss']:.4f}"
                     f"  (ours: {', '.join(r.get('paths', [])) or '-'})")
    for r in rows:
        for implementation in ("cudnn_attn", "sdpa"):
            split = r[implementation].get("kernels")
            if split:
                lines.append(f"kernels of one step, {r['layers']} {r['batch']} {r['sequence']} {implementation}: "
                             f"attention {split['attention_ms']:.2f} ms, other {split['other_ms']:.2f} ms; "
                             f"attention: {'; '.join(split['attention_top'])}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out", help="directory for bench_torch.json")
    parser.add_argument("--quick", action="store_true", help="the first two rows only")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per row (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_torch: no CUDA GPU", file=sys.stderr)
        return 3
    rows = []
    for layers, batch, sequence in ROWS[:2] if args.quick else ROWS:
        rows.append(measure(layers, batch, sequence, args.steps, args.warmup))
        print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_torch.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=2)
    plot(os.path.join(args.out, "bench_torch.json"), os.path.join(args.out, "bench_torch.png"))
    print()
    print(f"== torch training step, transformers Llama (bf16, 16/4 heads, d=64, AdamW), cudnn_attn vs sdpa on "
          f"{torch.cuda.get_device_name()} (torch {torch.__version__}; ratio = ours / sdpa GPU ms)")
    print(table(rows))
    return int(any("error" in r["cudnn_attn"] or "error" in r["sdpa"] for r in rows))


def plot(report: str, path: str) -> None:
    """GPU ms per training step of ours and sdpa for each row, split into attention kernels and the rest of the
    profiled step where it was profiled (bars; the label is ours / sdpa of the timed steps), from a
    ``bench_torch.json``; nothing without matplotlib.  ``python benchmarks/bench_torch.py --plot REPORT.json
    OUT.png`` draws it again from a saved report."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in json.load(open(report))["rows"] if "gpu_ms" in r["cudnn_attn"] and "gpu_ms" in r["sdpa"]]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for g, row in enumerate(rows):
        for i, implementation in enumerate(("cudnn_attn", "sdpa")):
            x = g + 0.4 * i
            ax.bar(x, row[implementation]["gpu_ms"], 0.38, color=f"C{i}", alpha=0.35,
                   label=f"{implementation}, timed step" if g == 0 else None)
            split = row[implementation].get("kernels")
            if split:
                ax.bar(x, split["attention_ms"], 0.38, color=f"C{i}",
                       label=f"{implementation}, attention kernels (profiled step)" if g == 0 else None)
        ax.text(g, row["cudnn_attn"]["gpu_ms"], f"{row['ratio']:.3f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks([g + 0.2 for g in range(len(rows))],
                  [f"{r['layers']} layers, B{r['batch']} T={r['sequence']}" for r in rows])
    ax.set_ylabel("GPU ms per training step (median)")
    ax.set_title("transformers Llama training step: cudnn_attn.torch against torch SDPA (label: ours / sdpa)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plot"] and len(sys.argv) == 4:
        plot(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
