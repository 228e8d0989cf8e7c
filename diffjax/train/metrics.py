"""Run metrics: a terminal progress bar, JSONL lines and TensorBoard events.

Only process 0 writes files. The progress bar redraws one line on a terminal and
falls back to plain log lines (every ``log_every`` steps) when stdout is not a TTY.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any


def _fmt_time(seconds: float) -> str:
  if not math.isfinite(seconds) or seconds < 0:
    return "?"
  m, s = divmod(int(seconds), 60)
  h, m = divmod(m, 60)
  return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class MetricsWriter:
  """Writes ``metrics.jsonl`` and TensorBoard events into the workdir.

  A cloud workdir (``gs://...``) gets ``metrics.jsonl`` re-uploaded at most once a
  minute and at the end (object stores have no append); TensorBoard events are
  written only for local workdirs.
  """

  def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True,
               upload_every_s: float = 60.0):
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
      from etils import epath  # pylint: disable=import-outside-toplevel
      self._remote = epath.Path(workdir, "metrics.jsonl")
      if self._remote.exists():
        self._lines = self._remote.read_text().splitlines(keepends=True)
      return
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
        self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
      except ImportError:
        self._tb = None

  def write(self, step: int, values: dict[str, Any]) -> None:
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
    if self._tb is not None:
      self._tb.close()


class Progress:
  """Step, loss, tokens/s and ETA; a redrawn line on a TTY, log lines otherwise."""

  def __init__(self, total_steps: int, start_step: int, *, log_every: int,
               enabled: bool = True, stream=None):
    self.total = total_steps
    self.start = start_step
    self.log_every = max(1, log_every)
    self.enabled = enabled
    self.stream = stream or sys.stdout
    self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
    self.t0 = time.perf_counter()
    self.tokens = 0.0
    self._t_last = self.t0
    self._tokens_last = 0.0

  def update(self, step: int, loss: float, tokens: float, extra: str = "") -> None:
    if not self.enabled:
      return
    self.tokens += tokens
    if not self.tty and step % self.log_every and step != self.total:
      return
    now = time.perf_counter()
    rate = (self.tokens - self._tokens_last) / max(now - self._t_last, 1e-9)
    self._t_last, self._tokens_last = now, self.tokens
    done = step - self.start
    eta = (now - self.t0) / max(done, 1) * (self.total - step)
    msg = (f"step {step}/{self.total} loss {loss:.4f} tok/s {rate:,.0f} "
           f"elapsed {_fmt_time(now - self.t0)} eta {_fmt_time(eta)}{extra}")
    if self.tty:
      width = 24
      filled = int(width * step / max(self.total, 1))
      self.stream.write("\r[" + "#" * filled + "." * (width - filled) + "] " + msg + "\x1b[K")
    else:
      self.stream.write(msg + "\n")
    self.stream.flush()

  def message(self, text: str) -> None:
    if not self.enabled:
      return
    if self.tty:
      self.stream.write("\r\x1b[K")
    self.stream.write(text + "\n")
    self.stream.flush()

  def close(self) -> None:
    if self.enabled and self.tty:
      self.stream.write("\n")
      self.stream.flush()
