"""The HTTP server on 127.0.0.1 with real clients: the ``openai`` package, lm-eval's
``local-completions`` model, and raw requests for the errors, disconnects and the queue."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import openai
import pytest
import requests
from helpers import REPO, tiny_model, wait_until

from diffjax.data import ByteTokenizer
from diffjax.generation import generate
from diffjax.serve import Engine
from diffjax.serve.app import Server, _Mailbox
from diffjax.serve.command import ServerThread

lm_eval = pytest.importorskip("lm_eval", reason="needs the [harness] extra")

from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402

from diffjax.eval.harness import DiffjaxLM, run_tasks  # noqa: E402

FIXTURES = os.path.join("tests", "fixtures", "harness")
TASKS = ["diffjax_fixture_choice", "diffjax_fixture_perplexity", "diffjax_fixture_generate"]
MAX_LENGTH = 32  # the harness model's context; lm-eval's API model is given MAX_LENGTH + 2
TEMPLATE = (
  "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
  "{% if add_generation_prompt %}<assistant>{% endif %}"
)
EOS = ByteTokenizer().eos_id


@pytest.fixture(scope="module")
def served():
  model = tiny_model("diff_v1")
  engine = Engine(model, slots=4, context=64, decode_chunk=3, max_waiting=8, max_prefill=2)
  engine.warm_up()
  server = Server(engine.start(), ByteTokenizer(), model_name="tiny", chat_template=TEMPLATE)
  with ServerThread(engine, server) as thread:
    yield model, engine, thread.url
  engine.stop(cancel=True)


def _greedy(model, ids, n):
  return generate(model, [ids], max_new_tokens=n, stop_tokens=[EOS], preflight=False).tokens[0]


def test_the_openai_client_completes_streams_and_chats_as_generate(served):
  model, engine, url = served
  client = openai.OpenAI(base_url=url, api_key="unused")
  assert [m.id for m in client.models.list().data] == ["tiny"]
  assert client.models.retrieve("tiny").id == "tiny"
  assert requests.get(f"{url}/models/other", timeout=30).status_code == 404
  prompt = "def f(x):\n    return"
  ids = list(prompt.encode())
  want = bytes(t for t in _greedy(model, ids, 10) if t < 256).decode("utf-8", "replace")
  out = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
  assert out.choices[0].text == want and out.usage.prompt_tokens == len(ids)
  assert out.usage.completion_tokens == len(_greedy(model, ids, 10))
  # Several prompts at once, as token ids, n = 2 each.
  other = [1, 2, 3, 4, 5]
  many = client.completions.create(
    model="tiny", prompt=[ids, other], max_tokens=6, n=2, temperature=0
  )
  assert [c.index for c in many.choices] == [0, 1, 2, 3]
  assert many.choices[0].text == many.choices[1].text == want[: len(many.choices[0].text)]
  streamed = client.completions.create(
    model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True
  )
  pieces = [c.choices[0].text for c in streamed]
  assert "".join(pieces) == want and len(pieces) > 1
  # Chat through the template: the same as completing the rendered prompt.
  rendered = "<user>hi\n<assistant>"
  chat_want = client.completions.create(model="tiny", prompt=rendered, max_tokens=8, temperature=0)
  messages = [{"role": "user", "content": "hi"}]
  chat = client.chat.completions.create(
    model="tiny", messages=messages, max_tokens=8, temperature=0
  )
  assert chat.choices[0].message.content == chat_want.choices[0].text
  assert chat.choices[0].message.role == "assistant"
  chunks = client.chat.completions.create(
    model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True
  )
  assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_want.choices[0].text
  # A seed makes sampling repeatable; stop strings cut the text.
  sampled = [
    client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1, seed=5)
    .choices[0]
    .text
    for _ in range(2)
  ]
  assert sampled[0] == sampled[1]
  cut = want[3:5]
  stopped = client.completions.create(
    model="tiny", prompt=prompt, max_tokens=10, temperature=0, stop=[cut]
  )
  assert stopped.choices[0].text == want[: want.index(cut)]
  assert stopped.choices[0].finish_reason == "stop"


def test_lm_evals_local_completions_scores_and_generates_as_the_harness_model(served):
  """Per request: log-likelihoods equal (relative 1e-5), the same greedy flags, the same
  generations, over the fixture tasks' three request types."""
  model, _, url = served
  ours = DiffjaxLM(
    model=model, tokenizer="byte", max_length=MAX_LENGTH, batch_size=4, max_gen_toks=12
  )
  theirs = LocalCompletionsAPI(
    base_url=f"{url}/completions",
    model="tiny",
    tokenizer_backend="remote",
    max_length=MAX_LENGTH + 2,  # it keeps one token for generation, and one more for windows
    batch_size=4,
    max_gen_toks=12,
    max_retries=1,
  )
  cwd = os.getcwd()
  os.chdir(REPO)
  try:
    results = [
      run_tasks(lm, TASKS, include_path=FIXTURES, bootstrap_iters=0, log_samples=True)
      for lm in (ours, theirs)
    ]
  finally:
    os.chdir(cwd)
  compared = 0
  for task in TASKS:
    want, got = (r["samples"][task] for r in results)
    assert len(want) == len(got) > 0
    for a, b in zip(want, got):
      assert a["doc_id"] == b["doc_id"]
      for ra, rb in zip(a["resps"], b["resps"]):
        (ra,), (rb,) = ra, rb
        if isinstance(ra, str):
          assert rb == ra, task
        else:
          ra, rb = np.atleast_1d(ra), np.atleast_1d(rb)
          np.testing.assert_allclose(float(rb[0]), float(ra[0]), rtol=1e-5, err_msg=task)
          if len(ra) > 1:
            assert bool(rb[1]) == bool(ra[1]), task
        compared += 1
  assert compared >= 20


def _post(url, path, body, **kw):
  data = body if isinstance(body, (str, bytes)) else json.dumps(body)
  return requests.post(f"{url}{path}", data=data, timeout=60, **kw)


@pytest.mark.parametrize(
  "path, body, status, needle",
  [
    ("/completions", "{not json", 400, "not valid JSON"),
    ("/completions", {"model": "gpt-4", "prompt": "x"}, 404, "'gpt-4' does not exist"),
    ("/completions", {"prompt": "x" * 60, "max_tokens": 10}, 400, "context is 64 tokens"),
    ("/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens=-1"),
    ("/completions", {"prompt": "", "max_tokens": 1}, 400, "prompt is empty"),
    ("/completions", {"prompt": [1, 999]}, 400, "token id 999"),
    ("/completions", {"prompt": "x", "logprobs": 9}, 400, "logprobs=9 must be at most 5"),
    ("/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature='hot'"),
    ("/completions", {"prompt": "x", "frequency_penalty": 1}, 400, "frequency_penalty"),
    ("/completions", {"prompt": "x", "n": 2, "best_of": 3}, 400, "best_of"),
    ("/completions", {"prompt": "x", "top_k": -7}, 400, "top_k=-7 must be at least -1"),
    # More choices than 4 slots and 8 waiting hold at once: retrying would not help.
    ("/completions", {"prompt": ["x"] * 7, "n": 2}, 400, "asks for 14 completions"),
    ("/chat/completions", {"messages": []}, 400, "messages must be a non-empty list"),
    ("/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400, "must be text"),
    ("/chat/completions", {"messages": [{"role": "x", "content": "y"}], "n": 0}, 400, "n=0"),
    ("/nowhere", {}, 404, "Not Found"),
  ],
)
def test_bad_requests_get_a_json_error_and_the_server_keeps_serving(
  served, path, body, status, needle
):
  _, _, url = served
  r = _post(url, path, body)
  assert r.status_code == status, r.text
  error = r.json()["error"]
  assert needle in error["message"] and error["type"]
  ok = _post(url, "/completions", {"prompt": "x", "max_tokens": 2, "ignore_eos": True})
  assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
  "template, needle",
  [
    (None, "--chat_template=FILE"),
    ("{{ messages[3]['content'] }}", "cannot render these messages"),
  ],
)
def test_a_chat_request_without_a_usable_template_is_refused_in_one_line(template, needle):
  engine = Engine(tiny_model("transformer"), slots=1, context=32)
  server = Server(engine.start(), ByteTokenizer(), model_name="plain", chat_template=template)
  with ServerThread(engine, server) as thread:
    r = _post(thread.url, "/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
  engine.stop(cancel=True)


def test_the_tokenizer_routes_lm_eval_looks_for(served):
  _, _, url = served
  base = url[: -len("/v1")]
  info = requests.get(f"{base}/tokenizer_info", timeout=30).json()
  assert info["eos_token"] == "<|endoftext|>" and info["model_max_length"] == 64
  ids = _post(base, "/tokenize", {"prompt": "ab<|endoftext|>c"}).json()["tokens"]
  assert ids == [97, 98, EOS, 99]
  assert _post(base, "/detokenize", {"tokens": ids}).json()["prompt"] == "abc"


def test_a_full_queue_gets_429_and_a_client_that_leaves_frees_its_slot():
  """One slot, no queue, and a request long enough to be in flight while the checks run (2,000
  tokens, a program call per token, the larger cache windows compiled as the request reaches
  them)."""
  engine = Engine(tiny_model("transformer"), slots=1, context=2100, max_waiting=0, decode_chunk=1)
  server = Server(engine.start(), ByteTokenizer(), model_name="busy")
  with ServerThread(engine, server) as thread:
    body = {"prompt": "x", "max_tokens": 2000, "stream": True, "ignore_eos": True, "temperature": 0}
    with requests.post(f"{thread.url}/completions", json=body, stream=True, timeout=60) as r:
      assert next(r.iter_lines(delimiter=b"\n\n")).startswith(b"data: ")  # the slot is taken
      busy = _post(thread.url, "/completions", {"prompt": "y", "max_tokens": 1})
      assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
      assert "retry later" in busy.json()["error"]["message"]
    # Leaving the block closed the connection mid-stream.
    wait_until(lambda: engine.load()["running"] == 0, "the slot freed")
    assert engine.counts["finished_cancelled"] == 1 and engine.counts["tokens"] < 2000
    ok = _post(thread.url, "/completions", {"prompt": "y", "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
  engine.stop(cancel=True)


def test_the_engine_threads_events_reach_the_loop_in_order_with_one_wake_up_per_batch():
  import asyncio  # pylint: disable=import-outside-toplevel
  import threading  # pylint: disable=import-outside-toplevel

  loop = asyncio.new_event_loop()
  wakes = []
  real = loop.call_soon_threadsafe
  loop.call_soon_threadsafe = lambda *a: (wakes.append(a), real(*a))[1]
  box = _Mailbox(loop)
  queues = [asyncio.Queue(), asyncio.Queue()]

  def post(items):  # from another thread, as the engine does, while the loop is not running
    thread = threading.Thread(target=lambda: [box.post(queues[i % 2], i) for i in items])
    thread.start()
    thread.join()

  async def drain(n):
    await asyncio.sleep(0)
    got = [[], []]
    for q, out in zip(queues, got):
      while not q.empty():
        out.append(q.get_nowait())
    assert sum(map(len, got)) == n
    return got

  try:
    post(range(10))
    assert loop.run_until_complete(drain(10)) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert len(wakes) == 1  # ten events, one wake-up
    post(range(10, 13))  # the next batch wakes the loop again
    assert loop.run_until_complete(drain(3)) == [[10, 12], [11]]
    assert len(wakes) == 2
  finally:
    loop.close()


def _start(workdir, *flags, env=None):
  """``python -m diffjax.serve`` on a free port; (process, base url) once it serves."""
  import re  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  proc = subprocess.Popen(
    [sys.executable, "-m", "diffjax.serve", f"--workdir={workdir}", "--port=0", *flags],
    stderr=subprocess.PIPE,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"} if env is None else env,
  )
  lines = []
  for line in proc.stderr:
    lines.append(line)
    found = re.search(r"serving '.*' on (http://127\.0\.0\.1:\d+/v1)", line)
    if found:
      return proc, found.group(1), lines
  proc.wait()
  raise AssertionError("".join(lines[-20:]))


@pytest.mark.integration  # two server processes on a trained run
@pytest.mark.parametrize("drain, finished", [(60.0, True), (0.0, False)])
def test_sigterm_drains_or_cancels_requests_in_flight_and_exits_cleanly(
  trained_run, drain, finished
):
  import signal  # pylint: disable=import-outside-toplevel

  proc, url, lines = _start(
    trained_run("diff_v1", small=True),
    "--context=2100",
    "--slots=1",
    "--decode_chunk=1",
    f"--drain_seconds={drain}",
    "--model_name=run",
    "--compile_cache=",  # the shared run stays as it was
  )
  try:
    body = {"prompt": "x", "max_tokens": 2000, "stream": True, "ignore_eos": True, "temperature": 0}
    body["stream_options"] = {"include_usage": True}
    events = []
    with requests.post(f"{url}/completions", json=body, stream=True, timeout=120) as r:
      lines_iter = r.iter_lines(delimiter=b"\n\n")
      events.append(next(lines_iter))
      proc.send_signal(signal.SIGTERM)
      time.sleep(0.5)
      try:  # a new request is refused while the server drains (or the port is closed)
        late = requests.post(f"{url}/completions", json={"prompt": "y"}, timeout=10).status_code
      except requests.ConnectionError:
        late = "closed"
      assert late in (503, "closed"), late
      events += [e for e in lines_iter if e]
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 0, rest[-2000:]
  finally:
    if proc.poll() is None:
      proc.kill()
  assert "shutting down" in rest and "stopped;" in rest
  assert events[-1] == b"data: [DONE]"
  *chunks, usage = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
  reason = chunks[-1]["choices"][0]["finish_reason"]
  made = usage["usage"]["completion_tokens"]
  if finished:  # every token arrived
    assert reason == "length" and made == 2000 and "0 requests cancelled" in rest
  else:
    assert reason == "abort" and made < 2000 and "1 requests cancelled" in rest


@pytest.mark.integration  # two server processes on a trained run
def test_a_restart_loads_the_programs_from_the_runs_compile_cache(trained_run, tmp_path):
  """The first start fills the run's compile_cache/; the second compiles nothing new (no entry
  is written again) and serves the same greedy tokens."""
  import shutil  # pylint: disable=import-outside-toplevel
  import signal  # pylint: disable=import-outside-toplevel

  run = str(tmp_path / "run")
  shutil.copytree(trained_run("transformer", small=True), run)
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
  env.update(JAX_PLATFORMS="cpu")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  cache = os.path.join(run, "compile_cache")
  body = {"prompt": "ab", "max_tokens": 5, "temperature": 0}
  entries, texts = [], []
  for _ in range(2):
    proc, url, _ = _start(run, "--context=64", "--slots=2", env=env)
    try:
      texts.append(requests.post(f"{url}/completions", json=body, timeout=60).json())
    finally:
      proc.send_signal(signal.SIGTERM)
      assert proc.wait(timeout=60) == 0
    entries.append({e.name: e.stat().st_mtime_ns for e in os.scandir(cache)})
  assert len(entries[0]) >= 4  # a decode and a prefill program per bucket
  assert entries[1] == entries[0]
  assert texts[0]["choices"][0]["text"] == texts[1]["choices"][0]["text"]


def test_the_compile_cache_defaults_to_the_runs_directory(tmp_path):
  from diffjax.serve.command import _parser, compile_cache_dir  # pylint: disable=import-outside-toplevel

  def where(*flags):
    return compile_cache_dir(_parser().parse_args(list(flags)))

  run = str(tmp_path)
  assert where(f"--workdir={run}") == os.path.join(run, "compile_cache")
  assert where(f"--workdir={run}", "--compile_cache=") is None
  assert where(f"--workdir={run}", "--compile_cache=/elsewhere") == "/elsewhere"
  assert where("--workdir=gs://bucket/run") is None
  assert where(f"--workdir={tmp_path / 'missing'}") is None  # loading the model reports it
  assert where(f"--hf_dir={run}") is None
  assert where(f"--hf_dir={run}", "--compile_cache=/elsewhere") == "/elsewhere"


def test_a_cache_directory_that_cannot_be_written_is_skipped_in_one_line(tmp_path, monkeypatch):
  from diffjax.serve import command  # pylint: disable=import-outside-toplevel

  args = command._parser().parse_args([f"--workdir={tmp_path}"])
  lines = []
  assert command._writable_cache_dir(args, lines.append) == str(tmp_path / "compile_cache")
  assert lines == []
  monkeypatch.setattr(command.os, "access", lambda path, mode: False)
  assert command._writable_cache_dir(args, lines.append) is None
  assert lines == [
    f"not caching compiled programs: cannot write to {tmp_path / 'compile_cache'} "
    "(see --compile_cache)"
  ]
  blocked = tmp_path / "a_file"
  blocked.write_text("")  # a cache directory below a file cannot be made
  args = command._parser().parse_args([f"--workdir={tmp_path}", f"--compile_cache={blocked}/c"])
  monkeypatch.undo()
  assert command._writable_cache_dir(args, lines.append) is None
  assert lines[-1].startswith(f"not caching compiled programs: cannot write to {blocked}/c")


@pytest.mark.parametrize(
  "args, needle",
  [
    (["--workdir={missing}"], "is not a directory: give the workdir of a train.py run"),
    (["--workdir={missing}", "--slots=0"], "--slots=0 must be at least 1"),
    (["--workdir={missing}", "--chat_template={missing}"], "--chat_template="),
    (["--workdir={missing}", "--port=70000"], "--port=70000"),
    (["--workdir={missing}", "--mesh=two"], "--mesh='two'"),
    (["--workdir={missing}", "--replicas=0"], "--replicas=0 must be at least 1"),
    (["--workdir={missing}", "--replicas=2", "--mesh=2,1,1"], "Give one or the other"),
    (["--workdir={missing}", "--replicas=3", "--slots=2"], "raise --slots to 3"),
  ],
)
def test_bad_arguments_are_one_error_line(args, needle, tmp_path, capsys):
  from diffjax.serve.command import main  # pylint: disable=import-outside-toplevel

  missing = tmp_path / "nothing_here"
  assert main([a.format(missing=missing) for a in args]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("error: ") and needle in err[-1], err[-3:]


def test_an_hf_directory_is_served_with_its_tokenizer_and_chat_template(tmp_path):
  """``--hf_dir``: an export with its byte tokenizer files and a chat_template.jinja beside them."""
  import argparse  # pylint: disable=import-outside-toplevel

  from diffjax.convert import save_hf  # pylint: disable=import-outside-toplevel
  from diffjax.serve.command import build  # pylint: disable=import-outside-toplevel

  model = tiny_model("transformer")
  export = tmp_path / "exported"
  save_hf(model, str(export), tokenizer=ByteTokenizer(), max_position_embeddings=48)
  (export / "chat_template.jinja").write_text(TEMPLATE)
  args = argparse.Namespace(
    workdir=None,
    hf_dir=str(export),
    step=None,
    tokenizer=None,
    model_name=None,
    slots=2,
    context=None,
    decode_chunk=2,
    max_prefill=2,
    max_waiting=4,
    chat_template=None,
    mesh=None,
    replicas=1,
    port=0,
  )
  engine, server = build(args, progress=lambda line: None)
  assert server.model_name == "exported" and engine.context == 48
  with ServerThread(engine, server) as thread:
    client = openai.OpenAI(base_url=thread.url, api_key="unused")
    out = client.completions.create(model="exported", prompt="ab", max_tokens=5, temperature=0)
    want = bytes(t for t in _greedy(model, [97, 98], 5) if t < 256).decode("utf-8", "replace")
    assert out.choices[0].text == want
    chat = client.chat.completions.create(
      model="exported", messages=[{"role": "user", "content": "ab"}], max_tokens=3, temperature=0
    )
    rendered = "<user>ab\n<assistant>"
    ids = list(rendered.encode())
    assert chat.choices[0].message.content == bytes(
      t for t in _greedy(model, ids, 3) if t < 256
    ).decode("utf-8", "replace")


def test_a_streamed_echo_with_logprobs_is_the_whole_answer_in_pieces(served):
  _, _, url = served
  body = {"prompt": "def f(", "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 2}
  whole = _post(url, "/completions", body).json()["choices"][0]
  with requests.post(
    f"{url}/completions", json={**body, "stream": True}, stream=True, timeout=60
  ) as r:
    events = [e for e in r.iter_lines(delimiter=b"\n\n") if e]
  assert events[-1] == b"data: [DONE]"
  chunks = [json.loads(e[len(b"data: ") :])["choices"][0] for e in events[:-1]]
  assert "".join(c["text"] for c in chunks) == whole["text"] and whole["text"].startswith("def f(")
  streamed = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["token_logprobs"]]
  assert streamed == whole["logprobs"]["token_logprobs"] and streamed[0] is None
  assert len(streamed) == len("def f(") + 6 and chunks[-1]["finish_reason"] == "length"


def _events(url, path, body):
  """The JSON chunks of a streamed answer (the final [DONE] checked and left out)."""
  with requests.post(f"{url}{path}", json={**body, "stream": True}, stream=True, timeout=60) as r:
    events = [e for e in r.iter_lines(delimiter=b"\n\n") if e]
  assert events[-1] == b"data: [DONE]"
  return [json.loads(e[len(b"data: ") :]) for e in events[:-1]]


def test_text_offsets_count_characters_in_a_stream_as_in_the_whole_answer(served):
  _, _, url = served
  # A character's bytes start where it does: h, é (2 bytes), € (3 bytes), x.
  body = {"prompt": "hé€x", "max_tokens": 0, "echo": True, "logprobs": 1}
  lp = _post(url, "/completions", body).json()["choices"][0]["logprobs"]
  assert lp["text_offset"] == [0, 1, 1, 2, 2, 2, 3]
  body = {"prompt": "ab", "max_tokens": 12, "temperature": 100, "seed": 1, "logprobs": 0}
  body.update(ignore_eos=True, echo=True)
  whole = _post(url, "/completions", body).json()["choices"][0]
  offsets = whole["logprobs"]["text_offset"]
  chunks = [c["choices"][0] for c in _events(url, "/completions", body)]
  assert [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]] == offsets
  assert len(offsets) == 14 and offsets == sorted(offsets) and offsets[-1] < len(whole["text"])


def test_chat_logprobs_give_each_tokens_own_bytes_and_every_token_once_in_a_stream(served):
  """High-temperature bytes from the tiny model: many are parts of a UTF-8 character, whose text
  the stream holds back until it is whole; their logprobs still come, each once."""
  _, _, url = served
  messages = [{"role": "user", "content": "é"}]
  body = {"messages": messages, "max_tokens": 12, "temperature": 100, "seed": 1, "logprobs": True}
  body.update(top_logprobs=2, ignore_eos=True)
  whole = _post(url, "/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
  assert len(whole) == 12
  entries = [e for e in whole for e in (e, *e["top_logprobs"])]
  for e in entries:
    if e["token"].startswith("bytes:\\x"):
      assert e["bytes"] == [int(e["token"][len("bytes:\\x") :], 16)], e
    else:
      assert e["bytes"] == list(e["token"].encode()), e
  assert any(e["token"].startswith("bytes:") for e in whole)  # the case above is exercised
  chunks = _events(url, "/chat/completions", {**body, "stream_options": {"include_usage": True}})
  streamed = [
    e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]
  ]
  assert streamed == whole
  assert all(c["usage"] is None for c in chunks[:-1])
  assert chunks[-1]["usage"]["completion_tokens"] == 12 and chunks[-1]["choices"] == []


def test_each_choice_of_a_request_samples_with_its_own_seed(served):
  """The same prompt twice in one request: two samples, each what that prompt alone gives with
  the request's seed plus its index."""
  _, _, url = served
  body = {"prompt": ["def f(x):"] * 2, "max_tokens": 12, "temperature": 1.0, "seed": 5}
  body["ignore_eos"] = True
  both = sorted(_post(url, "/completions", body).json()["choices"], key=lambda c: c["index"])
  alone = [
    _post(url, "/completions", {**body, "prompt": "def f(x):", "seed": seed}).json()["choices"][0]
    for seed in (5, 6)
  ]
  assert [c["text"] for c in both] == [c["text"] for c in alone]
  assert both[0]["text"] != both[1]["text"]


def test_a_top_k_past_the_vocabulary_samples_from_every_token(served):
  _, _, url = served
  body = {"prompt": "def", "max_tokens": 6, "temperature": 1.0, "seed": 3, "ignore_eos": True}
  want = _post(url, "/completions", body).json()["choices"][0]["text"]
  for k in (258, 3_000_000_000):
    r = _post(url, "/completions", {**body, "top_k": k})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
  assert requests.get(f"{url[: -len('/v1')]}/health", timeout=30).json()["status"] == "ok"


def _metaspace_tokenizer(path):
  """A SentencePiece-style tokenizers file (words start with U+2581, as HF Llama's do)."""
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel

  from diffjax.data import load_tokenizer  # pylint: disable=import-outside-toplevel

  tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
  trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "<|endoftext|>"])
  tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer=trainer)
  tok.save(str(path))
  return load_tokenizer(str(path))


@pytest.mark.parametrize("kind", ["metaspace", "byte_level_bpe"])
@pytest.mark.parametrize("echo", [False, True])
def test_a_choices_text_and_token_offsets_are_the_decode_of_its_tokens(kind, echo, tmp_path):
  """The text follows the prompt as decoding prompt and tokens together does (the first word
  keeps its space; a character split over byte tokens is whole); ``logprobs.tokens`` are the
  text each token adds, and ``text_offset`` where it starts, in a stream as in the answer."""
  from helpers import write_bpe_tokenizer  # pylint: disable=import-outside-toplevel

  from diffjax.data import load_tokenizer  # pylint: disable=import-outside-toplevel
  from diffjax.serve.app import Choice  # pylint: disable=import-outside-toplevel
  from diffjax.serve.engine import DoneEvent, PromptEvent, TokenEvent  # pylint: disable=import-outside-toplevel

  if kind == "metaspace":
    tok, words = _metaspace_tokenizer(tmp_path / "tok.json"), "the quick brown fox jumps"
  else:
    pytest.importorskip("tokenizers")
    write_bpe_tokenizer(tmp_path / "tok.json", texts=["the quick brown fox"] * 20)
    tok, words = load_tokenizer(str(tmp_path / "tok.json")), "the qüick bröwn"
  ids = [int(i) for i in tok.encode(words)]
  prompt, gen = ids[:1], ids[1:]
  assert tok.decode(ids) == words and len(gen) >= 4
  choice = Choice(0, tok, [], prompt, tok.decode(prompt), echo)
  streamed = {"tokens": [], "text_offset": []}
  if echo:
    choice.take(PromptEvent((None,), (None,)))
  for t in gen:
    choice.take(TokenEvent(t, -1.0, ()))
    lp = choice.completion_logprobs(len(streamed["tokens"]))
    for key, got in streamed.items():
      got.extend(lp[key])
  choice.take(DoneEvent("length"))
  text = (choice.prompt_text if echo else "") + choice.stream.text
  assert text == (words if echo else words[len(tok.decode(prompt)) :])
  lp = choice.completion_logprobs()
  assert {k: lp[k] for k in streamed} == streamed
  assert "".join(lp["tokens"]) == text
  assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]


def test_the_shutdown_line_counts_only_the_requests_the_shutdown_ended(capsys, monkeypatch):
  """A request ended by a stop string is cancelled in the engine, but not by the shutdown."""
  engine = Engine(tiny_model("transformer"), slots=1, context=64)
  server = Server(engine.start(), ByteTokenizer(), model_name="m")
  body = {"prompt": "ab", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
  # The stop request may run to the end of the context, and each of its tokens gives the server
  # a moment to cancel it: the engine cannot end it by length before the stop string is seen.
  take = engine._take

  def take_slowly(state, *args, **kwargs):
    alive = take(state, *args, **kwargs)
    if alive and state.job.max_tokens > 8:
      state.job.cancelled.wait(0.05)
    return alive

  monkeypatch.setattr(engine, "_take", take_slowly)
  with ServerThread(engine, server) as thread:
    text = _post(thread.url, "/completions", body).json()["choices"][0]["text"]
    stop = text[len(text) // 2]
    r = _post(thread.url, "/completions", {**body, "max_tokens": 60, "stop": [stop]})
    r = r.json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["text"] == text[: text.index(stop)]
    wait_until(lambda: engine.load()["running"] == 0, "the slot freed")
  assert engine.counts["finished_cancelled"] == 1
  assert "stopped; 0 requests cancelled" in capsys.readouterr().err


def test_a_refused_run_directory_is_left_without_a_compile_cache(tmp_path, monkeypatch, capsys):
  """The cache is only pointed at (JAX makes it when it keeps a program): a directory that the
  model's loading refuses stays empty."""
  import jax  # pylint: disable=import-outside-toplevel

  from diffjax.serve import command  # pylint: disable=import-outside-toplevel

  used = []
  monkeypatch.setattr(command.cli, "use_compile_cache", lambda path, **kw: used.append(path))
  empty = tmp_path / "empty"
  empty.mkdir()
  before = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", None)  # as in a process that set none
  try:
    assert command.main([f"--workdir={empty}"]) == 2
  finally:
    jax.config.update("jax_compilation_cache_dir", before)
  assert "No checkpoints" in capsys.readouterr().err
  assert used == [str(empty / "compile_cache")] and list(empty.iterdir()) == []


def test_a_prompt_reads_the_names_of_the_tokenizers_special_tokens_as_those_tokens(tmp_path):
  """A chat template's markers and the eos name in a prompt are the file's special tokens
  (a corpus, prepared with ``encode``, reads them as text)."""
  pytest.importorskip("tokenizers")
  from helpers import write_bpe_tokenizer  # pylint: disable=import-outside-toplevel

  from diffjax.data import load_tokenizer  # pylint: disable=import-outside-toplevel

  raw = write_bpe_tokenizer(tmp_path / "tok.json", ["<|endoftext|>", "<|im_start|>"])
  tok = load_tokenizer(str(tmp_path / "tok.json"))
  server = Server(None, tok, model_name="m")
  marker = raw.token_to_id("<|im_start|>")
  ids = server.encode("<|im_start|>user\nhi<|endoftext|><|im_start|>")
  assert ids.count(marker) == 2 and ids.count(tok.eos_id) == 1, ids
  assert marker not in tok.encode("<|im_start|>user").tolist()
