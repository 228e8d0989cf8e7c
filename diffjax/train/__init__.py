"""Training: optimizer, train/eval steps, checkpoints, metrics and the loop."""

from diffjax.train.checkpoint import CheckpointError
from diffjax.train.loading import load_model
from diffjax.train.optim import learning_rate_schedule, make_optimizer
from diffjax.train.steps import init_state, loss_sums, make_eval_step, make_train_step
from diffjax.train.trainer import TrainingError, train_and_evaluate

__all__ = [
    "CheckpointError", "load_model", "TrainingError", "learning_rate_schedule", "make_optimizer", "init_state",
    "loss_sums", "make_eval_step", "make_train_step", "train_and_evaluate",
]
