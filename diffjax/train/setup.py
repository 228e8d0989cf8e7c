"""One place that turns (model config, optimizer config, mesh) into a compiled train step.

The trainer, the ahead-of-time compiler (``diffjax.aot``) and the train-step benchmark all
build their step here, so what they run, compile or time is the same program: the same state
layout, shardings, donation and sharding constraints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from diffjax import arms
from diffjax import sharding as shd
from diffjax.cpu import cpu_compiler_options
from diffjax.model import ModelConfig
from diffjax.ops.context_parallel import zigzag_permutation
from diffjax.train.optim import decay_mask, make_optimizer
from diffjax.train.sections import OptimConfig
from diffjax.train.steps import create_model, make_eval_step, make_train_step, split_params

# The arrays of one batch (see diffjax.data): int32 tokens, segments and positions,
# and a float32 loss mask, each [batch, seq_len].
BATCH_DTYPES = {
  "inputs": jnp.int32,
  "targets": jnp.int32,
  "segment_ids": jnp.int32,
  "positions": jnp.int32,
  "loss_mask": jnp.float32,
}


def compiler_options_for(mesh: Mesh) -> dict[str, Any] | None:
  """XLA compiler options for a step that runs on ``mesh`` (CPU meshes only)."""
  if mesh.devices.flat[0].platform != "cpu":
    return None
  return cpu_compiler_options() or None


@dataclasses.dataclass(frozen=True)
class TrainSetup:
  """Everything needed to initialise, restore, train and evaluate one model on a mesh.

  Attributes:
    model_config: the model being trained.
    mesh, rules: the device mesh and the logical-axis rules table.
    graphdef: the model's ``nnx.GraphDef`` (merge with ``state["params"]``).
    abstract_state: the train state ``{"params", "opt_state", "step", "rng"}`` as
      ``jax.ShapeDtypeStruct`` leaves carrying their shardings (a restore target).
    state_shardings: the ``NamedSharding`` of every state leaf.
    batch_sharding: rows over ``data`` x ``fsdp``, the sequence over ``context``.
    init_fn: ``() -> state``, a fresh state laid out with ``state_shardings``.
    train_step: jitted ``(state, batch) -> (state, metrics)``; ``state`` is donated.
    eval_step: jitted ``(params, batch, step) -> (loss_sum, token_count)``.
    tx, schedule: the optimizer and its learning-rate schedule.
  """

  model_config: ModelConfig
  mesh: Mesh
  rules: tuple
  graphdef: nnx.GraphDef
  abstract_state: Any
  state_shardings: Any
  batch_sharding: NamedSharding
  init_fn: Callable[[], Any]
  train_step: Any
  eval_step: Any
  tx: optax.GradientTransformation
  schedule: optax.Schedule

  def abstract_batch(self, batch_size: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    """A global batch of ``[batch_size, seq_len]`` arrays as sharded shape structs."""
    return {
      k: jax.ShapeDtypeStruct((batch_size, seq_len), d, sharding=self.batch_sharding)
      for k, d in BATCH_DTYPES.items()
    }


def with_mesh_rules(
  fn: Callable,
  mesh: Mesh,
  rules,
  *,
  context_strategy: str = "ring",
  context_load_balance: bool = True,
) -> Callable:
  """``fn(state_or_params, batch, *rest)`` with the activation sharding rules active while it
  runs (i.e. is traced). The rules are entered inside the function, so they apply whenever it
  is traced (the first call or ``.lower()``), not only while a context is open around ``jax.jit``.

  Under context parallelism with load balancing, every [B, T] array of the batch is first put
  in zig-zag order (:func:`diffjax.ops.context_parallel.zigzag_permutation`; docs/scaling.md).
  """

  def wrapped(first, batch, *rest):
    with shd.activation_sharding(
      mesh, rules, context_strategy=context_strategy, context_load_balance=context_load_balance
    ):
      cp = shd.context_parallel()
      if cp is not None:
        t = next(iter(batch.values())).shape[1]
        problem = _seq_len_problem(t, cp.size, cp.load_balance)
        if problem:
          raise ValueError(f"seq_len={t} with a context axis of {cp.size}: {problem}")
      if cp is not None and cp.load_balance:
        bad = {k: tuple(v.shape) for k, v in batch.items() if v.ndim != 2 or v.shape[1] != t}
        if bad:
          raise ValueError(
            f"Under context parallelism every batch array is [batch, {t}] "
            f"(it is put in the load-balanced order); got {bad}."
          )
        perm = zigzag_permutation(t, cp.size)
        batch = {k: jnp.take(v, perm, axis=1) for k, v in batch.items()}
      return fn(first, batch, *rest)

  return wrapped


def _seq_len_problem(seq_len: int, context: int, load_balance: bool) -> str | None:
  """Why a sequence of ``seq_len`` tokens cannot be split over a context axis of ``context``
  devices (with the load-balanced order: two chunks each), with the fix; None if it can."""
  chunk = 2 * context if load_balance else context
  if context <= 1 or (seq_len > 0 and seq_len % chunk == 0):
    return None
  if not load_balance:
    return (
      f"the sequence splits into {context} equal parts, so seq_len must be a multiple of "
      f"{context}; use one, or change mesh.shape."
    )
  return (
    f"the load-balanced order (mesh.context_load_balance=True) splits the sequence into "
    f"2 * {context} = {chunk} equal chunks, so seq_len must be a multiple of {chunk}; use one, "
    + (
      f"set mesh.context_load_balance=False (then a multiple of {context} will do), "
      if seq_len % context == 0
      else ""
    )
    + "or change mesh.shape."
  )


def check_seq_len(seq_len: int, mesh: Mesh, rules, context_load_balance: bool = True) -> None:
  """Refuses (one line, naming the config keys) a ``seq_len`` that the mesh axis the rules
  shard the sequence over (``context``) does not split: into its size C, or into 2C chunks
  with ``context_load_balance``. Read from the mesh itself, so a ``mesh.shape`` whose context
  entry is -1 is checked against the size it resolved to."""
  entry = shd.spec_for_mesh(shd.logical_to_spec(("batch", "length"), rules), mesh)[1]
  context = shd.shards_of(entry, mesh)
  problem = _seq_len_problem(seq_len, context, context_load_balance)
  if problem:
    raise ValueError(f"seq_len={seq_len} with a context axis of {context}: {problem}")


def _check_batch(
  model_cfg: ModelConfig,
  mesh: Mesh,
  rules,
  global_batch_size: int | None,
  grad_accum_steps: int,
  params: Any = None,
) -> None:
  """Refuses a mesh that does not divide the model (its parameters, when given, by the rules)
  or the batch, and a batch that does not split into ``grad_accum_steps`` micro-batches over
  the mesh axes the rules put the batch on."""
  shd.validate_mesh_for_model(
    mesh,
    model_cfg,
    global_batch_size,
    heads=arms.get(model_cfg.attention).heads,
    rules=rules,
    params=params,
  )
  if grad_accum_steps < 1:
    raise ValueError(f"grad_accum_steps={grad_accum_steps} must be >= 1.")
  if global_batch_size is not None and global_batch_size % grad_accum_steps:
    raise ValueError(
      f"global_batch_size={global_batch_size} must be divisible by "
      f"grad_accum_steps={grad_accum_steps}."
    )
  rows = shd.batch_rows_multiple(mesh, rules)
  axes = shd.mesh_axes_of(shd.spec_for_mesh(shd.logical_to_spec(("batch",), rules), mesh)[0])
  if global_batch_size is not None and (global_batch_size // grad_accum_steps) % rows:
    raise ValueError(
      f"a micro-batch of global_batch_size={global_batch_size} / grad_accum_steps="
      f"{grad_accum_steps} = {global_batch_size // grad_accum_steps} rows does not split over "
      f"{'*'.join(axes)}={rows} devices: use fewer accumulation steps or a larger batch."
    )


def build_train_setup(
  model_cfg: ModelConfig,
  optim_cfg: OptimConfig,
  *,
  seed: int,
  mesh: Mesh,
  rules,
  grad_accum_steps: int = 1,
  grad_accum_reduce: str = "micro_batch",
  global_batch_size: int | None = None,
  seq_len: int | None = None,
  context_strategy: str = "ring",
  context_load_balance: bool = True,
) -> TrainSetup:
  """Builds the state layout and the jitted steps of ``model_cfg`` on ``mesh``.

  Args:
    model_cfg: the model.
    optim_cfg: the run's ``optim`` section (see ``make_optimizer``).
    seed: initialisation seed (also the state's RNG key).
    mesh: a mesh with axes ``data``, ``fsdp``, ``tensor``, ``context``
      (``diffjax.sharding.make_mesh``).
    rules: the logical-axis rules table (``diffjax.sharding.rules_from_config``).
    grad_accum_steps: micro-batches per step; must divide ``global_batch_size``.
    grad_accum_reduce: "micro_batch" or "step": when the gradients are summed over the data
      axis (see :func:`diffjax.train.steps.make_train_step`).
    global_batch_size: when given, checked against the mesh and ``grad_accum_steps``.
    seq_len: when given, checked against the mesh's context axis (:func:`check_seq_len`).
    context_strategy, context_load_balance: attention when the mesh's ``context`` axis
      is larger than 1 (see :func:`with_mesh_rules`).

  Returns:
    A :class:`TrainSetup`. Nothing is allocated or compiled until ``init_fn`` or a
    step is called (or lowered).

  Raises:
    ValueError: a mesh that does not divide the model (any parameter, by ``rules``), the
      batch or the sequence, a batch that does not split into ``grad_accum_steps``
      micro-batches, or a bad optimizer setting.
  """
  rules = tuple(rules)
  # The model's structure and parameter layout, without allocating parameters.
  with nnx.use_eager_sharding(False):
    abstract_model = nnx.eval_shape(lambda: create_model(model_cfg, seed))
  graphdef, abstract_param_state = nnx.split(abstract_model)
  _check_batch(model_cfg, mesh, rules, global_batch_size, grad_accum_steps, abstract_param_state)
  if seq_len is not None:
    check_seq_len(seq_len, mesh, rules, context_load_balance)
  shd.check_mesh_slices(mesh, rules)
  tx, schedule = make_optimizer(optim_cfg, decay_mask(abstract_param_state))
  param_shards = shd.param_shardings(abstract_param_state, mesh, rules)

  def init():
    _, params = split_params(create_model(model_cfg, seed))
    return {
      "params": params,
      "opt_state": tx.init(params),
      "step": jnp.zeros((), jnp.int32),
      "rng": jax.random.key_data(jax.random.key(seed)),
    }

  shapes = jax.eval_shape(init)
  state_shards = shd.state_shardings(tx, shapes, param_shards, mesh)
  abstract_state = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, state_shards
  )
  batch_shard = shd.batch_sharding(mesh, rules)
  rule_kw = dict(context_strategy=context_strategy, context_load_balance=context_load_balance)
  train_fn = with_mesh_rules(
    make_train_step(graphdef, tx, schedule, grad_accum_steps, grad_accum_reduce),
    mesh,
    rules,
    **rule_kw,
  )
  eval_fn = with_mesh_rules(make_eval_step(graphdef), mesh, rules, **rule_kw)
  train_step, eval_step = _jit_steps(train_fn, eval_fn, mesh, state_shards, batch_shard)
  return TrainSetup(
    model_config=model_cfg,
    mesh=mesh,
    rules=rules,
    graphdef=graphdef,
    abstract_state=abstract_state,
    state_shardings=state_shards,
    batch_sharding=batch_shard,
    init_fn=jax.jit(init, out_shardings=state_shards),
    train_step=train_step,
    eval_step=eval_step,
    tx=tx,
    schedule=schedule,
  )


def _jit_steps(
  train_fn: Callable, eval_fn: Callable, mesh: Mesh, state_shards: Any, batch_shard: NamedSharding
) -> tuple[Any, Any]:
  """The jitted train step (the state donated) and eval step, laid out for ``mesh``."""
  options = compiler_options_for(mesh)
  train_step = jax.jit(
    train_fn,
    in_shardings=(state_shards, batch_shard),
    out_shardings=(state_shards, None),
    donate_argnums=(0,),
    compiler_options=options,
  )
  eval_step = jax.jit(
    eval_fn, in_shardings=(state_shards["params"], batch_shard, None), compiler_options=options
  )
  return train_step, eval_step
