"""Seconds from ``python -m diffjax.serve`` to its ``serving`` line, with and without the
compilation cache, in one run.

    python train.py --config=configs/default.py --workdir=runs/default
    python benchmarks/serve_start.py --workdir=runs/default [--repeat=3]

Each round starts the server three times on the run, one after the other, each stopped with
SIGTERM once it serves:

- ``no cache``: ``--compile_cache=`` (every program compiled);
- ``first start``: an empty cache directory (every program compiled and written to it);
- ``restart``: the same directory again (every program loaded from it).

The cache directories are temporary, so the run's own ``compile_cache/`` is neither read nor
written. A row gives the median of the rounds and each round's seconds.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def _seconds_to_serve(workdir: str, *flags: str) -> tuple[float, str]:
  """(seconds until the server prints its address, the line that says what it compiles)."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env.setdefault("JAX_PLATFORMS", "cpu")
  cmd = [sys.executable, "-m", "diffjax.serve", f"--workdir={workdir}", "--port=0", *flags]
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
  lines = []
  for line in proc.stderr:
    lines.append(line.rstrip())
    if line.startswith("serving ") and "http://" in line:
      seconds = time.perf_counter() - t0
      proc.send_signal(signal.SIGTERM)
      proc.communicate(timeout=120)
      return seconds, next((x for x in lines if "compiling" in x), "")
  proc.wait()
  raise RuntimeError("the server did not start:\n" + "\n".join(lines[-20:]))


def main() -> None:
  p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
  p.add_argument("--workdir", required=True, help="a train.py run")
  p.add_argument("--repeat", type=int, default=3, help="rounds of the three starts")
  a = p.parse_args()
  if not os.path.isdir(a.workdir):
    p.error(f"--workdir={a.workdir!r} is not a directory: give a train.py run.")
  if a.repeat < 1:
    p.error(f"--repeat={a.repeat} must be at least 1.")
  runs: dict[str, list[float]] = {"no cache": [], "first start": [], "restart": []}
  what = ""
  for _ in range(a.repeat):
    with tempfile.TemporaryDirectory() as cache:
      seconds, what = _seconds_to_serve(a.workdir, "--compile_cache=")
      runs["no cache"].append(seconds)
      for name in ("first start", "restart"):
        runs[name].append(_seconds_to_serve(a.workdir, f"--compile_cache={cache}")[0])
  print(
    f"{a.workdir}: {what}; {os.cpu_count()} CPUs ({platform.processor() or platform.machine()})"
  )
  print("| start | seconds to serving (median) | rounds |")
  print("|---|---|---|")
  for name, seconds in runs.items():
    each = ", ".join(f"{s:.1f}" for s in seconds)
    print(f"| {name} | {statistics.median(seconds):.1f} | {each} |")


if __name__ == "__main__":
  main()
