"""Hugging Face checkpoints in and out: ``LlamaForCausalLM`` <-> the Transformer arm and
``DiffLlamaForCausalLM`` <-> DIFF V1, read and written with safetensors' numpy API (no torch).

    python -m diffjax.convert import --hf=HF_DIR --workdir=RUN
    python -m diffjax.convert export --workdir=RUN --hf=OUT_DIR
"""

from diffjax.convert.api import (
  build_model,
  hf_to_workdir,
  load_hf,
  model_params,
  read_hf,
  save_hf,
  workdir_to_hf,
)
from diffjax.convert.files import ConversionError
from diffjax.convert.hf_config import hf_config_from_model, model_config_from_hf
from diffjax.convert.retrofit import retrofit, retrofit_config, retrofit_params
from diffjax.convert.weights import expected_shapes, hf_from_params, params_from_hf

__all__ = [
  "ConversionError",
  "build_model",
  "expected_shapes",
  "hf_config_from_model",
  "hf_from_params",
  "hf_to_workdir",
  "load_hf",
  "model_config_from_hf",
  "model_params",
  "params_from_hf",
  "read_hf",
  "retrofit",
  "retrofit_config",
  "retrofit_params",
  "save_hf",
  "workdir_to_hf",
]
