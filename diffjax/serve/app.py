"""The OpenAI-compatible HTTP layer over an :class:`~diffjax.serve.engine.Engine` (aiohttp).

Its routes, and what each request may ask: docs/serving.md#endpoints.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import traceback
import uuid
from typing import Any

from diffjax.data import ByteTokenizer, Tokenizer
from diffjax.errors import import_extra
from diffjax.generation.text import TextStream
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

web = import_extra("aiohttp.web", "serve", "serving over HTTP (python -m diffjax.serve)")

# The most stop strings and choices a request may ask for.
MAX_STOPS = 16
MAX_CHOICES = 16
DEFAULT_EOS_TEXT = "<|endoftext|>"


class RequestError(Exception):
  """A request the server refuses: an OpenAI-style JSON error with this HTTP status."""

  def __init__(self, message: str, *, status: int = 400, param: str | None = None, code=None):
    super().__init__(message)
    self.status, self.param, self.code = status, param, code

  def response(self):
    kind = {
      404: "not_found_error",
      429: "rate_limit_error",
      500: "server_error",
      503: "service_unavailable",
    }
    body = {
      "error": {
        "message": str(self),
        "type": kind.get(self.status, "invalid_request_error"),
        "param": self.param,
        "code": self.code,
      }
    }
    headers = {"Retry-After": "1"} if self.status in (429, 503) else None
    return web.json_response(body, status=self.status, headers=headers)


# -- tokens as text -------------------------------------------------------------------------


def special_text(tok: Tokenizer, token: int) -> str | None:
  """The written form of a special token (eos, pad), else None."""
  if token not in (tok.eos_id, tok.pad_id):
    return None
  inner = getattr(tok, "_tok", None)  # a tokenizers file names its own specials
  if inner is not None and token < inner.get_vocab_size(with_added_tokens=True):
    return inner.id_to_token(token)
  inner = getattr(tok, "_sp", None)
  if inner is not None and token < inner.get_piece_size():
    return inner.id_to_piece(token)
  return DEFAULT_EOS_TEXT if token == tok.eos_id else "<|pad|>"


def token_text(tok: Tokenizer, token: int) -> str:
  """One token as the API shows it in ``logprobs``: its text, a special token's name, or
  ``bytes:\\xNN`` for a byte that is not text on its own."""
  special = special_text(tok, token)
  if special is not None:
    return special
  if isinstance(tok, ByteTokenizer) and token < 256:
    return chr(token) if token < 128 else f"bytes:\\x{token:02x}"
  return tok.decode([token])


def token_bytes(tok: Tokenizer, token: int) -> list[int]:
  """The bytes of one token (the chat API's ``bytes``): a byte-level token's own byte, else
  the UTF-8 of its text."""
  if isinstance(tok, ByteTokenizer) and token < 256:
    return [token]
  return list(token_text(tok, token).encode("utf-8"))


# -- requests -------------------------------------------------------------------------------


def _get(body: dict, name: str, kinds, default=None, *, minimum=None, maximum=None):
  value = body.get(name, default)
  if value is None:
    return default
  kinds = kinds if isinstance(kinds, tuple) else (kinds,)
  if isinstance(value, bool) and bool not in kinds:
    raise RequestError(f"{name}={value!r} must be {_kinds(kinds)}.", param=name)
  if not isinstance(value, kinds):
    raise RequestError(f"{name}={value!r} must be {_kinds(kinds)}.", param=name)
  if minimum is not None and value < minimum:
    raise RequestError(f"{name}={value!r} must be at least {minimum}.", param=name)
  if maximum is not None and value > maximum:
    raise RequestError(f"{name}={value!r} must be at most {maximum}.", param=name)
  return value


def _kinds(kinds) -> str:
  names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list"}
  if kinds == (int, float):
    return "a number"
  return " or ".join(names.get(k, k.__name__) for k in kinds)


class Choice:
  """One sequence of a response: its events from the engine turned into text and logprobs."""

  def __init__(self, index: int, tok: Tokenizer, stops, prompt_ids, prompt_text, echo: bool):
    self.index, self.tok = index, tok
    self.stream = TextStream(tok, stops, context=prompt_ids)
    self.prompt_ids, self.prompt_text, self.echo = prompt_ids, prompt_text, echo
    self.tokens: list[int] = []
    self.logprobs: list[float | None] = []
    self.top: list[Any] = []
    self.finish_reason: str | None = None
    self.job: Job | None = None
    self.error: str | None = None
    # Per token, where its text starts (characters of the choice's text) and the text it adds.
    self._offsets: list[int] = []
    self._pieces: list[str] = []
    self._spellers: list[tuple[int, TextStream]] = []  # (first token, its text's stream)
    self._scored = False  # the prompt's tokens lead ``tokens`` (echo)

  def take(self, event) -> str:
    """Applies one engine event; returns the text it releases."""
    if isinstance(event, PromptEvent):
      self._offsets.clear()
      self._pieces.clear()
      self._spellers.clear()
      self._scored = True
      self.tokens[:0] = self.prompt_ids
      self.logprobs[:0] = list(event.logprobs)
      self.top[:0] = list(event.top)
      return ""
    if isinstance(event, TokenEvent):
      if self.stream.stopped:
        return ""
      self.tokens.append(event.token)
      self.logprobs.append(event.logprob)
      self.top.append(event.top)
      piece = self.stream.add(event.token)
      if self.stream.stopped and self.job is not None:
        self.job.cancel()
      return piece
    assert isinstance(event, DoneEvent)
    if event.reason == "error":
      self.error = event.message
    if self.stream.stopped or event.reason == "stop":
      self.finish_reason = "stop"
    elif event.reason in ("cancelled", "error"):  # the server stopped it (shutdown, failure)
      self.finish_reason = "abort"
    else:
      self.finish_reason = "length"
    return self.stream.finish()

  @property
  def done(self) -> bool:
    return self.finish_reason is not None

  @property
  def completion_tokens(self) -> int:
    return len(self.tokens) - (len(self.prompt_ids) if self.echo else 0)

  def completion_logprobs(self, start: int = 0) -> dict:
    """The completions API's ``logprobs`` object for tokens ``start`` on."""
    self._spell()
    tokens = self.tokens[start:]
    return {
      "tokens": [self._shown(t, p) for t, p in zip(tokens, self._pieces[start:])],
      "token_logprobs": self.logprobs[start:],
      "top_logprobs": [None if top is None else self._top_dict(top) for top in self.top[start:]],
      "text_offset": self._offsets[start:],
    }

  def _shown(self, token: int, piece: str) -> str:
    """A token as ``logprobs.tokens`` shows it: the text it adds to the choice's text (a
    special token's name; ``bytes:\\xNN`` for a byte token that is part of a character)."""
    special = special_text(self.tok, token)
    if special is not None:
      return special
    if isinstance(self.tok, ByteTokenizer) and token < 256:
      return token_text(self.tok, token)
    return piece

  def _spell(self) -> None:
    """Extends ``_offsets`` and ``_pieces`` to every token: a token's text starts where the
    whole text decoded from the tokens before it ends (a token that only begins a character
    adds nothing; the one that ends it adds the character). With ``echo`` the prompt's tokens
    are decoded from the start; the generated ones always follow the prompt's ids, from the
    end of the prompt's text, as the choice's text does."""
    if not self._spellers:
      first = len(self.prompt_ids) if self._scored else 0
      if first:
        self._spellers.append((0, TextStream(self.tok)))
      self._spellers.append((first, TextStream(self.tok, context=self.prompt_ids)))
    for i in range(len(self._offsets), len(self.tokens)):
      first, stream = next((f, s) for f, s in reversed(self._spellers) if f <= i)
      shift = len(self.prompt_text) if first else 0
      before = len(stream.text)
      stream.add(self.tokens[i])
      self._offsets.append(shift + before)
      self._pieces.append(stream.text[before:])

  def _top_dict(self, top) -> dict[str, float]:
    out: dict[str, float] = {}
    for token, lp in top:
      key = token_text(self.tok, token)
      out[key if key not in out else f"{key} (id {token})"] = lp
    return out

  def chat_logprobs(self, start: int = 0) -> dict:
    """The chat API's ``logprobs`` object for generated tokens ``start`` on."""
    content = []
    for token, lp, top in zip(self.tokens[start:], self.logprobs[start:], self.top[start:]):
      content.append(
        {
          "token": token_text(self.tok, token),
          "logprob": lp,
          "bytes": token_bytes(self.tok, token),
          "top_logprobs": [
            {"token": token_text(self.tok, i), "logprob": v, "bytes": token_bytes(self.tok, i)}
            for i, v in top
          ],
        }
      )
    return {"content": content}


class _Mailbox:
  """Hands the engine thread's events to the event loop in batches: the first event of a batch
  wakes the loop once, the rest of the batch (a decode chunk's tokens, for every request) ride
  along, instead of one cross-thread wake-up per token."""

  def __init__(self, loop: asyncio.AbstractEventLoop):
    self.loop = loop
    self._lock = threading.Lock()
    self._items: list = []
    self._armed = False

  def post(self, queue: asyncio.Queue, item) -> None:
    """Called from the engine's thread: ``item`` goes into ``queue`` on the loop."""
    with self._lock:
      self._items.append((queue, item))
      if self._armed:
        return
      self._armed = True
    self.loop.call_soon_threadsafe(self._deliver)

  def _deliver(self) -> None:
    with self._lock:
      items, self._items, self._armed = self._items, [], False
    for queue, item in items:
      queue.put_nowait(item)


class Server:
  """The HTTP application over ``engine``.

  Args:
    engine: a started :class:`Engine`.
    tokenizer: the model's tokenizer.
    model_name: the id clients name in ``model`` (a request naming another gets a 404).
    chat_template: a Jinja chat template (HF's conventions: ``messages``,
      ``add_generation_prompt``, ``bos_token``, ``eos_token``); without one, chat requests
      get a 400 saying how to give one.
  """

  def __init__(
    self, engine: Engine, tokenizer: Tokenizer, *, model_name: str, chat_template: str | None = None
  ):
    self.engine, self.tok, self.model_name = engine, tokenizer, model_name
    self.eos_text = special_text(tokenizer, tokenizer.eos_id)
    self.chat_template = chat_template
    self._template = None
    if chat_template:
      sandbox = import_extra("jinja2.sandbox", "serve", "a chat template")
      env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
      self._template = env.from_string(chat_template)
    self.draining = False
    self.created = int(time.time())
    self._seed = int.from_bytes(os.urandom(4), "little")
    self._mailbox: _Mailbox | None = None

  def app(self):
    """The aiohttp application."""
    app = web.Application(client_max_size=16 * 2**20, middlewares=[self._errors])
    app.router.add_get("/health", self.health)
    app.router.add_get("/v1/models", self.models)
    app.router.add_get("/v1/models/{model}", self.model)
    app.router.add_post("/v1/completions", self.completions)
    app.router.add_post("/v1/chat/completions", self.chat)
    app.router.add_get("/tokenizer_info", self.tokenizer_info)
    app.router.add_post("/tokenize", self.tokenize)
    app.router.add_post("/detokenize", self.detokenize)
    return app

  @web.middleware
  async def _errors(self, request, handler):
    try:
      return await handler(request)
    except RequestError as e:
      return e.response()
    except web.HTTPException as e:  # aiohttp's own 404/405 as OpenAI-style JSON
      if e.status >= 400:
        return RequestError(
          f"{request.method} {request.path}: {e.reason}", status=e.status
        ).response()
      raise
    except (asyncio.CancelledError, ConnectionError):
      raise  # the client left: nothing to answer
    except Exception as e:  # noqa: BLE001 - a bug: logged whole, answered as JSON
      traceback.print_exc()
      return RequestError(f"internal error: {type(e).__name__}: {e}", status=500).response()

  # -- plain routes ------------------------------------------------------------------------

  async def health(self, request):
    del request
    if self.draining:
      return web.json_response({"status": "draining"}, status=503)
    if self.engine.error:
      return web.json_response({"status": "error", "error": self.engine.error}, status=500)
    return web.json_response({"status": "ok", **self.engine.load()})

  def _card(self) -> dict:
    return {
      "id": self.model_name,
      "object": "model",
      "created": self.created,
      "owned_by": "diffjax",
      "max_model_len": self.engine.context,
    }

  async def models(self, request):
    del request
    return web.json_response({"object": "list", "data": [self._card()]})

  async def model(self, request):
    name = request.match_info["model"]
    if name != self.model_name:
      raise RequestError(
        f"the model {name!r} does not exist: this server serves {self.model_name!r}.",
        status=404,
        param="model",
        code="model_not_found",
      )
    return web.json_response(self._card())

  async def tokenizer_info(self, request):
    del request
    return web.json_response(
      {
        "tokenizer_class": type(self.tok).__name__,
        "eos_token": self.eos_text,
        "bos_token": None,
        "pad_token": special_text(self.tok, self.tok.pad_id),
        "chat_template": self.chat_template,
        "model_max_length": self.engine.context,
        "vocab_size": self.tok.vocab_size,
      }
    )

  async def tokenize(self, request):
    body = await self._body(request)
    if "messages" in body:
      text = self._render(body)
    else:
      text = _get(body, "prompt", str)
      if text is None:
        raise RequestError("give the text to tokenize as prompt.", param="prompt")
    ids = self.encode(text)
    return web.json_response(
      {"tokens": ids, "count": len(ids), "max_model_len": self.engine.context}
    )

  async def detokenize(self, request):
    body = await self._body(request)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
      raise RequestError("tokens must be a list of token ids.", param="tokens")
    self._check_ids(ids, "tokens")
    return web.json_response({"prompt": self.tok.decode(ids)})

  # -- helpers -----------------------------------------------------------------------------

  def encode(self, text: str) -> list[int]:
    """Token ids of a prompt ``text``; the eos token's written form becomes the eos id, and a
    tokenizer file's other special tokens' names (a chat template's markers) their ids."""
    encode = getattr(self.tok, "encode_with_specials", self.tok.encode)
    if not self.eos_text or self.eos_text not in text:
      return [int(t) for t in encode(text)]
    ids: list[int] = []
    for i, part in enumerate(text.split(self.eos_text)):
      if i:
        ids.append(int(self.tok.eos_id))
      if part:
        ids.extend(int(t) for t in encode(part))
    return ids

  async def _body(self, request) -> dict:
    if self.draining:
      raise RequestError("the server is shutting down.", status=503)
    try:
      body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise RequestError(f"the request body is not valid JSON: {e}.") from None
    if not isinstance(body, dict):
      raise RequestError("the request body must be a JSON object.")
    model = body.get("model")
    if model is not None and model != self.model_name:
      raise RequestError(
        f"the model {model!r} does not exist: this server serves {self.model_name!r} "
        "(GET /v1/models).",
        status=404,
        param="model",
        code="model_not_found",
      )
    return body

  def _check_ids(self, ids, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < self.engine.vocab_size]
    if bad:
      raise RequestError(
        f"token id {bad[0]} is outside the vocabulary [0, {self.engine.vocab_size}).", param=param
      )

  def _prompts(self, body: dict) -> list[tuple[list[int], str]]:
    """The request's prompts as (token ids, text)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
      items = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
      items = [prompt]
    elif (
      isinstance(prompt, list)
      and prompt
      and all(
        isinstance(p, str) or (isinstance(p, list) and all(_is_int(t) for t in p)) for p in prompt
      )
    ):
      items = prompt
    else:
      raise RequestError(
        "prompt must be a string, a list of strings, a list of token ids or a list of such "
        "lists, and not empty.",
        param="prompt",
      )
    out = []
    for item in items:
      if isinstance(item, str):
        out.append((self.encode(item), item))
      else:
        self._check_ids(item, "prompt")
        out.append(([int(t) for t in item], self.tok.decode(item)))
    for ids, _ in out:
      if not ids:
        raise RequestError("a prompt is empty: give at least one token.", param="prompt")
    return out

  def _render(self, body: dict) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
      raise RequestError("messages must be a non-empty list.", param="messages")
    clean = []
    for m in messages:
      if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RequestError("each message needs a role and a content.", param="messages")
      content = m.get("content")
      if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
          raise RequestError("only text content parts are served.", param="messages")
        content = "".join(parts)
      if not isinstance(content, str):
        raise RequestError("each message's content must be text.", param="messages")
      clean.append({**m, "content": content})
    if self._template is None:
      raise RequestError(
        "this server has no chat template: start it with --chat_template=FILE (a Jinja "
        "template), or use /v1/completions.",
        param="messages",
      )
    try:
      return self._template.render(
        messages=clean,
        add_generation_prompt=body.get("add_generation_prompt", True),
        bos_token="",
        eos_token=self.eos_text,
      )
    except Exception as e:  # noqa: BLE001 - a template may raise anything (raise_exception, ...)
      raise RequestError(
        f"the chat template cannot render these messages: {type(e).__name__}: {e}", param="messages"
      ) from None

  def _sampling(self, body: dict, *, chat: bool) -> dict[str, Any]:
    """The sampling and length options of a request, checked."""
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0)):
      if body.get(name) not in (None, neutral, float(neutral)):
        raise RequestError(f"{name} is not supported; leave it out or 0.", param=name)
    if body.get("logit_bias"):
      raise RequestError("logit_bias is not supported; leave it out.", param="logit_bias")
    if body.get("suffix"):
      raise RequestError("suffix is not supported; leave it out.", param="suffix")
    n = _get(body, "n", int, 1, minimum=1, maximum=MAX_CHOICES)
    best_of = _get(body, "best_of", int, n)
    if best_of != n:
      raise RequestError("best_of other than n is not supported.", param="best_of")
    default_max = None if chat else 16
    max_tokens = _get(body, "max_tokens", int, default_max, minimum=0)
    if chat:
      max_tokens = _get(body, "max_completion_tokens", int, max_tokens, minimum=0)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
      raise RequestError("stop must be a string or a list of strings.", param="stop")
    if len(stops) > MAX_STOPS:
      raise RequestError(f"stop has {len(stops)} strings; at most {MAX_STOPS}.", param="stop")
    if chat:
      wants = _get(body, "logprobs", bool, False)
      top = _get(body, "top_logprobs", int, 0, minimum=0, maximum=MAX_TOP_LOGPROBS)
      logprobs = top if wants else None
      if top and not wants:
        raise RequestError("top_logprobs needs logprobs: true.", param="top_logprobs")
      echo = False
    else:
      logprobs = _get(body, "logprobs", int, None, minimum=0, maximum=MAX_TOP_LOGPROBS)
      echo = _get(body, "echo", bool, False)
    top_k = _get(body, "top_k", int, 0, minimum=-1)
    seed = _get(body, "seed", int, None)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
      raise RequestError("stream_options must be an object.", param="stream_options")
    return {
      "n": n,
      "max_tokens": max_tokens,
      "temperature": float(_get(body, "temperature", (int, float), 1.0, minimum=0, maximum=100)),
      "top_p": float(_get(body, "top_p", (int, float), 1.0)),
      "top_k": max(0, top_k),  # vLLM's -1 is "all", as 0 here
      "seed": seed,
      "stops": stops,
      "ignore_eos": _get(body, "ignore_eos", bool, False),
      "logprobs": logprobs,
      "echo": echo,
      "stream": _get(body, "stream", bool, False),
      "include_usage": bool(stream_options.get("include_usage")),
    }

  def _choices(self, prompts, opts) -> tuple[list[Choice], asyncio.Queue]:
    """One choice per prompt and ``n``, each submitted to the engine as a job."""
    loop = asyncio.get_running_loop()
    if self._mailbox is None or self._mailbox.loop is not loop:
      self._mailbox = _Mailbox(loop)
    post = self._mailbox.post
    queue: asyncio.Queue = asyncio.Queue()
    choices: list[Choice] = []
    base_seed = opts["seed"] if opts["seed"] is not None else self._next_seed()
    stop_tokens = frozenset() if opts["ignore_eos"] else frozenset({int(self.tok.eos_id)})
    for p, (ids, text) in enumerate(prompts):
      max_tokens = opts["max_tokens"]
      if max_tokens is None:  # chat without a limit: what the context leaves
        max_tokens = max(1, self.engine.context - len(ids))
      for i in range(opts["n"]):
        index = p * opts["n"] + i
        choice = Choice(index, self.tok, opts["stops"], ids, text, opts["echo"])

        def on_event(event, index=index):
          post(queue, (index, event))

        choice.job = Job(
          prompt=ids,
          max_tokens=max_tokens,
          on_event=on_event,
          temperature=opts["temperature"],
          top_k=opts["top_k"],
          top_p=opts["top_p"],
          seed=(base_seed + index) & 0x7FFFFFFF,
          stop_tokens=stop_tokens,
          top_logprobs=opts["logprobs"] or 0,
          echo=opts["echo"],
        )
        choices.append(choice)
    most = self.engine.slots + self.engine.max_waiting
    if len(choices) > most:
      raise RequestError(
        f"this request asks for {len(choices)} completions (prompts x n); the server holds "
        f"at most {most} at once ({self.engine.slots} slots and {self.engine.max_waiting} "
        "waiting): send fewer per request.",
        param="prompt",
      )
    submitted = []
    try:
      for choice in choices:
        try:
          self.engine.submit(choice.job)
        except ContextTooLong as e:
          raise RequestError(str(e), param="prompt", code="context_length_exceeded") from None
        except ValueError as e:
          raise RequestError(str(e)) from None
        except QueueFull as e:
          raise RequestError(str(e), status=429) from None
        except EngineStopped as e:
          raise RequestError(str(e), status=503) from None
        submitted.append(choice)
    except RequestError:
      for choice in submitted:
        choice.job.cancel()
      raise
    return choices, queue

  def _next_seed(self) -> int:
    self._seed = (self._seed * 6364136223846793005 + 1442695040888963407) % 2**63
    return self._seed >> 33

  async def _events(self, choices, queue):
    """Yields (choice, text released) until every choice is done."""
    left = len(choices)
    while left:
      index, event = await queue.get()
      choice = choices[index]
      piece = choice.take(event)
      if choice.done:
        left -= 1
      yield choice, piece

  # -- the two generation routes -----------------------------------------------------------

  async def completions(self, request):
    body = await self._body(request)
    opts = self._sampling(body, chat=False)
    prompts = self._prompts(body)

    def whole(c: Choice) -> dict:
      text = (c.prompt_text if c.echo else "") + c.stream.text
      logprobs = c.completion_logprobs() if opts["logprobs"] is not None else None
      return {
        "index": c.index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason,
      }

    return await self._answer(request, "text_completion", prompts, opts, whole)

  async def chat(self, request):
    body = await self._body(request)
    opts = self._sampling(body, chat=True)
    text = self._render(body)

    def whole(c: Choice) -> dict:
      return {
        "index": c.index,
        "message": {"role": "assistant", "content": c.stream.text},
        "logprobs": c.chat_logprobs() if opts["logprobs"] is not None else None,
        "finish_reason": c.finish_reason,
      }

    return await self._answer(request, "chat.completion", [(self.encode(text), text)], opts, whole)

  async def _answer(self, request, kind: str, prompts, opts, whole):
    """Runs the request's choices and answers with one JSON object (``whole`` makes each
    choice's entry) or a stream of chunks; a choice left unfinished (the client went away) is
    cancelled."""
    choices, queue = self._choices(prompts, opts)
    rid = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}"
    head = {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name}
    try:
      if opts["stream"]:
        return await self._stream(request, head, choices, queue, opts)
      async for _ in self._events(choices, queue):
        pass
      self._raise_engine_error(choices)
      usage = self._usage(prompts, choices, opts)
      return web.json_response({**head, "choices": [whole(c) for c in choices], "usage": usage})
    finally:
      for c in choices:
        if not c.done:
          c.job.cancel()

  async def _stream(self, request, head, choices, queue, opts):
    """Server-sent events: a chunk per piece of text (the prompt first with ``echo``; chat opens
    each choice with its role), then the usage when asked, then ``[DONE]``."""
    chat = head["object"] == "chat.completion"
    head = {**head, "object": "chat.completion.chunk"} if chat else head
    if opts["include_usage"]:  # every chunk has the field; the last one fills it
      head = {**head, "usage": None}
    response = await self._sse(request)
    try:
      if chat:
        for c in choices:
          delta = {"role": "assistant", "content": ""}
          entry = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}
          await _send(response, {**head, "choices": [entry]})
      sent = {c.index: 0 for c in choices}  # tokens already sent, per choice
      async for c, piece in self._events(choices, queue):
        if c.error:
          break
        if chat:
          lp = c.chat_logprobs(sent[c.index]) if opts["logprobs"] is not None else None
          entry = {"index": c.index, "delta": {"content": piece} if piece else {}}
          more = bool(piece or (lp and lp["content"]))
        else:
          if c.echo and sent[c.index] == 0 and c.tokens:  # the prompt, once it is scored
            piece = c.prompt_text + piece
          lp = c.completion_logprobs(sent[c.index]) if opts["logprobs"] is not None else None
          entry = {"index": c.index, "text": piece}
          more = bool(piece or (lp and lp["tokens"]))
        sent[c.index] = len(c.tokens)
        if more or c.done:
          entry.update(logprobs=lp, finish_reason=c.finish_reason)
          await _send(response, {**head, "choices": [entry]})
      self._raise_engine_error(choices, response)
      if opts["include_usage"]:
        await _send(response, {**head, "choices": [], "usage": self._usage(None, choices, opts)})
      await response.write(b"data: [DONE]\n\n")
      await response.write_eof()
      return response
    except ConnectionError:  # the client left mid-stream: its jobs are cancelled
      return response

  async def _sse(self, request):
    response = web.StreamResponse(
      headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    return response

  def _raise_engine_error(self, choices, response=None) -> None:
    failed = next((c.error for c in choices if c.error), None)
    if failed is None:
      return
    if response is None:
      raise RequestError(f"the engine failed: {failed}", status=500)
    raise ConnectionError(f"the engine failed: {failed}")  # mid-stream: end the connection

  def _usage(self, prompts, choices, opts) -> dict[str, int]:
    prompt = (
      sum(len(ids) for ids, _ in prompts)
      if prompts is not None
      else sum(len(c.prompt_ids) for c in choices[:: opts["n"]])
    )
    completion = sum(c.completion_tokens for c in choices)
    return {
      "prompt_tokens": prompt,
      "completion_tokens": completion,
      "total_tokens": prompt + completion,
    }


async def _send(response, payload: dict) -> None:
  await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)
