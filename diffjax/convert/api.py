"""Import and export of Hugging Face checkpoints: models in memory (`load_hf`, `save_hf`) and
``train.py`` workdirs (`hf_to_workdir`, `workdir_to_hf`).

Every check runs before anything is written, so bad input raises :class:`ConversionError`
(a ``ValueError``) and leaves no files behind.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from diffjax.convert import motif, tokenizer_files
from diffjax.convert.files import (
  ConversionError,
  read_config,
  read_tensors,
  write_checkpoint,
  write_json_file,
)
from diffjax.convert.hf_config import (
  DEFAULT_MAX_POSITIONS,
  REMOTE_CODE,
  hf_config_from_model,
  model_config_from_hf,
)
from diffjax.convert.weights import hf_from_params, params_from_hf
from diffjax.data import Tokenizer, load_tokenizer
from diffjax.model import DecoderLM, ModelConfig, layout
from diffjax.train import checkpoint as ckpt
from diffjax.train.loading import LoadedRun, load_run
from diffjax.train.records import write_json

# The transformers code an export of an arm without a transformers class carries.
_HF_CODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_code")
_EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# Keys of the source config.json kept with an imported workdir, so that exporting it again
# restores them (diffjax itself has no use for them).
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
_KEPT_HF_KEYS = (*_TOKEN_ID_KEYS, "max_position_embeddings")
# An imported checkpoint's tokenizer files, copied into an export of its workdir.
_HF_TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer.model",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "generation_config.json",
)


def read_hf(path: str, **runtime: Any) -> tuple[ModelConfig, dict, dict]:
  """``(model_config, params, hf_config)`` of a checkpoint directory; params as numpy."""
  hf_config = read_config(path)
  if motif.is_motif(hf_config):
    cfg = motif.model_config_from_hf(hf_config, **runtime)
    return cfg, motif.params_from_hf(cfg, read_tensors(path)), hf_config
  cfg = model_config_from_hf(hf_config, **runtime)
  params = params_from_hf(cfg, read_tensors(path))
  return cfg, params, hf_config


def build_model(cfg: ModelConfig, params: Mapping[str, Any]) -> DecoderLM:
  """A :class:`DecoderLM` holding ``params`` (cast to the config's parameter dtypes).

  The model is built abstractly (no random init), and every array is checked against the
  shape the config implies.
  """
  with nnx.use_eager_sharding(False):
    abstract = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  target = nnx.to_pure_dict(abstract_state)

  def place(path, want):
    name = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
    got = _lookup(params, path)
    if got is None or tuple(np.shape(got)) != tuple(want.shape):
      raise ConversionError(
        f"Parameter {name!r} has shape "
        f"{None if got is None else list(np.shape(got))}, but the model "
        f"config implies {list(want.shape)}."
      )
    return jnp.asarray(got, dtype=want.dtype)

  values = jax.tree_util.tree_map_with_path(place, target)
  state = nnx.State(abstract_state)
  nnx.replace_by_pure_dict(state, values)
  return nnx.merge(graphdef, state)


def _lookup(tree: Mapping[str, Any], path) -> Any:
  node: Any = tree
  for p in path:
    key = getattr(p, "key", getattr(p, "idx", None))
    if not isinstance(node, Mapping) or key not in node:
      return None
    node = node[key]
  return node


def load_hf(path: str, **runtime: Any) -> DecoderLM:
  """Imports a local ``LlamaForCausalLM`` / ``DiffLlamaForCausalLM`` / ``MotifForCausalLM``
  checkpoint directory.

  Args:
    path: a directory with ``config.json`` and ``model.safetensors`` or sharded
      ``*.safetensors`` with ``model.safetensors.index.json``.
    **runtime: settings that leave the parameters unchanged: ``dtype`` (compute),
      ``param_dtype``, ``implementation``, ``block_sizes``, ``interpret``, ``remat``.

  Returns:
    A :class:`DecoderLM` (``attention="transformer"`` for Llama, ``"diff_v1"`` for
    DiffLlama, ``"gda_v1"`` with a PolyNorm MLP for Motif-2, ``rope_style="half"``) whose
    float32 logits equal the source's.
  """
  cfg, params, _ = read_hf(path, **runtime)
  return build_model(cfg, params)


def model_params(model: DecoderLM) -> dict:
  """The model's parameters as a pure dict of numpy arrays (per-layer ``blocks`` also for a
  scanned model)."""
  params = nnx.to_pure_dict(nnx.state(model))
  params = layout.convert_layout(params, "blocks", model.config.num_layers)
  return jax.tree.map(np.asarray, params)


def save_hf(
  model: DecoderLM,
  path: str,
  *,
  dtype: str = "float32",
  max_shard_size: int | str = "5GB",
  bos_token_id: int | None = None,
  eos_token_id: int | None = None,
  pad_token_id: int | None = None,
  max_position_embeddings: int = DEFAULT_MAX_POSITIONS,
  tokenizer: Tokenizer | None = None,
  copy_files: Sequence[str] = (),
  remote_code: bool = False,
  generation_config: Mapping[str, Any] | None = None,
) -> list[str]:
  """Exports a Transformer or DIFF V1 :class:`DecoderLM` as a transformers checkpoint (Llama,
  DiffLlama), a DIFF V2 one as a checkpoint with its own modeling code (loaded with
  ``trust_remote_code=True``), or a model with a PolyNorm MLP (``gda_v1``, imported from
  Motif-2) as a Motif checkpoint. With ``remote_code`` the Transformer and DIFF V1 are written
  with the project's own code too (``DiffjaxTransformerForCausalLM``, ``DiffjaxV1ForCausalLM``:
  the same tensors, the attention through transformers' attention-function registry).

  Writes ``config.json`` and ``model.safetensors`` (or shards of at most
  ``max_shard_size`` with ``model.safetensors.index.json``) into ``path``, which must not
  exist or be empty. With ``tokenizer`` (the one the model was trained with) the directory
  also gets that tokenizer in transformers' form (:mod:`diffjax.convert.tokenizer_files`),
  its special-token ids in config.json (given ids win) and a ``generation_config.json``;
  ``copy_files`` are copied in as they are (an imported checkpoint's tokenizer files), and
  ``generation_config`` is written as ``generation_config.json`` in place of the one made from
  the ids (an imported checkpoint's, with the ids given). ``max_position_embeddings`` should be
  the context the model was trained at: evaluators take it as the longest input; a context below
  1 or an id outside the vocabulary is refused. Returns the file names written.
  """
  if dtype not in _EXPORT_DTYPES:
    raise ConversionError(f"dtype={dtype!r} is not one of {sorted(_EXPORT_DTYPES)}.")
  cfg = model.config
  if getattr(model, "v2_mix_at", None) is not None:
    raise ConversionError(
      f"the model is inside its retrofit ramp (lambda scaled by {model.v2_mix_at:g} until step "
      f"{cfg.v2_mix_steps}), which no exported model computes: export a step from "
      f"{cfg.v2_mix_steps} on."
    )
  ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
  if tokenizer is not None:
    if tokenizer.vocab_size > cfg.vocab_size:
      raise ConversionError(
        f"the tokenizer {tokenizer!r} has {tokenizer.vocab_size} ids but the model only "
        f"{cfg.vocab_size}: pass the tokenizer the model was trained with."
      )
    ids = {
      **tokenizer_files.token_ids(tokenizer),
      **{k: v for k, v in ids.items() if v is not None},
    }
  settings = dict(dtype=dtype, max_position_embeddings=max_position_embeddings, **ids)
  if motif.is_motif_model(cfg):
    if remote_code:
      raise ConversionError(
        "remote_code=True: a Motif model is exported as MotifForCausalLM, whose code is "
        "Motif's; export it without remote_code."
      )
    hf_config = motif.hf_config_from_model(cfg, **settings)
    tensors = motif.hf_from_params(cfg, model_params(model), _EXPORT_DTYPES[dtype])
  else:
    hf_config = hf_config_from_model(cfg, **settings, remote_code=remote_code)
    tensors = hf_from_params(cfg, model_params(model), _EXPORT_DTYPES[dtype])

  if generation_config is None and ids["eos_token_id"] is not None:
    generation_config = tokenizer_files.generation_config(ids)

  def extra(directory: str) -> list[str]:
    return _write_extra_files(
      directory,
      hf_config["architectures"][0],
      copy_files,
      tokenizer,
      max_position_embeddings,
      generation_config,
    )

  return write_checkpoint(path, hf_config, tensors, max_shard_size=max_shard_size, extra=extra)


def _write_extra_files(
  directory: str,
  arch: str,
  copy_files: Sequence[str],
  tokenizer: Tokenizer | None,
  max_position_embeddings: int,
  generation_config: Mapping[str, Any] | None,
) -> list[str]:
  """Writes the files of an export beside its config and tensors: the model's code (for
  ``trust_remote_code``), ``copy_files``, the tokenizer's files and ``generation_config.json``
  (unless ``copy_files`` holds one); returns their names."""
  names = []
  for name in REMOTE_CODE.get(arch, ((), {}))[0]:
    shutil.copyfile(os.path.join(_HF_CODE, name), os.path.join(directory, name))
    names.append(name)
  for source in copy_files:
    shutil.copyfile(source, os.path.join(directory, os.path.basename(source)))
    names.append(os.path.basename(source))
  if tokenizer is not None:
    names += tokenizer_files.write_tokenizer_files(
      directory, tokenizer, model_max_length=max_position_embeddings
    )
  if generation_config is not None and tokenizer_files.GENERATION_CONFIG not in names:
    write_json_file(
      os.path.join(directory, tokenizer_files.GENERATION_CONFIG), dict(generation_config)
    )
    names.append(tokenizer_files.GENERATION_CONFIG)
  return names


def hf_to_workdir(path: str, workdir: str) -> ModelConfig:
  """Imports a checkpoint directory into a new diffjax workdir (step 0).

  The workdir gets ``model_config.json`` and ``checkpoints/0`` (parameters and the model
  config, as ``train.py`` writes them), so ``diffjax.train.load_model(workdir)`` loads it.
  ``workdir`` must not hold checkpoints already. Returns the model config.
  """
  check_new_workdir(workdir)
  cfg, params, hf_config = read_hf(path)
  model = build_model(cfg, params)  # checks every shape against the config
  del params  # the model holds its own copy; a large checkpoint needs the memory back
  write_workdir(
    workdir,
    model,
    {
      "hf_config": {k: hf_config[k] for k in _KEPT_HF_KEYS if k in hf_config},
      "source": os.path.abspath(path),
    },
  )
  return cfg


def check_new_workdir(workdir: str) -> None:
  """Refuses a ``workdir`` that holds checkpoints already or is not a directory."""
  checkpoints = os.path.join(workdir, "checkpoints")
  if os.path.exists(checkpoints) and os.listdir(checkpoints):
    raise ConversionError(f"{workdir!r} already holds checkpoints: choose a new --workdir.")
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConversionError(f"{workdir!r} exists and is not a directory.")


def write_workdir(workdir: str, model: DecoderLM, meta: Mapping[str, Any]) -> None:
  """Writes ``model`` as step 0 of a new workdir: ``model_config.json`` and ``checkpoints/0``
  (the parameters and ``meta`` with the model config, as ``train.py`` writes them), so
  :func:`diffjax.train.load_model` and ``checkpoint.init_from`` read it."""
  check_new_workdir(workdir)
  cfg = model.config
  # The train state's layout, of which load_model reads only "params".
  state = {"params": nnx.to_pure_dict(nnx.state(model))}
  manager = ckpt.make_manager(os.path.join(workdir, "checkpoints"), keep=1, async_save=False)
  ckpt.save(manager, 0, state, None, {"model_config": cfg.to_dict(), **meta}, force=True)
  manager.wait_until_finished()
  manager.close()
  write_json(os.path.join(workdir, "model_config.json"), cfg.to_dict())


def export_defaults(run: LoadedRun) -> dict[str, Any]:
  """What an export of ``run`` carries unless told otherwise: ``hf_config`` (special-token ids and
  ``max_position_embeddings``), ``tokenizer`` (a spec for :func:`~diffjax.data.load_tokenizer`,
  or None) and ``tokenizer_dir`` (an HF directory whose tokenizer files are copied where there is
  no spec).

  A ``train.py`` run gives its tokenizer and ``seq_len``; a workdir imported from an HF directory
  the values kept from it and that directory; a retrofitted one what its source gave, recorded
  by the retrofit (``meta["export"]``), so it needs the source no more.
  """
  meta = run.meta
  if isinstance(meta.get("export"), Mapping):
    return dict(meta["export"])
  kept = dict(meta.get("hf_config") or {})
  if run.config.get("seq_len"):
    kept["max_position_embeddings"] = int(run.config["seq_len"])
  spec = (run.config.get("data") or {}).get("tokenizer", "byte") if run.config else None
  if spec not in (None, "byte") and os.path.isfile(spec):
    spec = os.path.abspath(spec)  # as the run found it, from wherever the export runs
  return {
    "hf_config": kept,
    "tokenizer": spec,
    "tokenizer_dir": meta.get("source") if spec is None else None,
  }


def hf_dir_export_defaults(path: str, hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """:func:`export_defaults` of a model read from the HF directory ``path`` (its kept keys and
  its tokenizer files)."""
  return {
    "hf_config": {k: hf_config[k] for k in _KEPT_HF_KEYS if k in hf_config},
    "tokenizer": None,
    "tokenizer_dir": os.path.abspath(path),
  }


def _tokenizer_dir_files(
  directory: str, export: Mapping[str, Any]
) -> tuple[list[str], dict[str, Any] | None]:
  """(tokenizer files of ``directory`` to copy, its generation config with the token ids given
  in ``export`` or None where none are given): generate reads that file, so an id given for
  config.json must be in it too."""
  files = [
    os.path.join(directory, name)
    for name in _HF_TOKENIZER_FILES
    if os.path.isfile(os.path.join(directory, name))
  ]
  given = {k: export[k] for k in _TOKEN_ID_KEYS if export.get(k) is not None}
  path = os.path.join(directory, tokenizer_files.GENERATION_CONFIG)
  if not given or path not in files:
    return files, None
  try:
    with open(path, encoding="utf-8") as f:
      generation = json.load(f)
  except (OSError, ValueError) as e:
    raise ConversionError(f"{path!r} cannot be read as JSON ({e}).") from e
  if not isinstance(generation, dict):
    raise ConversionError(f"{path!r} holds a {type(generation).__name__}, not a JSON object.")
  files.remove(path)
  return files, {**generation, **given}


def workdir_to_hf(
  workdir: str, path: str, *, step: int | None = None, tokenizer: str | None = None, **export: Any
) -> list[str]:
  """Exports the checkpoint of a diffjax workdir (latest step by default) with :func:`save_hf`.

  The export carries what an evaluator needs (:func:`export_defaults`): the run's tokenizer
  (``tokenizer``: a spec for :func:`~diffjax.data.load_tokenizer`, ``"none"`` for no tokenizer
  files, default the run's own; a workdir imported from an HF directory gets that directory's
  tokenizer files when it still has them), its special-token ids, and
  ``max_position_embeddings`` = the context the run trained at (``seq_len``). ``export``
  overrides the ids and the context and sets ``dtype`` and ``max_shard_size``; an imported
  workdir defaults to the values kept from its source, and ids given replace those of its
  copied ``generation_config.json`` too.
  """
  run = load_run(workdir, step)
  defaults = export_defaults(run)
  spec = tokenizer if tokenizer is not None else defaults.get("tokenizer")
  copy_files: list[str] = []
  generation = None
  if spec is None and defaults.get("tokenizer_dir"):
    copy_files, generation = _tokenizer_dir_files(defaults["tokenizer_dir"], export)
  loaded = None
  if spec is not None and spec != "none":
    if spec != "byte" and not os.path.isfile(spec):
      raise ConversionError(
        f"the tokenizer {spec!r} is not found from {os.getcwd()!r}: pass --tokenizer=PATH (or "
        "--tokenizer=none to export without tokenizer files)."
      )
    loaded = load_tokenizer(spec)
  return save_hf(
    run.model,
    path,
    **{**(defaults.get("hf_config") or {}), **export},
    tokenizer=loaded,
    copy_files=copy_files,
    generation_config=generation,
  )
