"""The terminal progress display of a training run.

On a terminal one line is redrawn every step (bar, step, loss, tokens/s, ETA); when
stdout is not a TTY (a log file, a scheduler) a plain line is printed every
``log_every`` steps instead. Only process 0 prints.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO


def format_duration(seconds: float) -> str:
  """H:MM:SS (MM:SS under an hour); "?" for a time not known."""
  if not math.isfinite(seconds) or seconds < 0:
    return "?"
  m, s = divmod(int(seconds), 60)
  h, m = divmod(m, 60)
  return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
  """Step, loss, tokens/s and ETA; a redrawn line on a TTY, log lines otherwise."""

  def __init__(
    self,
    total_steps: int,
    start_step: int,
    *,
    log_every: int,
    enabled: bool = True,
    stream: TextIO | None = None,
  ):
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
    # Appended to each progress line (the trainer puts the step time and MFU here).
    self.extra = ""

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
    msg = (
      f"step {step}/{self.total} loss {loss:.4f} tok/s {rate:,.0f} "
      f"elapsed {format_duration(now - self.t0)} eta {format_duration(eta)}{self.extra}{extra}"
    )
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
