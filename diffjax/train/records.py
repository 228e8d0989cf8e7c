"""A run's files on disk: ``metrics.jsonl`` (write, read, trim on resume) and JSON files.

Paths may be local or cloud URIs (``gs://...``, through ``etils.epath``). Only process 0
writes; the trainer passes ``enabled=False`` elsewhere. The metrics format: docs/training.md.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from etils import epath

METRICS_FILE = "metrics.jsonl"


def write_json(path: str | os.PathLike, obj: Any, *, indent: int = 2) -> None:
  """Writes ``obj`` as JSON through a temporary name and a rename, so a reader (or a
  process killed mid-write) never sees half a file. Non-JSON values go through ``str``."""
  path = epath.Path(path)
  tmp = path.parent / (path.name + ".tmp")
  tmp.write_text(json.dumps(obj, indent=indent, default=str, allow_nan=True) + "\n")
  tmp.replace(path)


def _parse_rows(text: str) -> list[dict[str, Any]]:
  rows = []
  for line in text.splitlines():
    try:
      row = json.loads(line)
    except json.JSONDecodeError:  # a line cut short by a kill
      continue
    if isinstance(row, dict) and "step" in row:
      rows.append(row)
  return rows


def _metrics_path(workdir: str | os.PathLike) -> epath.Path:
  return epath.Path(workdir) / METRICS_FILE


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, Any]]:
  """The rows of ``workdir``'s metrics.jsonl, one dict per step, sorted by step.

  Lines of the same step are merged; where a key repeats (a step trained again after
  a resume) the later line wins. Unparseable lines are skipped. Returns ``[]`` when
  the file does not exist.
  """
  path = _metrics_path(workdir)
  if not path.exists():
    return []
  merged: dict[int, dict[str, Any]] = {}
  for row in _parse_rows(path.read_text()):
    step = int(row["step"])
    merged.setdefault(step, {}).update(row)
    merged[step]["step"] = step
  return [merged[s] for s in sorted(merged)]


def rewrite_metrics(workdir: str | os.PathLike, keep: Callable[[dict[str, Any]], bool]) -> int:
  """Keeps only the metrics.jsonl lines whose row satisfies ``keep`` (atomically).

  Used on resume: the steps after the restored checkpoint are trained again, so their
  old lines are dropped before new ones are appended. Unparseable lines are dropped too.
  Returns the number of lines removed (0 if there is no file).
  """
  path = _metrics_path(workdir)
  if not path.exists():
    return 0
  lines = path.read_text().splitlines()
  kept = []
  for line in lines:
    rows = _parse_rows(line)
    if rows and keep(rows[0]):
      kept.append(line + "\n")
  if len(kept) != len(lines):
    tmp = path.parent / (path.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)
  return len(lines) - len(kept)


class MetricsWriter:
  """Appends rows to ``metrics.jsonl`` and writes TensorBoard events into the workdir.

  A cloud workdir (``gs://...``) gets ``metrics.jsonl`` re-uploaded at most once every
  ``upload_every_s`` seconds and at the end (object stores have no append); TensorBoard
  events are written only for local workdirs.
  """

  def __init__(
    self,
    workdir: str,
    *,
    enabled: bool = True,
    tensorboard: bool = True,
    upload_every_s: float = 60.0,
  ):
    self.enabled = enabled
    self._jsonl = None
    self._tb = None
    self._remote = None
    self._lines: list[str] = []
    self._upload_every_s = upload_every_s
    self._last_upload = 0.0
    if not enabled:
      return
    if "://" in workdir:
      self._remote = _metrics_path(workdir)
      if self._remote.exists():
        self._lines = self._remote.read_text().splitlines(keepends=True)
      return
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, METRICS_FILE), "a", encoding="utf-8")
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel

        self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
      except ImportError:
        self._tb = None

  def write(self, step: int, values: dict[str, Any]) -> None:
    """Appends ``{"step": step, **values}`` (values converted to float) as one line."""
    if not self.enabled:
      return
    clean = {k: float(v) for k, v in values.items()}
    line = json.dumps({"step": int(step), **clean}) + "\n"
    if self._remote is not None:
      self._lines.append(line)
      if time.monotonic() - self._last_upload > self._upload_every_s:
        self._upload()
      return
    self._jsonl.write(line)
    self._jsonl.flush()
    if self._tb is not None:
      for k, v in clean.items():
        self._tb.add_scalar(k, v, int(step))

  def _upload(self) -> None:
    self._remote.write_text("".join(self._lines))
    self._last_upload = time.monotonic()

  def close(self) -> None:
    if self._remote is not None and self._lines:
      self._upload()
    if self._jsonl is not None:
      self._jsonl.close()
      self._jsonl = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
