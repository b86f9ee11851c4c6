"""Every GPU test and benchmark in one command (run by ``benchmarks/run_all.sh``, which installs first): phases in
order, logs under ``$OUT``, a short summary table printed last.

    benchmarks/run_all.sh [PHASE ...] [--budget SECONDS] [--full] [--bundle] [--pytest ARGS]

Phases (default: ``tests train host jax attention``):

* ``tests``      - the GPU test tier (``pytest -m gpu``, 4 workers), JUnit XML -> per-file table;
* ``train``      - per-step times, ours vs ``jax.nn`` cuDNN, tiny and 1024-wide models, 1 and 2 GPUs;
* ``host``, ``jax``, ``attention``, ``fp8``, ``decode``, ``first_call``, ``context_parallel``, ``autotune``,
  ``peers``, ``small``, ``generate``, ``frameworks`` (training steps in Flax, and torch, against the framework's
  own attention), ``decomposition`` (a causal call against the same problem cut into blocks)
                 - ``benchmarks/bench_<phase>.py``; ``soak`` - ``benchmarks/soak.py`` (``--quick`` unless ``--full``,
                 or ``PHASE:full`` for one phase).  ``peers``: ours against jax.nn cuDNN/XLA and Tokamax (Mosaic
                 GPU, Triton) in jitted chains; ``small``: where a B1 N8 T=S=256 D64 forward's time goes;
                 ``decode``: the paged cache and the growing cache; ``generate``: transformers ``generate()``,
                 torch SDPA against ours; ``torch``: a transformers Llama training step, cudnn_attn.torch vs
                 torch's SDPA; ``torch_host``: an eager torch decode call's host time by stage, and a training call's.  A benchmark
                 with ``--max-seconds`` is given the phase's time less 45 s, so that
                 it writes its report before the phase's limit;
* ``host_ab``    - ``bench_host.py --quick`` of a base tree (``$AB_BASE``: a source checkout, ``git archive`` of the
                   commit to compare against) and of this one, alternating base, new, base, new in one run; each
                   tree runs its own ``bench_host.py``; ``bench_host_ab.txt`` tabulates the medians, new / base;
* ``soak_ab``    - the soak twice, half the phase's time each: ``CUDNN_ATTN_REPLAY=0``, then replay on (which of
                   them grows device memory); ``SOAK_CALLS`` / ``SOAK_ARGS`` as for ``soak``.

``PHASE:SECONDS`` (``tests:200``) gives a phase at most that long.  Each phase gets at most what is left of
``--budget`` (default 570 s) minus a reserve for the phases after it; a phase cut short is reported as such.  The
summary is printed last and written to ``$OUT/summary.txt``; ``--bundle`` then packs every other file of ``$OUT``
into ``$OUT/bundle.tar.gz``.  Exit status: non-zero when a phase failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.environ.get("OUT", os.path.join(ROOT, "bench_out"))
BENCHES = ("host", "jax", "attention", "fp8", "decode", "first_call", "context_parallel", "soak", "autotune", "peers",
           "small", "generate", "frameworks", "torch", "torch_host", "decomposition")
RESERVE = {"tests": 60, "train": 40}       # seconds kept for each later phase (default 30)


def _importable(tree: str, into: str) -> str:
    """A copy of source ``tree`` laid out as the installed package (graphs/ and jax_bridge/ inside cudnn_attn/),
    importable with ``PYTHONPATH=into`` ahead of the editable install (whose finder comes after the path's)."""
    import shutil

    shutil.rmtree(into, ignore_errors=True)
    shutil.copytree(os.path.join(tree, "cudnn_attn"), os.path.join(into, "cudnn_attn"))
    for sub in ("graphs", "jax_bridge"):
        shutil.copytree(os.path.join(tree, sub), os.path.join(into, "cudnn_attn", sub), dirs_exist_ok=True)
    return into


def host_ab(limit: float) -> tuple[int, float, list[str]]:
    """The ``host_ab`` phase (module doc): ``(status, seconds, summary lines)``."""
    base = os.environ.get("AB_BASE")
    if not base or not os.path.isdir(os.path.join(base, "cudnn_attn")):
        return 1, 0.0, [f"host_ab: AB_BASE={base!r} is not a source tree"]
    path = _importable(base, "/tmp/host_ab_base")
    where = subprocess.run([sys.executable, "-c", "import cudnn_attn.graphs as g, cudnn_attn.engine as e; "
                            "print(g.__file__, e.__file__)"], capture_output=True, text=True, cwd="/tmp",
                           env={**os.environ, "PYTHONPATH": path}).stdout.split()
    if not where or not all(f.startswith(path) for f in where):
        return 1, 0.0, [f"host_ab: the base tree does not import from {path} ({where})"]
    rc, took, medians = 0, 0.0, defaultdict(lambda: defaultdict(list))
    for i, (label, tree) in enumerate((("base", base), ("new", ROOT)) * 2):
        out = os.path.join(OUT, f"host_ab_{label}_{i // 2}")
        os.makedirs(out, exist_ok=True)
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")]))} \
            if label == "base" else None
        code, seconds = run(f"host_ab_{label}_{i // 2}", [sys.executable, os.path.join(tree, "benchmarks/bench_host.py"),
                                                          "--quick", "--out", out], (limit - took) / (4 - i), env)
        rc, took = rc | code, took + seconds
        report = os.path.join(out, "bench_host.json")
        for row in json.load(open(report))["rows"] if os.path.exists(report) else ():
            for measure, column in (("idle", "host_us_idle_gpu"), ("b2b", "host_us_back_to_back")):
                if row.get(column) is not None:
                    medians[(row["what"], row["kind"], measure)][label].append(row[column])
    lines = [f"== bench_host A/B, host us per call (idle: the GPU idle before each; b2b: back to back), base {base} "
             "against this tree; mean of two runs each",
             f"{'row':44s} {'kind':8s} {'clock':5s} {'base':>8s} {'new':>8s} {'new/base':>8s}"]
    for (what, kind, measure), found in medians.items():
        if found["base"] and found["new"]:
            b, n = (sum(found[k]) / len(found[k]) for k in ("base", "new"))
            lines.append(f"{what[:44]:44s} {kind[:8]:8s} {measure:5s} {b:8.2f} {n:8.2f} {n / b:8.2f}")
    with open(os.path.join(OUT, "bench_host_ab.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return rc, took, lines


def run(name: str, command: list[str], limit: float, env: dict | None = None) -> tuple[int, float]:
    log = os.path.join(OUT, f"{name}.log")
    start = time.monotonic()
    print(f"== {name} (at most {limit:.0f} s, log {log})", flush=True)
    with open(log, "w") as f:
        try:
            rc = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, timeout=limit, cwd=ROOT,
                                env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.monotonic() - start


def tail(name: str, lines: int) -> str:
    path = os.path.join(OUT, f"{name}.log")
    if not os.path.exists(path):
        return ""
    return "\n".join(open(path, errors="replace").read().rstrip().splitlines()[-lines:])


def test_table() -> list[str]:
    path = os.path.join(OUT, "gpu_tests.xml")
    if not os.path.exists(path):
        return ["no test report (see tests.log)"]
    files: dict = defaultdict(Counter)
    failed = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("file") or case.get("classname", "?").replace(".", "/") + ".py"
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        files[name][kind] += 1
        if kind in ("failure", "error"):
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    lines = [f"{'test file':48s} {'passed':>6s} {'failed':>6s} {'error':>6s} {'skipped':>7s}"]
    total = Counter()
    for name, c in sorted(files.items()):
        total.update(c)
        lines.append(f"{name:48s} {c['passed']:6d} {c['failure']:6d} {c['error']:6d} {c['skipped']:7d}")
    lines.append(f"{'total':48s} {total['passed']:6d} {total['failure']:6d} {total['error']:6d} {total['skipped']:7d}")
    lines += [f"  FAILED {name}" for name in failed[:30]]
    return lines


def gpu_count() -> int:
    """GPUs on this machine (``nvidia-smi -L``), 0 when it cannot tell."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listed.splitlines())


def train_commands(full: bool) -> list[tuple[str, list[str]]]:
    sizes = ("tiny", "wide") if full else ("tiny",)
    runs = []
    for size in sizes:
        for gpus in (1, 2):
            for impl in ("ours", "jax"):
                runs.append((f"{impl} {size} {gpus}gpu", ["--impl", impl, "--size", size, "--gpus", str(gpus),
                                                          "--steps", "60" if size == "tiny" else "14"]))
    return runs


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("phases", nargs="*", default=["tests", "train", "host", "jax", "attention"])
    parser.add_argument("--budget", type=float, default=570)
    parser.add_argument("--full", action="store_true", help="full benchmark runs (no --quick)")
    parser.add_argument("--pytest", default="tests", help="what pytest runs in the tests phase")
    parser.add_argument("--bundle", action="store_true",
                        help="at the end, every file of $OUT into $OUT/bundle.tar.gz (beside summary.txt)")
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    deadline = time.monotonic() + args.budget
    status, summary = 0, []
    phases = args.phases
    for i, phase in enumerate(phases):
        phase, _, mode = phase.partition(":")          # "attention:full" runs one benchmark without --quick,
        full = args.full or mode == "full"             # "tests:200" gives a phase at most 200 s
        reserve = sum(RESERVE.get(p.partition(":")[0], 30) for p in phases[i + 1:])
        limit = deadline - time.monotonic() - reserve
        if mode.isdigit():
            limit = min(limit, float(mode))
        if limit < 20:
            summary.append(f"{phase}: skipped (no time left)")
            status = 1
            continue
        if phase == "tests":
            rc, took = run("tests", [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                                     "-n", "4", "--timeout", "200", "--junitxml", os.path.join(OUT, "gpu_tests.xml"),
                                     "-o", "junit_family=xunit1", *args.pytest.split()], limit)
            summary += test_table()
        elif phase == "train":
            results = []
            start = time.monotonic()
            gpus = gpu_count()
            for label, extra in train_commands(full):
                wanted = int(extra[extra.index("--gpus") + 1])
                if wanted > gpus:                    # train_step.py would run on the GPUs there are: not this row
                    results.append({"label": label, "error": f"skipped: needs {wanted} GPUs, the machine has {gpus}"})
                    continue
                left = deadline - time.monotonic() - reserve
                if left < 20:
                    results.append({"label": label, "error": "no time left"})
                    continue
                log = "train_" + label.replace(" ", "_")
                rc, _ = run(log, [sys.executable, "benchmarks/train_step.py", "--watchdog",
                                  str(min(left, 240)), *extra], left)
                lines = [line for line in tail(log, 200).splitlines() if line.startswith("{")]
                try:
                    results.append({"label": label, **json.loads(lines[-1])})
                except (IndexError, json.JSONDecodeError):
                    results.append({"label": label, "error": f"rc={rc}: {tail(log, 3)[-300:]}"})
            took = time.monotonic() - start
            with open(os.path.join(OUT, "bench_train.json"), "w") as f:
                json.dump(results, f, indent=1)
            summary.append("== training step (ms per step, median after 2 warm-up steps)")
            for r in results:
                summary.append(f"  {r['label']:22s} " + (f"{r['median_step_ms']:8.2f} ms  losses {r['losses'][0]:.5f}"
                                                         f"..{r['losses'][-1]:.5f}" if "error" not in r
                                                         else r["error"] if r["error"].startswith("skipped")
                                                         else f"FAILED {r['error']}"))
            rc = int(any("error" in r and not r["error"].startswith("skipped") for r in results))
        elif phase == "host_ab":
            rc, took, summary_lines = host_ab(limit)
            summary.extend(summary_lines)
        elif phase == "soak_ab":
            rc, took = 0, 0.0
            for label, replay in (("replay_off", "0"), ("replay_on", "1")):
                part = (limit - took) / (2 if label == "replay_off" else 1)
                command = [sys.executable, "benchmarks/soak.py", "--out", os.path.join(OUT, f"soak_{label}.json"),
                           "--max-seconds", str(max(10, part - 60))] + ([] if full else ["--quick"])
                if os.environ.get("SOAK_CALLS"):
                    command += ["--calls", os.environ["SOAK_CALLS"]]
                code, seconds = run(f"soak_{label}", command + os.environ.get("SOAK_ARGS", "").split(), part,
                                    env={"CUDNN_ATTN_REPLAY": replay})
                rc, took = rc | code, took + seconds
                summary.append(f"== soak, CUDNN_ATTN_REPLAY={replay}\n" + tail(f"soak_{label}", 22))
        elif phase in BENCHES:
            quick = [] if full else ["--quick"]
            if phase == "soak":                       # the soak writes one JSON file
                command = ["benchmarks/soak.py", "--out", os.path.join(OUT, "soak.json")]
                if os.environ.get("SOAK_CALLS"):          # a length between --quick (4k) and the full 100k
                    command += ["--calls", os.environ["SOAK_CALLS"]]
                command += ["--max-seconds", str(max(10, limit - 60))] + os.environ.get("SOAK_ARGS", "").split()
            else:
                command = [f"benchmarks/bench_{phase}.py", "--out", OUT]
                if "--max-seconds" in open(os.path.join(ROOT, command[0])).read():   # it stops itself in time
                    command += ["--max-seconds", str(max(10, limit - 45))]
            rc, took = run(f"bench_{phase}", [sys.executable, *command, *quick], limit)
            text = open(os.path.join(OUT, f"bench_{phase}.log"), errors="replace").read()
            start = text.rfind("\n== ")
            summary.append(text[start + 1:].rstrip() if start >= 0 else f"bench_{phase}: no table; log tail:\n"
                           + tail(f"bench_{phase}", 5))
        else:
            summary.append(f"{phase}: unknown phase")
            status = 1
            continue
        summary.append(f"[{phase}: rc={rc}, {took:.0f} s{' - TIMED OUT' if rc == 124 else ''}]")
        status |= int(rc != 0)
    print("\n==================== summary ====================")
    print("\n".join(summary))
    with open(os.path.join(OUT, "summary.txt"), "w") as f:
        f.write("\n".join(summary) + "\n")
    if args.bundle:
        bundle(OUT)
    return status


def bundle(out: str) -> None:
    """Every file under ``out`` into ``out/bundle.tar.gz``, the originals removed; ``summary.txt`` stays beside it."""
    import tarfile

    path = os.path.join(out, "bundle.tar.gz")
    names = [os.path.relpath(os.path.join(root, name), out) for root, _, files in os.walk(out) for name in files]
    names = [n for n in names if n not in ("bundle.tar.gz", "summary.txt")]
    with tarfile.open(path, "w:gz") as archive:
        for name in sorted(names):
            archive.add(os.path.join(out, name), arcname=name)
    for name in names:
        os.remove(os.path.join(out, name))


if __name__ == "__main__":
    sys.exit(main())
