"""The lm-evaluation-harness model over a diffjax :class:`~diffjax.model.DecoderLM`.

:class:`DiffjaxLM`, an ``lm_eval`` ``TemplateLM``, scores log-likelihoods and rolling windows and
generates: docs/evaluation.md#lm-evaluation-harness-tasks, "What the model does".
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

try:
  from lm_eval import utils as lm_utils
  from lm_eval.api.model import TemplateLM
  from lm_eval.models import utils as lm_model_utils
except ImportError as e:  # pragma: no cover - the message is the point
  raise ImportError(
    "diffjax.eval.harness needs lm-eval: pip install -e '.[harness]' (it does not need torch)."
  ) from e
from tqdm import tqdm

from diffjax.data import Tokenizer
from diffjax.eval.harness.scorer import TokenScorer
from diffjax.generation import generate
from diffjax.generation.loading import load_model, model_tokenizer
from diffjax.model import DecoderLM

DEFAULT_MAX_LENGTH = 2048
DEFAULT_MAX_GEN_TOKS = 256
DEFAULT_MAX_BATCH_SIZE = 64
# Generation options this model reads, after lm-eval's own normalisation (which maps
# max_new_tokens, max_tokens and max_completion_tokens to max_gen_toks).
_GEN_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")
_MAX_TOKEN_ALIASES = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")
# Options lm-eval's hf model passes on to transformers, accepted at the value that changes
# nothing (one greedy or sampled sequence).
_GEN_NO_OPS = {"num_beams": 1, "repetition_penalty": 1.0, "num_return_sequences": 1}


def generation_options(gen_kwargs: dict[str, Any], task: str | None = None) -> dict[str, Any]:
  """A task's ``generation_kwargs`` as :meth:`DiffjaxLM.generate_texts` reads them.

  The aliases lm-eval's backends accept are mapped as lm-eval maps them; an option this model
  cannot honour is a ``ValueError`` naming the task and the option.
  """
  options = dict(lm_model_utils.normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS))
  if not any(k in gen_kwargs for k in _MAX_TOKEN_ALIASES):
    options["max_gen_toks"] = None  # the model's own default (--max_gen_toks)
  where = f"task {task!r}: " if task else ""
  for key, value in list(options.items()):
    if key in _GEN_KEYS:
      continue
    if key in _GEN_NO_OPS and value == _GEN_NO_OPS[key]:
      del options[key]
      continue
    fix = f" (only {key}={_GEN_NO_OPS[key]!r} is)" if key in _GEN_NO_OPS else ""
    raise ValueError(
      f"{where}generation option {key}={value!r} is not supported{fix}; diffjax reads "
      f"{', '.join(_GEN_KEYS)} (max_gen_toks also as {', '.join(_MAX_TOKEN_ALIASES[1:])}) and "
      f"{', '.join(f'{k}={v!r}' for k, v in _GEN_NO_OPS.items())}: drop it from the task's "
      "generation_kwargs or from --gen_kwargs."
    )
  return options


class DiffjaxLM(TemplateLM):
  """A diffjax model as an lm-eval ``TemplateLM`` (registered as ``"diffjax"``).

  Give one of ``workdir`` (a ``train.py`` run: its newest good checkpoint, or ``step``, and
  its tokenizer), ``hf_dir`` (an HF Llama/DiffLlama directory, its tokenizer files and
  ``max_position_embeddings``, as an export writes them) or
  ``model`` with ``tokenizer``.

  Args:
    tokenizer: a :class:`~diffjax.data.Tokenizer` or a spec for
      :func:`~diffjax.data.load_tokenizer` ("byte", a tokenizers ``.json`` or a
      sentencepiece ``.model``). With ``workdir`` it must be the run's own.
    max_length: the longest input scored or generated from (default: the run's ``seq_len``,
      the HF config's ``max_position_embeddings``, else 2048). Longer requests lose tokens
      from the left.
    max_gen_toks: new tokens for a generation task that does not say.
    seed: the sampling seed of sampled generation (each generation call draws with its own
      seed from it, so repeated requests in different batches are sampled independently).
    mesh, rules: evaluate sharded over a device mesh (no parameter is gathered).
    batch_size: rows per forward pass (and per generation call), or ``"auto"`` (also
      lm-eval's ``"auto:N"``): the largest power of two up to ``max_batch_size`` (default 64)
      whose forward at the full context fits the device's memory
      (:meth:`TokenScorer.fit_batch_size`), found once.
    device: accepted for the harness's command line; not used.
  """

  backend = "causal"

  def __init__(
    self,
    workdir: str | None = None,
    *,
    hf_dir: str | None = None,
    model: DecoderLM | None = None,
    tokenizer: Tokenizer | str | None = None,
    step: int | None = None,
    max_length: int | None = None,
    batch_size: int | str = 8,
    max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
    seed: int = 0,
    mesh=None,
    rules=None,
    device: Any = None,
    max_batch_size: Any = None,
  ):
    super().__init__()
    del device
    given = [
      n for n, v in (("workdir", workdir), ("hf_dir", hf_dir), ("model", model)) if v is not None
    ]
    if len(given) != 1:
      raise ValueError(f"give exactly one of workdir=, hf_dir= or model=; got {given or 'none'}.")
    loaded = None
    if model is None:
      loaded = load_model(workdir, hf_dir, step)
      model = loaded.model
    context = loaded.context if loaded is not None else None
    self.tok = model_tokenizer(loaded, model, tokenizer)
    auto, batch_size = _parse_batch_size(batch_size)
    self.model = model
    self.max_length_ = _int_arg("max_length", max_length or context or DEFAULT_MAX_LENGTH, 1)
    self.context_source = (
      "max_length="
      if max_length
      else (
        ("the run's seq_len" if workdir else "config.json's max_position_embeddings")
        if context
        else f"the default {DEFAULT_MAX_LENGTH}"
      )
    )
    self.batch_size = int(batch_size)
    self.max_gen_toks = _int_arg("max_gen_toks", max_gen_toks, 0)
    self.seed = _int_arg("seed", seed)
    self._generate_calls = 0
    self.mesh, self.rules = mesh, rules
    self.scorer = TokenScorer(
      model, max_length=self.max_length_, batch_size=self.batch_size, mesh=mesh, rules=rules
    )
    if auto:
      limit = int(max_batch_size) if max_batch_size else DEFAULT_MAX_BATCH_SIZE
      self.batch_size = self.scorer.fit_batch_size(limit)

  @classmethod
  def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
    """``--model_args`` as lm-eval's command line gives them (see :meth:`create_from_arg_obj`)."""
    return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

  @classmethod
  def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None):
    """The model of lm-eval's ``--model_args``: an unknown key is refused naming the keys taken;
    ``pretrained`` (lm-eval's usual key) is an HF directory when it holds a ``config.json``, else a
    run; a key given here wins over lm-eval's own ``--batch_size``, ``--max_batch_size`` and
    ``--device``."""
    args = dict(arg_dict)
    if "pretrained" in args:
      path = str(args.pop("pretrained"))
      key = "hf_dir" if os.path.isfile(os.path.join(path, "config.json")) else "workdir"
      args.setdefault(key, path)
    taken = sorted(
      set(inspect.signature(cls.__init__).parameters) - {"self", "model", "mesh", "rules"}
    )
    unknown = sorted(set(args) - set(taken))
    if unknown:
      raise ValueError(
        f"--model_args {unknown[0]}={args[unknown[0]]!r}: the diffjax model takes "
        f"{', '.join(['pretrained', *taken])}."
      )
    rest = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in args}
    return cls(**args, **rest)

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    if chat_template:
      raise ValueError(
        "the diffjax model has no chat template (its runs are base models): leave out "
        "--apply_chat_template."
      )
    return ""

  # -- what TemplateLM asks for ------------------------------------------------------------

  @property
  def eot_token_id(self) -> int:
    return int(self.tok.eos_id)

  @property
  def max_length(self) -> int:
    return self.max_length_

  @property
  def tokenizer_name(self) -> str:
    return repr(self.tok)

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    del add_special_tokens, kwargs  # diffjax tokenizers add no special tokens
    # A special token's name in a prompt (a chat template's markers) is that token, as with a
    # transformers tokenizer; a tokenizer without the method reads it as text.
    encode = getattr(self.tok, "encode_with_specials", self.tok.encode)
    return [int(t) for t in encode(string)]

  def tok_decode(self, tokens: Sequence[int]) -> str:
    return self.tok.decode(np.asarray(tokens, np.int32))

  def _loglikelihood_tokens(
    self, requests, disable_tqdm: bool = False, **kwargs
  ) -> list[tuple[float, bool]]:
    del kwargs
    bar = tqdm(total=len(requests), desc="diffjax loglikelihood", disable=disable_tqdm)
    out = self.scorer.score([(ctx, cont) for _, ctx, cont in requests], progress=bar.update)
    bar.close()
    for (pair, _, _), result in zip(requests, out):
      if pair is not None:
        self.cache_hook.add_partial("loglikelihood", pair, result)
    return out

  def rolling_windows(self, text: str) -> list[tuple[list[int], list[int]]]:
    """The harness's disjoint rolling windows of ``text`` (every token predicted once)."""
    windows = lm_utils.get_rolling_token_windows(
      token_list=self.tok_encode(text),
      prefix_token=self.prefix_token_id,
      max_seq_len=self.max_length,
      context_len=1,
    )
    return [lm_utils.make_disjoint_window(w) for w in windows]

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    windows, owner = [], []
    for i, req in enumerate(requests):
      for w in self.rolling_windows(req.args[0]):
        windows.append(w)
        owner.append(i)
    bar = tqdm(total=len(windows), desc="diffjax rolling windows", disable=disable_tqdm)
    scores = self.scorer.score(windows, progress=bar.update)
    bar.close()
    totals = [0.0] * len(requests)
    for i, (logp, _) in zip(owner, scores):
      totals[i] += logp
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    groups: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
      groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
    out: list[str] = [""] * len(requests)
    bar = tqdm(total=len(requests), desc="diffjax generate_until", disable=disable_tqdm)
    for members in groups.values():
      kwargs = generation_options(requests[members[0]].args[1])
      contexts = [requests[i].args[0] for i in members]
      for start in range(0, len(members), self.batch_size):
        chunk = members[start : start + self.batch_size]
        texts = self.generate_texts(contexts[start : start + self.batch_size], **kwargs)
        for i, text in zip(chunk, texts):
          out[i] = text
          self.cache_hook.add_partial("generate_until", requests[i].args, text)
        bar.update(len(chunk))
    bar.close()
    return out

  # -- generation ----------------------------------------------------------------------------

  def generate_texts(
    self,
    contexts: Sequence[str],
    *,
    until=None,
    max_gen_toks=None,
    do_sample: bool = False,
    temperature: float = 0.0,
    top_k=None,
    top_p=None,
    **unknown,
  ) -> list[str]:
    """Continuations of ``contexts`` cut before the first of ``until`` (strings), as the
    harness's ``generate_until`` defines them."""
    if unknown:
      generation_options(unknown)  # raises naming the first it cannot honour
    stops = [until] if isinstance(until, str) else list(until or [])
    new = _int_arg("max_gen_toks", self.max_gen_toks if max_gen_toks is None else max_gen_toks, 0)
    if new == 0:
      return [""] * len(contexts)
    keep = self.max_length - new
    if keep < 1:  # as lm-eval's hf model refuses it
      raise ValueError(
        f"max_gen_toks={new} leaves no room for a context in max_length={self.max_length} "
        f"({self.context_source}): lower max_gen_toks (the task's generation_kwargs, "
        "--gen_kwargs or --model_args max_gen_toks=) or raise --model_args max_length=."
      )
    prompts = [(self.tok_encode(c) or [self.prefix_token_id])[-keep:] for c in contexts]
    sampled = bool(do_sample) and float(temperature or 0.0) > 0
    seed = (self.seed + self._generate_calls) % 2**31  # each call draws anew
    self._generate_calls += 1
    result = generate(
      self.model,
      prompts,
      max_new_tokens=new,
      temperature=float(temperature) if sampled else 0.0,
      top_k=top_k if sampled else None,
      top_p=top_p if sampled else None,
      seed=seed,
      stop_tokens=[self.eot_token_id],
      mesh=self.mesh,
      rules=self.rules,
    )
    return [cut_at_stops(self.tok_decode(tokens), stops) for tokens in result.tokens]


def _int_arg(name: str, value: Any, minimum: int | None = None) -> int:
  """``value`` (an int or its digits, as ``--model_args`` gives them) as an int, else a
  ``ValueError`` naming ``name``."""
  try:
    out = int(str(value).strip()) if isinstance(value, str) else value
  except ValueError:
    out = None
  if isinstance(out, bool) or not isinstance(out, (int, np.integer)):
    raise ValueError(f"{name}={value!r} must be an integer.") from None
  if minimum is not None and out < minimum:
    raise ValueError(f"{name}={value!r} must be at least {minimum}.")
  return int(out)


def _parse_batch_size(batch_size: int | str) -> tuple[bool, int]:
  """(auto?, rows) of an int, a digit string, ``"auto"`` or lm-eval's ``"auto:N"``."""
  if isinstance(batch_size, str):
    text = batch_size.strip().lower()
    if text == "auto" or (text.startswith("auto:") and text[5:].isdigit()):
      return True, 1
    if not text.isdigit() or int(text) < 1:
      raise ValueError(
        f"batch_size={batch_size!r} must be a positive integer or 'auto' (also 'auto:N')."
      )
    return False, int(text)
  if (
    isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1
  ):
    raise ValueError(f"batch_size={batch_size!r} must be a positive integer or 'auto'.")
  return False, int(batch_size)


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
  """``text`` up to (not including) the earliest occurrence of any of ``stops``."""
  cut = len(text)
  for s in stops:
    if s:
      at = text.find(s)
      if at != -1:
        cut = min(cut, at)
  return text[:cut]


def _register() -> None:
  """Registers :class:`DiffjaxLM` as ``"diffjax"`` with the harness (once)."""
  import lm_eval.models  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  from lm_eval.api import registry  # pylint: disable=import-outside-toplevel

  if "diffjax" not in registry.model_registry.keys():
    registry.register_model("diffjax")(DiffjaxLM)


_register()
