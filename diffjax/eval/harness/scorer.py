"""Log-likelihoods of continuations, batched by length through one compiled forward per bucket.

:class:`TokenScorer` answers "how likely is ``continuation`` after ``context``" for token-id
lists; truncation, buckets and padding: docs/evaluation.md#lm-evaluation-harness-tasks.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from diffjax import arms
from diffjax import sharding as shd
from diffjax.model import DecoderLM

MIN_BUCKET = 16


def length_bucket(n: int, max_length: int) -> int:
  """The padded width of an input of ``n`` tokens: a power of two >= 16, at most max_length."""
  return min(max(MIN_BUCKET, 1 << max(0, math.ceil(math.log2(max(n, 1))))), max_length)


def _token_scores(graphdef, state, inputs_BxT, targets_BxT):
  """Per position: log p(target) in float32 and whether the target is the arg-max token."""
  model = nnx.merge(graphdef, state)
  b, t = inputs_BxT.shape
  positions_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  segments_BxT = jnp.ones((b, t), jnp.int32)
  logits_BxTxV = model(inputs_BxT, positions_BxT, segments_BxT).astype(jnp.float32)
  logp_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
  target_logp_BxT = jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
  greedy_BxT = jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT
  return target_logp_BxT, greedy_BxT


def _device_memory_limit() -> int | None:
  """Bytes the first device may allocate, when it says (GPUs and TPUs do, CPUs do not)."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("bytes_limit")


def _free_host_bytes() -> int:
  return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class TokenScorer:
  """Scores (context, continuation) token lists with a :class:`DecoderLM`.

  Args:
    model: the model (its parameters are read, not changed).
    max_length: the longest input the model is run on (its training context, usually).
    batch_size: rows per forward pass.
    mesh, rules: run sharded over a mesh (rows over the batch axes, parameters laid out by
      their logical axes), as :func:`diffjax.generation.generate` does.
  """

  def __init__(
    self,
    model: DecoderLM,
    *,
    max_length: int,
    batch_size: int = 8,
    mesh: jax.sharding.Mesh | None = None,
    rules=None,
  ):
    if not isinstance(max_length, (int, np.integer)) or max_length < 1:
      raise ValueError(f"max_length={max_length!r} must be a positive integer.")
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
      raise ValueError(f"batch_size={batch_size!r} must be a positive integer.")
    self.model = model
    self.max_length = int(max_length)
    self.mesh = mesh
    self.rules = tuple(
      (name, None if name == "length" else axes) for name, axes in (rules or shd.DEFAULT_RULES)
    )
    multiple = shd.batch_rows_multiple(mesh, self.rules)
    self.batch_size = -(-int(batch_size) // multiple) * multiple
    self._graphdef, state = nnx.split(model)
    if mesh is not None:
      cfg = model.config
      shd.validate_mesh_for_model(
        mesh,
        cfg,
        heads=arms.get(cfg.attention).heads,
        rules=self.rules,
        params=state,
        fix="Score on a mesh= whose axes divide the model (e.g. a smaller tensor axis).",
      )
      with shd.activation_sharding(mesh, self.rules):
        pure = jax.device_put(nnx.to_pure_dict(state), shd.param_shardings(state, mesh, self.rules))
      nnx.replace_by_pure_dict(state, pure)
      spec = shd.spec_for_mesh(shd.logical_to_spec(("batch", "length"), self.rules), mesh)
      self._rows_sharding = jax.sharding.NamedSharding(mesh, spec)
    self._state = state
    self._fn = jax.jit(lambda s, x, y: _token_scores(self._graphdef, s, x, y))
    self.compiled_shapes: set[tuple[int, int]] = set()

  def fit_batch_size(self, limit: int) -> int:
    """Sets and returns the largest batch whose forward at the full context runs.

    Tries the largest power of two up to ``limit`` (a multiple of the mesh's batch rows) and
    halves it while the device runs out of memory. A device that reports no memory limit (a
    CPU) cannot fail that way before the host does, so there a batch must also keep the
    forward's largest arrays (the logits and their log-softmax, the per-layer activations)
    within half the free host memory.
    """
    if not isinstance(limit, (int, np.integer)) or limit < 1:
      raise ValueError(f"max_batch_size={limit!r} must be a positive integer.")
    multiple = shd.batch_rows_multiple(self.mesh, self.rules)
    rows = max(multiple, 1 << (int(limit).bit_length() - 1))
    cfg = self.model.config
    budget = None if _device_memory_limit() else _free_host_bytes() // 2
    while True:
      forward_bytes = rows * self.max_length * (3 * cfg.vocab_size + 16 * cfg.d_model) * 4
      if budget is None or forward_bytes <= budget or rows <= multiple:
        try:
          zeros = np.zeros((rows, self.max_length), np.int32)
          self._run(zeros, zeros)
          break
        except Exception as e:  # pylint: disable=broad-except  # re-raised unless memory
          text = str(e)
          if rows <= multiple or not (
            "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
          ):
            raise
      rows = max(multiple, rows // 2)
    self.batch_size = rows
    return rows

  def _run(self, inputs_BxT: np.ndarray, targets_BxT: np.ndarray):
    self.compiled_shapes.add(inputs_BxT.shape)
    if self.mesh is None:
      return jax.device_get(self._fn(self._state, inputs_BxT, targets_BxT))
    x, y = (jax.device_put(a, self._rows_sharding) for a in (inputs_BxT, targets_BxT))
    with shd.activation_sharding(self.mesh, self.rules):
      return jax.device_get(self._fn(self._state, x, y))

  def score(
    self,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    progress: Callable[[int], None] | None = None,
  ) -> list[tuple[float, bool]]:
    """(log-likelihood of the continuation, whether greedy decoding gives it) per request.

    Each request is ``(context_ids, continuation_ids)``; the context must not be empty
    (give the end-of-document token for "no context"). ``progress(n)`` is called after each
    batch with the number of requests it finished.
    """
    prepared = []
    vocab = self.model.config.vocab_size
    for i, (context, continuation) in enumerate(requests):
      context, continuation = list(map(int, context)), list(map(int, continuation))
      if not context:
        raise ValueError(
          f"request {i} has an empty context: pass at least one token (the "
          "end-of-document token for a continuation with no context)."
        )
      if len(continuation) > self.max_length:
        raise ValueError(
          f"request {i}: a continuation of {len(continuation)} tokens does not "
          f"fit the model's context of max_length={self.max_length}."
        )
      whole = (context + continuation)[-(self.max_length + 1) :]
      if min(whole) < 0 or max(whole) >= vocab:
        raise ValueError(f"request {i} holds token ids outside [0, {vocab}).")
      prepared.append((whole, len(continuation)))
    results: list[tuple[float, bool]] = [(0.0, True)] * len(prepared)
    # Longest first (the first batch shows the worst memory use at once), by bucket.
    order = sorted(
      (i for i, (_, k) in enumerate(prepared) if k), key=lambda i: -len(prepared[i][0])
    )
    by_bucket: dict[int, list[int]] = {}
    for i in order:
      by_bucket.setdefault(length_bucket(len(prepared[i][0]) - 1, self.max_length), []).append(i)
    for width, members in by_bucket.items():
      for start in range(0, len(members), self.batch_size):
        rows = members[start : start + self.batch_size]
        inputs = np.zeros((self.batch_size, width), np.int32)
        targets = np.zeros((self.batch_size, width), np.int32)
        for r, i in enumerate(rows):
          whole = prepared[i][0]
          inputs[r, : len(whole) - 1] = whole[:-1]
          targets[r, : len(whole) - 1] = whole[1:]
        logp, greedy = self._run(inputs, targets)
        for r, i in enumerate(rows):
          n, k = len(prepared[i][0]) - 1, prepared[i][1]
          results[i] = (
            float(np.sum(logp[r, n - k : n], dtype=np.float64)),
            bool(np.all(greedy[r, n - k : n])),
          )
        if progress is not None:
          progress(len(rows))
    if progress is not None and len(order) < len(prepared):
      progress(len(prepared) - len(order))
    return results
