"""Training: the typed run config, optimizer, train/eval steps, their setup on a mesh,
checkpoints, records and the trainer."""

from diffjax.train.checkpoint import CheckpointError
from diffjax.train.config import RunConfig, base_config
from diffjax.train.loading import initial_params, load_model
from diffjax.train.optim import learning_rate_schedule, make_optimizer
from diffjax.train.records import METRICS_FILE, read_metrics
from diffjax.train.setup import TrainSetup, build_train_setup, with_mesh_rules
from diffjax.train.steps import init_state, loss_sums, make_eval_step, make_train_step
from diffjax.train.trainer import TrainingError, train_and_evaluate

__all__ = [
  "CheckpointError",
  "RunConfig",
  "base_config",
  "load_model",
  "TrainingError",
  "learning_rate_schedule",
  "make_optimizer",
  "init_state",
  "loss_sums",
  "make_eval_step",
  "make_train_step",
  "train_and_evaluate",
  "TrainSetup",
  "build_train_setup",
  "METRICS_FILE",
  "read_metrics",
  "initial_params",
  "with_mesh_rules",
]
