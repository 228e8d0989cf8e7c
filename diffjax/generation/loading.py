"""A model and its tokenizer for inference, from a ``train.py`` run or an HF directory.

Shared by the lm-eval model (:mod:`diffjax.eval.harness`) and the server
(:mod:`diffjax.serve`): both take ``workdir=`` or ``hf_dir=`` and refuse a tokenizer that is
not the model's own.
"""

from __future__ import annotations

import dataclasses
import os

from diffjax.data import Tokenizer, load_tokenizer
from diffjax.model import DecoderLM


@dataclasses.dataclass
class LoadedModel:
  """What :func:`load_model` returns.

  Attributes:
    model: the model, parameters on the default device.
    tokenizer_spec: the run's tokenizer ("byte", a tokenizers ``.json`` or a sentencepiece
      ``.model``); None for an HF directory without tokenizer files.
    context: the run's ``seq_len`` or the HF config's ``max_position_embeddings`` (None when
      neither says).
    source: the directory it came from.
    step: the checkpoint step of a run (None for an HF directory).
    chat_template: the HF directory's chat template (``chat_template.jinja`` or
      ``tokenizer_config.json``'s ``chat_template``), else a run's ``chat_template.jinja``;
      None when there is none.
  """

  model: DecoderLM
  tokenizer_spec: str | None
  context: int | None
  source: str
  step: int | None = None
  chat_template: str | None = None


def load_model(
  workdir: str | None = None, hf_dir: str | None = None, step: int | None = None
) -> LoadedModel:
  """Loads a ``train.py`` run (its newest good checkpoint, or ``step``) or an HF
  Llama/DiffLlama/DIFF V2 directory; exactly one of ``workdir`` and ``hf_dir``."""
  if (workdir is None) == (hf_dir is None):
    raise ValueError("give exactly one of workdir= and hf_dir=.")
  if workdir is not None:
    from diffjax.train.loading import load_run  # pylint: disable=import-outside-toplevel

    if not os.path.isdir(workdir):
      raise FileNotFoundError(
        f"workdir={workdir!r} is not a directory: give the workdir of a train.py run."
      )
    run = load_run(workdir, step)
    spec = (run.config.get("data") or {}).get("tokenizer", "byte")
    seq_len = run.config.get("seq_len")
    return LoadedModel(
      run.model,
      spec,
      int(seq_len) if seq_len else None,
      workdir,
      run.step,
      _read_template(workdir, None),
    )
  from diffjax.convert import load_hf  # pylint: disable=import-outside-toplevel
  from diffjax.convert.files import read_config  # pylint: disable=import-outside-toplevel
  from diffjax.convert.tokenizer_files import tokenizer_spec  # pylint: disable=import-outside-toplevel

  if not os.path.isdir(hf_dir):
    raise FileNotFoundError(
      f"hf_dir={hf_dir!r} is not a directory: pass a directory with "
      "config.json and safetensors weights."
    )
  model = load_hf(hf_dir)
  positions = read_config(hf_dir).get("max_position_embeddings")
  return LoadedModel(
    model,
    tokenizer_spec(hf_dir),
    int(positions) if positions else None,
    hf_dir,
    None,
    _read_template(hf_dir, "tokenizer_config.json"),
  )


def _read_template(directory: str, tokenizer_config: str | None) -> str | None:
  import json  # pylint: disable=import-outside-toplevel

  path = os.path.join(directory, "chat_template.jinja")
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      return f.read()
  if tokenizer_config:
    path = os.path.join(directory, tokenizer_config)
    if os.path.isfile(path):
      try:
        with open(path, encoding="utf-8") as f:
          template = json.load(f).get("chat_template")
      except (OSError, ValueError, AttributeError):
        return None
      return template if isinstance(template, str) and template else None
  return None


def model_tokenizer(
  loaded: LoadedModel | None, model: DecoderLM, tokenizer: Tokenizer | str | None
) -> Tokenizer:
  """The tokenizer to use with ``model``: ``tokenizer`` when given (with a run, it must be the
  run's own), else the loaded one; a ValueError naming the fix when there is none or its ids do
  not fit the model's vocabulary."""
  own = loaded.tokenizer_spec if loaded is not None else None
  if (
    isinstance(tokenizer, str)
    and own is not None
    and loaded.step is not None
    and os.path.abspath(tokenizer) != os.path.abspath(own)
    and tokenizer != own
  ):
    raise ValueError(
      f"tokenizer={tokenizer!r} is not the one the run was trained with "
      f"({own!r}): leave it out to use the run's own."
    )
  tokenizer = tokenizer if tokenizer is not None else own
  if tokenizer is None:
    raise ValueError(
      "no tokenizer: the directory holds neither tokenizer.json nor tokenizer.model (an export "
      "by `python -m diffjax.convert export` carries the run's); pass --tokenizer=SPEC "
      "(tokenizer= in Python): 'byte', a tokenizers .json or a sentencepiece .model."
    )
  tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
  if tok.vocab_size > model.config.vocab_size:
    raise ValueError(
      f"the tokenizer has {tok.vocab_size} ids but the model only "
      f"{model.config.vocab_size}: it is not this model's tokenizer."
    )
  return tok
