"""Loss, train and eval steps as pure functions of (state, batch).

The train state is a plain dict ``{"params", "opt_state", "step", "rng"}`` whose
params are the model's ``nnx.Param`` state as a nested dict, so jit, sharding and
Orbax all see an ordinary pytree.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from diffjax import sharding as shd
from diffjax.model import DecoderLM, ModelConfig

Batch = dict[str, jax.Array]

# When accumulated gradients are summed over the data axis (make_train_step).
GRAD_ACCUM_REDUCE = ("micro_batch", "step")


def check_grad_accum_reduce(value: str) -> None:
  """Raises ValueError naming ``value`` unless it is one of :data:`GRAD_ACCUM_REDUCE`."""
  if value not in GRAD_ACCUM_REDUCE:
    raise ValueError(
      f"grad_accum_reduce={value!r} is not one of {GRAD_ACCUM_REDUCE}: 'micro_batch' reduces "
      "each micro-batch's gradients over the data axis, 'step' once per step."
    )


def create_model(cfg: ModelConfig, seed: int) -> DecoderLM:
  return DecoderLM(cfg, rngs=nnx.Rngs(params=seed))


def split_params(model: DecoderLM) -> tuple[nnx.GraphDef, dict]:
  graphdef, state = nnx.split(model)
  return graphdef, nnx.to_pure_dict(state)


def merge_params(graphdef: nnx.GraphDef, params: dict) -> DecoderLM:
  return nnx.merge(graphdef, params)


def init_state(cfg: ModelConfig, tx: optax.GradientTransformation, seed: int):
  """Returns (graphdef, state) for a fresh run."""
  model = create_model(cfg, seed)
  graphdef, params = split_params(model)
  state = {
    "params": params,
    "opt_state": tx.init(params),
    "step": jnp.zeros((), jnp.int32),
    "rng": jax.random.key_data(jax.random.key(seed)),
  }
  return graphdef, state


def token_cross_entropy(logits_BxTxV: jax.Array, labels_BxT: jax.Array) -> jax.Array:
  """``-log softmax(logits)[label]`` per token: optax's
  ``softmax_cross_entropy_with_integer_labels`` (the same values and gradients), with each
  label's logit picked by a masked sum over the vocabulary instead of a gather.

  The gradient of a gather (a scatter) along a vocabulary split over the tensor axis, with
  the labels split over the context axis, inside the ``shard_map`` over ``data`` of
  ``grad_accum_reduce="step"``, aborts XLA's SPMD partitioner (data, tensor and context all
  > 1); the masked sum is an elementwise select and a reduction, which partition like the
  log-sum-exp beside it. Labels must lie in ``[0, V)``.
  """
  vocab_BxTxV = jax.lax.broadcasted_iota(labels_BxT.dtype, logits_BxTxV.shape, 2)
  hit_BxTxV = vocab_BxTxV == labels_BxT[..., None]
  label_logits_BxT = jnp.sum(jnp.where(hit_BxTxV, logits_BxTxV, 0), axis=-1)
  return jax.nn.logsumexp(logits_BxTxV, axis=-1) - label_logits_BxT


def loss_sums(graphdef, params, batch: Batch, step=None) -> tuple[jax.Array, jax.Array]:
  """Sum of masked token cross-entropies (nats) and the number of counted tokens.

  ``step`` sets a retrofitted DIFF V2's ramp (``ModelConfig.v2_mix_steps``); without one, or
  without a step, the model runs as it is."""
  model = merge_params(graphdef, params)
  mix = model.config.v2_mix(step) if step is not None else None
  logits_BxTxV = model(
    batch["inputs"],
    batch["positions"],
    batch["segment_ids"],
    **({} if mix is None else {"v2_mix": mix}),
  )
  ce_BxT = token_cross_entropy(logits_BxTxV, batch["targets"])
  mask_BxT = batch["loss_mask"].astype(jnp.float32)
  return jnp.sum(ce_BxT * mask_BxT), jnp.sum(mask_BxT)


def _split_micro(batch: Batch, accum: int) -> Batch:
  def f(x):
    if x.shape[0] % accum:
      raise ValueError(
        f"Batch of {x.shape[0]} rows does not split into grad_accum_steps={accum} micro-batches."
      )
    # Micro-batch i takes rows i, i + accum, i + 2 accum, ...: when a device's block of rows
    # is a multiple of accum, it holds its share of every micro-batch, so no rows move between
    # devices (or slices).
    return jnp.swapaxes(x.reshape(x.shape[0] // accum, accum, *x.shape[1:]), 0, 1)

  return jax.tree.map(f, batch)


def _all_finite(tree: Any) -> jax.Array:
  """Whether every floating-point value in ``tree`` is finite (a scalar bool)."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
  if not leaves:
    return jnp.bool_(True)
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _accumulate(grad_fn, params, micro: Batch, step):
  """(gradient sums, loss sum, token count) over the micro-batches, one after another."""

  def body(carry, mb):
    g_acc, l_acc, c_acc = carry
    (l, c), g = grad_fn(params, mb, step)
    return (jax.tree.map(jnp.add, g_acc, g), l_acc + l, c_acc + c), None

  zeros = jax.tree.map(jnp.zeros_like, params)
  (grads, loss_sum, count), _ = jax.lax.scan(body, (zeros, jnp.float32(0), jnp.float32(0)), micro)
  return grads, loss_sum, count


def _accumulate_per_data_shard(grad_fn, params, micro: Batch, step, inner_rules):
  """:func:`_accumulate` on each data shard over its own rows (the mesh's other axes split
  it as before), the shards' sums added once at the end: one reduction over the data axis per
  step (across slices: one DCN all-reduce) instead of one per micro-batch."""
  spec = jax.sharding.PartitionSpec

  def local(params, micro, step):
    with shd.rules_replaced(inner_rules, jax.sharding.get_abstract_mesh()):
      sums = _accumulate(grad_fn, params, micro, step)
    return jax.lax.psum(sums, "data")

  return jax.shard_map(
    local,
    mesh=shd.current()[0],
    in_specs=(spec(), spec(None, "data"), spec()),
    out_specs=spec(),
    axis_names={"data"},
    check_vma=False,  # the sums start equal on every shard and come to differ
  )(params, micro, step)


# The layouts a "step" reduction already fell back for, said once each per process.
_NOTED: set[str] = set()


def step_reduce_fallback(mesh, inner_rules) -> str | None:
  """Why ``grad_accum_reduce="step"`` cannot sum per data shard on ``mesh`` (the rules
  :func:`diffjax.sharding.data_shard_rules` gives the per-shard computation), or None.

  Inside the ``shard_map`` over ``data``, XLA's SPMD partitioner aborts the process (a failed
  check, no Python error) on the embedding lookup's gradient (a scatter-add into the table)
  when a mesh axis of size > 1 splits both the table [vocab, embed] and the tokens, and
  another mesh axis besides ``data`` has size > 1: e.g. (2, 2, 2, 1) and (2, 2, 1, 2) under
  the default rules (fsdp splits the table's embed axis and the batch's rows), where
  (2, 2, 1, 1), (2, 4, 1, 1) and (2, 1, 2, 2) compile.
  """
  size = lambda a: int(dict(mesh.shape).get(a, 1))  # noqa: E731

  def split(names):
    spec = shd.spec_for_mesh(shd.logical_to_spec(names, inner_rules), mesh)
    return {a for entry in spec for a in shd.mesh_axes_of(entry) if size(a) > 1}

  shared = split(("vocab", "embed")) & split(("batch", "length"))
  others = {a for a in mesh.axis_names if a != "data" and a not in shared and size(a) > 1}
  if not shared or not others:
    return None
  both, rest = " and ".join(sorted(shared)), " and ".join(sorted(others))
  return (
    f"{both} split{'s' if len(shared) == 1 else ''} both the embedding table and the tokens "
    f"while {rest} {'is' if len(others) == 1 else 'are'} larger than 1, a layout whose "
    "per-data-shard gradient XLA's SPMD partitioner cannot compile"
  )


def _note_once(text: str) -> None:
  if text not in _NOTED:
    _NOTED.add(text)
    print(text, file=sys.stderr, flush=True)


def make_train_step(
  graphdef,
  tx: optax.GradientTransformation,
  schedule: Callable,
  grad_accum_steps: int = 1,
  grad_accum_reduce: str = "micro_batch",
):
  """Builds ``train_step(state, batch) -> (state, metrics)``.

  Gradients are accumulated over ``grad_accum_steps`` micro-batches as one large batch; with
  ``grad_accum_reduce="step"`` and a data axis, each data shard sums its own micro-batches and
  the shards' sums are added once per step (else the compiler sums each micro-batch's; so
  does "step" on a layout :func:`step_reduce_fallback` names, said once on stderr). An
  update that is not finite is skipped and ``metrics["finite"]`` is False (docs/training.md,
  "Non-finite updates"); the update itself is checked because a finite loss and gradient can
  still give NaN parameters (e.g. a NaN learning rate).
  """
  check_grad_accum_reduce(grad_accum_reduce)
  grad_fn = jax.value_and_grad(lambda p, mb, step: loss_sums(graphdef, p, mb, step), has_aux=True)

  def train_step(state, batch: Batch):
    params = state["params"]
    if grad_accum_steps == 1:
      (loss_sum, count), grads = grad_fn(params, batch, state["step"])
    else:
      micro = _split_micro(batch, grad_accum_steps)
      inner_rules = shd.data_shard_rules() if grad_accum_reduce == "step" else None
      why = None if inner_rules is None else step_reduce_fallback(shd.current()[0], inner_rules)
      if why is not None:
        _note_once(
          f"note: grad_accum_reduce='step' runs as 'micro_batch' on mesh "
          f'{dict(shd.current()[0].shape)}: {why} (docs/scaling.md, "Several slices"). '
          "The gradients are the same; they are summed over data once per micro-batch."
        )
        inner_rules = None
      if inner_rules is None:
        grads, loss_sum, count = _accumulate(grad_fn, params, micro, state["step"])
      else:
        grads, loss_sum, count = _accumulate_per_data_shard(
          grad_fn, params, micro, state["step"], inner_rules
        )
    denom = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / denom, grads)
    loss = loss_sum / denom
    grad_norm = optax.tree.norm(grads)
    with jax.named_scope("optimizer"):
      updates, new_opt = tx.update(grads, state["opt_state"], params)
      new_params = optax.apply_updates(params, updates)
    finite = jnp.logical_and(jnp.isfinite(loss), jnp.isfinite(grad_norm))
    finite = jnp.logical_and(finite, _all_finite((new_params, new_opt)))
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = {
      "params": keep(new_params, params),
      "opt_state": keep(new_opt, state["opt_state"]),
      "step": state["step"] + 1,
      "rng": state["rng"],
    }
    metrics = {
      "loss": loss,
      "grad_norm": grad_norm,
      "lr": schedule(state["step"]),
      "tokens": count,
      "finite": finite,
    }
    return new_state, metrics

  return train_step


def make_eval_step(graphdef):
  """``eval_step(params, batch, step) -> (loss_sum, token_count)``; ``step`` (the training
  step the parameters are from) matters only to a retrofitted DIFF V2 during its ramp."""

  def eval_step(params, batch: Batch, step):
    return loss_sums(graphdef, params, batch, step)

  return eval_step


def lambda_summary(graphdef, params, batch: Batch) -> dict[str, jax.Array]:
  """The model's λ report (:meth:`DecoderLM.lambda_summary`) on ``batch``.

  Keys ``lambda/layer_<i>`` (DIFF V1) and ``lambda_mean/layer_<i>`` (DIFF V2).
  """
  model = merge_params(graphdef, params)
  return model.lambda_summary(batch["inputs"], batch["positions"], batch["segment_ids"])
