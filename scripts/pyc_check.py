"""Whether the packages a first call imports have their bytecode, and what ``import numpy`` costs.

    python3 scripts/pyc_check.py [--compile] PACKAGE ...

A package installed by ``pip install`` carries its ``.pyc`` files; one installed with ``--no-compile`` on a
machine with ``PYTHONDONTWRITEBYTECODE=1`` (the GPU machine sets it) compiles every module it imports in every
new process, which makes ``import numpy`` several times slower there and inflates ``bench_first_call``'s
import row with time that no user install pays.  This prints, for each package: how many of its modules have
up-to-date bytecode where the interpreter looks for it, whether its folder is writable, and the median time of
``import PACKAGE`` in fresh processes.  ``--compile`` then compiles the packages that lack it (where the folder
is writable, as an install would have) and measures again.  One line per package; nothing is changed without
``--compile``.
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import os
import statistics
import subprocess
import sys
import time


def _folder(package: str) -> str | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _bytecode(folder: str) -> tuple[int, int]:
    """(modules, modules whose bytecode is present and not older than the source)."""
    total = fresh = 0
    for root, _, files in os.walk(folder):
        for name in files:
            if not name.endswith(".py"):
                continue
            source = os.path.join(root, name)
            total += 1
            cached = importlib.util.cache_from_source(source)
            if os.path.exists(cached) and os.path.getmtime(cached) >= os.path.getmtime(source):
                fresh += 1
    return total, fresh


def _import_ms(package: str, runs: int = 3) -> float:
    samples = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", f"import time; t = time.perf_counter(); import {package}; "
                              "print(time.perf_counter() - t)"], capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            return float("nan")
        samples.append(1e3 * float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(samples)


def report(package: str) -> tuple[str, int, int, bool]:
    folder = _folder(package)
    if folder is None:
        print(f"{package}: not found")
        return package, 0, 0, False
    total, fresh = _bytecode(folder)
    writable = os.access(folder, os.W_OK)
    print(f"{package}: {fresh}/{total} modules with bytecode, folder {'writable' if writable else 'read-only'} "
          f"({folder}); import {_import_ms(package):.1f} ms (median of 3 fresh processes)", flush=True)
    return folder, total, fresh, writable


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="compile the packages that lack bytecode, then measure")
    parser.add_argument("packages", nargs="+")
    args = parser.parse_args()
    print(f"PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', 'unset')}, "
          f"pycache prefix {sys.pycache_prefix}")
    compiled = []
    for package in args.packages:
        folder, total, fresh, writable = report(package)
        if args.compile and total and fresh < total and writable:
            start = time.perf_counter()
            compileall.compile_dir(folder, quiet=1, workers=0)
            compiled.append(package)
            print(f"  compiled {package} in {time.perf_counter() - start:.1f} s")
    for package in compiled:
        print("after compiling: ", end="")
        report(package)
    return 0


if __name__ == "__main__":
    sys.exit(main())
