"""Helpers shared by the test files: paths and the shipped configs, small training and model
configs, metrics, a tokenizer file, filler text, and the output checks of commands run in a fresh
process."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

# The tests' own directory (shared helpers, fixtures) and the repository root.
TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
FIXTURES = os.path.join(TESTS, "fixtures")

# Lines that libraries print on stderr before any of our code runs: absl's notice and the
# CUDA plugin's "no driver" line (installed by the ``[gpu-compile]`` extra, loaded by jax
# even with JAX_PLATFORMS=cpu).
_LIBRARY_NOISE = re.compile(
  r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to "
  r"STDERR|[IWE]\d{4} [\d:.]+\s+\d+ cudart_stub\.cc:\d+\] .*)$"
)


# The outer limit of a wait on another process. A test waits for an event (a file written,
# a line printed, a process ended), never for a wall-clock budget: on a loaded 2-core machine
# a fresh Python takes many times longer to import the package than on an idle one.
WAIT_LIMIT_S = 900


def own_stderr(text: str) -> list[str]:
  """The lines of ``text`` (a child's stderr) that the libraries' start-up notices are not."""
  return [line for line in text.splitlines() if not _LIBRARY_NOISE.match(line)]


def tiny_config(arm="diff_v1", steps=6):
  """A train.py config of a one-layer model that trains in seconds on a CPU."""
  from diffjax.presets import base_config  # pylint: disable=import-outside-toplevel

  c = base_config()
  c.model.update(dict(arm=arm, size="tiny", d_model=64, num_layers=1, mlp_dim=128, head_dim=16))
  c.seq_len = 32
  c.global_batch_size = 4
  c.num_steps = steps
  c.log_every = 1
  c.eval_every = 0
  c.eval_batches = 2
  c.tensorboard = False
  c.log_batch_hash = True
  c.data.max_documents = 40
  c.optim.update(dict(warmup_steps=2, decay_steps=steps))
  c.checkpoint.update(dict(every=3, keep=5, async_save=False))
  # One of the test process's 8 CPU devices (tests/conftest.py), as a train.py process has.
  c.mesh.num_devices = 1
  return c


def small_run_config(arm="diff_v1", steps=2):
  """:func:`tiny_config` narrowed further (width 32, head dim 8, batch 2, one eval batch): the
  run that the harness and export tests evaluate many times over."""
  c = tiny_config(arm, steps=steps)
  c.model.update(dict(d_model=32, num_layers=1, mlp_dim=64, head_dim=8))
  c.global_batch_size, c.eval_batches, c.data.max_documents = 2, 1, 20
  c.optim.warmup_steps = 1
  c.checkpoint.update(dict(every=2, keep=1))
  return c


def read_metrics(workdir):
  """A run's metrics.jsonl train rows by step."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r for r in rows if "train/loss" in r}


def write_bpe_tokenizer(path, special_tokens=("</s>",), texts=None, vocab_size=300):
  """Trains a byte-level BPE tokenizers file at ``path``; returns the tokenizers object."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=list(special_tokens),
    show_progress=False,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  tok.train_from_iterator(
    texts or ["the quick brown fox jumps over the lazy dog"] * 20, trainer=trainer
  )
  tok.save(str(path))
  return tok


def run_python(code: str, timeout: int = WAIT_LIMIT_S) -> str:
  """Runs ``code`` in a fresh CPU-only Python from the repository root, with these helpers
  importable (so ``import tests.<area>.test_x`` works); returns its stdout's last line."""
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONPATH=os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p),
  )
  proc = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout.strip().splitlines()[-1]


def free_port(candidates=None) -> int:
  """A TCP port of 127.0.0.1 free now: the first of ``candidates`` that binds (default: one the
  system picks)."""
  import socket  # pylint: disable=import-outside-toplevel

  for port in candidates or [0]:
    with socket.socket() as s:
      try:
        s.bind(("127.0.0.1", port))
      except OSError:
        continue
      return s.getsockname()[1]
  raise RuntimeError("no free port")


def finish_processes(procs, timeout: float = WAIT_LIMIT_S) -> list[tuple[str, str]]:
  """The (stdout, stderr) of each of ``procs`` (Popen objects with text pipes) once it ends,
  each waited for up to ``timeout`` seconds; any still running after that is killed."""
  try:
    return [p.communicate(timeout=timeout) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()


def wait_until(condition, what: str, procs=(), limit_s: float = WAIT_LIMIT_S, poll_s: float = 0.1):
  """Returns once ``condition()`` is true; fails naming ``what`` if one of ``procs`` (Popen
  objects that must stay alive meanwhile) ends first, or after ``limit_s`` seconds."""
  import time  # pylint: disable=import-outside-toplevel

  start = time.monotonic()
  while not condition():
    for proc in procs:
      if proc.poll() is not None:
        raise AssertionError(f"{what}: the process ended first, with status {proc.returncode}")
    if time.monotonic() - start > limit_s:
      raise AssertionError(f"{what}: not within {limit_s:.0f} s")
    time.sleep(poll_s)


def write_atomically(path: str, text: str) -> str:
  """Python source (one line) that writes ``text`` to ``path`` whole: a temporary file, then a
  rename, so a reader never sees it half-written. For children's code strings."""
  return (
    f"import os as _o; _p = {str(path)!r}; open(_p + '.tmp', 'w').write({text}); "
    "_o.replace(_p + '.tmp', _p)"
  )


def metrics_rows(workdir) -> list[dict]:
  """Every row of a run's metrics.jsonl, in file order."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def small_model_config(arm: str, **kw):
  """A three-layer ModelConfig of width 32 and vocabulary 40 (the scanned-layer and weight-decay
  tests' model)."""
  from diffjax.model import ModelConfig  # pylint: disable=import-outside-toplevel

  return ModelConfig(
    attention=arm,
    vocab_size=40,
    d_model=32,
    num_layers=3,
    num_heads=2,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=40,
    **kw,
  )


def tiny_model(arm: str, vocab: int = 258, seed: int = 0):
  """A two-layer DecoderLM of width 32 over the byte tokenizer's 258 ids (the harness's and the
  server's model)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from diffjax.model import DecoderLM, ModelConfig  # pylint: disable=import-outside-toplevel

  cfg = ModelConfig(
    attention=arm,
    d_model=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    mlp_dim=64,
    vocab_size=vocab,
  )
  return DecoderLM(cfg, rngs=nnx.Rngs(params=seed))


class _Documents(list):
  """A small in-memory filler source (no digits, so needles are the only numbers)."""

  name = "filler"


_FILLER_TEXT = (
  "the quick brown fox jumps over the lazy dog while a river runs past the old mill "
  "and nobody writes any numbers down in this place at all "
)


def filler_source():
  """Five documents of byte-tokenized filler text for the retrieval tasks (a DocumentSource)."""
  from diffjax.data import ByteTokenizer  # pylint: disable=import-outside-toplevel

  tok = ByteTokenizer()
  return _Documents(tok.encode(_FILLER_TEXT * (i + 2)) for i in range(5))


# The shipped run configs and comparison configs.
RUN_CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.py")))
COMPARE_CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "compare", "*.py")))
