"""Kernel preflight: each fused kernel a run chose, run once on the real device first.

One that fails is switched off (:func:`diffjax.ops.dispatch.demote`). Design:
docs/kernels_gpu.md, "First contact with real hardware: preflight".
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from diffjax.core.op_specs import OpSpec
from diffjax.ops import attention, dispatch

# Platforms whose fused kernels are checked, and the implementations that count as fused.
PLATFORMS = ("gpu", "tpu")
FUSED = ("pallas_tpu", "pallas_gpu")
# Relative error (max |kernel - xla| / max |xla|, output and every gradient) allowed.
TOLERANCE = {
  jnp.dtype(jnp.float32): 1e-3,
  jnp.dtype(jnp.bfloat16): 5e-2,
  jnp.dtype(jnp.float16): 1e-2,
}
_SEQ = 256  # queries and keys of the check: four 64-row blocks, causal
# What this process has checked already: (platform, op, dtype, head dim, group, impl).
_DONE: dict[tuple, Check | None] = {}


@dataclasses.dataclass(frozen=True)
class Check:
  """One kernel's preflight: ``ok``, or the ``reason`` it was switched to ``fallback``."""

  op: str
  implementation: str
  device: str
  ok: bool
  seconds: float
  reason: str | None = None
  fallback: str | None = None
  error: float | None = None

  def line(self) -> str:
    if self.ok:
      return (
        f"preflight: {self.op} ({self.implementation}) on {self.device}: ok "
        f"(max relative error {self.error:.1e}, {self.seconds:.1f} s)"
      )
    return (
      f"preflight: {self.op} ({self.implementation}) on {self.device} failed: "
      f"{self.reason}; {self.op} runs on the {self.fallback} path from here on."
    )

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def _rel(x, y) -> float:
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if not np.all(np.isfinite(x)):
    return float("inf")
  return float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30))


def _run(spec: OpSpec, impl: str, arrays):
  """The value and (training ops) the gradients of every float input, under one jit."""

  def call(*a):
    if spec.decode:
      return attention.run_decode_op(spec, a, implementation=impl)
    return attention.run_op(spec, a, implementation=impl)

  if spec.decode:
    return (jax.jit(call)(*arrays),)

  def loss_and_grads(*a):
    out, vjp = jax.vjp(call, *a)
    return (out, *vjp(jnp.ones_like(out)))

  return jax.jit(loss_and_grads)(*arrays)


def check_op(
  op: OpSpec | str, *, dtype, head_dim: int, group: int = 1, implementation: str = "auto"
) -> Check | None:
  """Runs the fused kernel ``op`` resolves to against XLA; None when none is chosen."""
  spec = op if isinstance(op, OpSpec) else dispatch.OPS[op]
  dtype = jnp.dtype(dtype)
  arrays = spec.example(dtype, head_dim, group, _SEQ)
  try:
    impl = dispatch.choose(spec, implementation, arrays)
    if impl not in FUSED:  # a call that is not differentiated may still take a fused kernel
      impl = dispatch.choose(spec, implementation, arrays, pass_="forward")
  except ValueError:
    return None  # the run itself reports a choice that cannot run here
  if impl not in FUSED:
    return None
  device = jax.devices()[0]
  where = f"{device.platform}:{device.device_kind}"
  t0 = time.perf_counter()
  reason, err = None, None
  try:
    got = _run(spec, impl, arrays)
    want = _run(spec, "xla", arrays)
    errs = [_rel(g, w) for g, w in zip(got, want)]
    err = max(errs)
    tol = TOLERANCE.get(dtype, 1e-3)
    if not err <= tol:
      worst = int(np.argmax(errs))
      name = "the output" if worst == 0 else f"gradient {worst} of {len(errs) - 1}"
      reason = (
        f"{name} differs from XLA by {err:.2e} (relative; the {dtype.name} tolerance is {tol:g})"
      )
  except Exception as e:  # noqa: BLE001  (any failure switches the kernel off)
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    reason = f"{type(e).__name__}: {first[:200]}"
  seconds = time.perf_counter() - t0
  if reason is None:
    return Check(spec.name, impl, where, True, seconds, error=err)
  fallback = dispatch.demote(spec.name, impl, reason)
  return Check(spec.name, impl, where, False, seconds, reason=reason, fallback=fallback, error=err)


def preflight_model(
  model_cfg,
  ops: Sequence[OpSpec],
  *,
  enabled: bool = True,
  log: Callable[[str], None] | None = print,
  platforms: tuple[str, ...] | None = None,
) -> list[Check]:
  """Preflights the fused kernels that ``ops`` (the ops of ``model_cfg``'s arm, see
  :func:`diffjax.arms.preflight`) resolve to at the model's dtype and widths.

  ``model_cfg``: a :class:`diffjax.model.ModelConfig` (its ``dtype``, ``head_dim``, head
  counts, ``implementation`` and ``interpret`` decide what runs). Nothing runs when
  ``enabled`` is False, on a platform outside ``platforms`` (default :data:`PLATFORMS`),
  or in interpret mode. Prints one line per failing kernel through ``log``. A process
  checks each (op, dtype, widths) once; later calls return the first result.
  """
  if not enabled or getattr(model_cfg, "interpret", False):
    return []
  if dispatch.current_platform() not in (PLATFORMS if platforms is None else platforms):
    return []
  group = min(max(1, model_cfg.num_heads // max(model_cfg.num_kv_heads, 1)), 4)
  dtype = jnp.dtype(model_cfg.compute_dtype)
  checks = []
  for spec in ops:
    key = (
      dispatch.current_platform(),
      spec.name,
      dtype.name,
      model_cfg.head_dim,
      group,
      model_cfg.implementation,
    )
    fresh = key not in _DONE
    if fresh:
      _DONE[key] = check_op(
        spec,
        dtype=dtype,
        head_dim=model_cfg.head_dim,
        group=group,
        implementation=model_cfg.implementation,
      )
    result = _DONE[key]
    if result is None:
      continue
    checks.append(result)
    if fresh and log is not None and not result.ok:
      log(result.line())
  return checks
