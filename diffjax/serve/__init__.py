"""Serving a diffjax model: continuous batching (:class:`Engine`) behind an OpenAI-compatible
HTTP server (``python -m diffjax.serve``). See docs/serving.md."""

from diffjax.serve.engine import (
  MAX_TOP_LOGPROBS,
  ContextTooLong,
  DoneEvent,
  Engine,
  EngineStopped,
  Job,
  PromptEvent,
  QueueFull,
  TokenEvent,
)
from diffjax.serve.replicas import Replicas

__all__ = [
  "MAX_TOP_LOGPROBS",
  "ContextTooLong",
  "DoneEvent",
  "Engine",
  "EngineStopped",
  "Job",
  "PromptEvent",
  "QueueFull",
  "Replicas",
  "TokenEvent",
]
