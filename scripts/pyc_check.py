"""Whether the packages a first call imports have their bytecode, and what importing each costs.

    python3 scripts/pyc_check.py [--compile] PACKAGE ...

A package installed with ``pip install --no-compile`` and imported by an interpreter that writes no bytecode
(the GPU machine sets ``PYTHONDONTWRITEBYTECODE=1``) compiles every module it imports in every new process:
``bench_first_call``'s import row then measures the machine's install, not the library.  This prints, for each
package, what ``python -m cudnn_attn info`` checks (:func:`cudnn_attn.tools.cli.bytecode_status`) and the median time
of ``import PACKAGE`` in fresh processes; ``--compile`` then compiles the packages that lack bytecode, where
their folder is writable, as an install would have, and measures again.  Nothing changes without ``--compile``.
"""

from __future__ import annotations

import argparse
import compileall
import statistics
import subprocess
import sys
import time

from cudnn_attn.tools.cli import bytecode_status


def _import_ms(package: str, runs: int = 3) -> float:
    samples = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", f"import time; t = time.perf_counter(); import {package}; "
                              "print(time.perf_counter() - t)"], capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            return float("nan")
        samples.append(1e3 * float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(samples)


def report(package: str):
    status = bytecode_status(package)
    if status is None:
        print(f"{package}: not found")
    else:
        print(f"{package}: {status.modules - status.missing}/{status.modules} modules with bytecode, "
              f"{'written at import' if status.written else 'none written at import'} ({status.folder}); "
              f"import {_import_ms(package):.1f} ms (median of 3 fresh processes)", flush=True)
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="compile the packages that lack bytecode, then measure")
    parser.add_argument("packages", nargs="+")
    args = parser.parse_args()
    print(f"PYTHONDONTWRITEBYTECODE={'set' if sys.dont_write_bytecode else 'unset'}, "
          f"pycache prefix {sys.pycache_prefix}")
    compiled = []
    for package in args.packages:
        status = report(package)
        if args.compile and status is not None and status.missing:
            start = time.perf_counter()
            if compileall.compile_dir(status.folder, quiet=1, workers=0):
                compiled.append(package)
            print(f"  compiled {package} in {time.perf_counter() - start:.1f} s")
    for package in compiled:
        print("after compiling: ", end="")
        report(package)
    return 0


if __name__ == "__main__":
    sys.exit(main())
