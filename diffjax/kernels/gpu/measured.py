"""Measured times of the GPU attention paths, per device: the figures ``"auto"`` follows.

:func:`slower` reads ``measured.json`` (written by ``python benchmarks/attention.py --record``).
Design: docs/kernels_gpu.md, "What runs where".
"""

from __future__ import annotations

import functools
import json
import math
import os

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "measured.json")
PASSES = ("forward", "forward+backward")
_KEYS = ("device", "op", "pass", "seq", "dtype", "head_dim", "ms")


def _check(row: dict, where: str) -> dict:
  missing = [k for k in _KEYS if k not in row]
  if missing or row["pass"] not in PASSES or not row["ms"]:
    raise ValueError(
      f"{where}: a measured row needs {_KEYS} with pass in {PASSES} and at least one time; "
      f"got {row}. Rewrite it with benchmarks/attention.py --record."
    )
  return row


def load(path: str = PATH) -> tuple[dict, ...]:
  """The rows of ``path`` (checked); none when it does not exist."""
  if not os.path.exists(path):
    return ()
  with open(path, encoding="utf-8") as f:
    rows = json.load(f)["rows"]
  return tuple(_check(r, path) for r in rows)


@functools.cache
def _packaged() -> tuple[dict, ...]:
  return load(PATH)


def rows_for(
  op: str, device_kind: str | None, pass_: str, rows: tuple[dict, ...] | None = None
) -> list[dict]:
  """The rows of ``op`` and ``pass_`` ("forward" or "forward+backward") for this device."""
  if device_kind is None:
    return []
  rows = _packaged() if rows is None else rows
  return [
    r
    for r in rows
    if r["op"] == op and r["pass"] == pass_ and r["device"].lower() in device_kind.lower()
  ]


def slower(
  op: str,
  implementation: str,
  device_kind: str | None,
  seq: int,
  dtype: str,
  head_dim: int,
  alternatives: tuple[str, ...],
  rows: tuple[dict, ...] | None = None,
  pass_: str = "forward+backward",
) -> str | None:
  """Why ``implementation`` of ``op`` should give way to one of ``alternatives`` on this
  device at this shape in ``pass_`` (a call that is differentiated: "forward+backward"; one
  that is not: "forward"), or None."""
  found = rows_for(op, device_kind, pass_, rows)
  found = [r for r in found if (r["dtype"], r["head_dim"]) == (dtype, head_dim)] or found
  if not found:
    return None
  row = min(found, key=lambda r: (abs(math.log(r["seq"] / max(seq, 1))), r["seq"]))
  ms = row["ms"]
  if implementation not in ms:
    return None
  rivals = {name: t for name, t in ms.items() if name in alternatives}
  if not rivals or min(rivals.values()) >= ms[implementation]:
    return None
  best = min(rivals, key=rivals.get)
  return (
    f"measured slower than {best} on {row['device']} ({op}, T {row['seq']}, {row['dtype']}, "
    f"d {row['head_dim']}, {pass_} {ms[implementation]:.2f} ms against "
    f"{rivals[best]:.2f} ms; diffjax/kernels/gpu/measured.json)"
  )


def record(new_rows: list[dict], path: str = PATH) -> None:
  """Writes ``new_rows`` into ``path``, replacing rows of the same device, op, pass, sequence
  length, dtype and head dim."""
  key = lambda r: (r["device"], r["op"], r["pass"], r["seq"], r["dtype"], r["head_dim"])  # noqa: E731
  merged = {key(r): r for r in load(path)}
  for r in new_rows:
    merged[key(_check(r, "new row"))] = r
  rows = sorted(merged.values(), key=key)
  with open(path, "w", encoding="utf-8") as f:
    json.dump({"rows": rows}, f, indent=1, sort_keys=True)
    f.write("\n")
  _packaged.cache_clear()
