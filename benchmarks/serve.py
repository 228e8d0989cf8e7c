"""The server under N concurrent clients, next to sequential generation, in one run; then a load
run that counts lost and corrupted requests.

    python benchmarks/serve.py                                  # default size, N = 1, 8, 32
    python benchmarks/serve.py --workdir=runs/default --load_seconds=120
    pip install torch==2.13.0 && pip install -e '.[bench-torch]'  # adds transformers' row

The model: ``--workdir``'s run, else the ``--arm`` at a named ``--size`` (default ``default``:
configs/default.py's model, byte vocabulary) with random weights (speed does not depend on
them), float32. Every request is a random prompt of ``--prompt`` token ids and asks for
``--new`` tokens, greedy, without stopping at the end-of-text token.

Peers, timed on the same requests:

- ``server, N clients``: ``python -m diffjax.serve`` in its own process (continuous batching
  over ``--slots`` slots) serving the model exported to a temporary directory (or the run),
  with N clients (aiohttp, in this process, one connection each) each sending its share of the
  requests one after the other;
- ``engine in this process, N jobs at a time``: the server's engine (the same options) without
  HTTP, in this process, N requests in flight, each replaced as it ends: what the model's
  programs and the scheduler give by themselves, so the gap to the server rows is HTTP, the
  clients and the second process;
- ``diffjax.generate, one at a time``: each request alone through ``diffjax.generate`` (what a
  server without batching does);
- ``transformers generate, one at a time``: the model exported (``save_hf``) and loaded by
  transformers (DIFF V2 through the export's own code, ``trust_remote_code=True``), each
  request through ``generate`` in a child process (torch's CPU build; skipped when torch or
  transformers is not installed).

Warm-up requests run before timing (the server compiles everything at start). Each peer but
transformers runs ``--repeat`` times (default 5), the peers in turn, and its row is its median
run, so that a slow spell of a shared machine does not land on one peer alone; the runs' new
tokens/s are listed under the table, and the 8-client server's gain over each peer is also given
run by run (each repeat's 8-client run against the same repeat's peer, run seconds apart). The table gives requests/s, new tokens/s and per-request
latency percentiles; a second table times one call of
the engine's decode program for a few (rows, cache slots read), measured before the server
starts, which shows what batching can gain on the machine; then the ratio of the server's new
tokens/s with 8 clients to the two sequential ways of serving: the same server with one client,
and ``diffjax.generate`` one request at a time; and the same ratio for the engine without HTTP.

The load run (``--load_seconds``, 0 to skip) then sends for that long, from 32 clients, requests
of random prompts (1-96 tokens), random ``max_tokens`` and sometimes a stop string, a third of
them streamed and some of those dropped mid-stream by the client. Every answer that completes is
checked against the same request's greedy tokens from ``diffjax.generate`` alone; the output
counts requests sent, completed, dropped by clients, failed and corrupted, and checks that no
slot is left held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

VOCAB = 258
EOS = 256


def _requests(count: int, prompt: int, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, prompt).tolist() for _ in range(count)]


def _cpu_model() -> str:
  """The host CPU's model name as Linux reports it (a ratio here depends on the machine)."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return "model unknown"


def _model(args):
  """(model, where it came from)."""
  if args.workdir:
    from diffjax.generation.loading import load_model  # pylint: disable=import-outside-toplevel

    loaded = load_model(args.workdir)
    return loaded.model, f"run {args.workdir} (step {loaded.step})"
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from diffjax.model import DecoderLM, ModelConfig, matched_configs  # pylint: disable=import-outside-toplevel
  from diffjax.model.sizes import size_widths  # pylint: disable=import-outside-toplevel

  base = ModelConfig(attention="transformer", vocab_size=VOCAB, **size_widths(args.size))
  return DecoderLM(matched_configs(base)[args.arm], rngs=nnx.Rngs(0)), (
    f"{args.arm} at size {args.size}, random weights"
  )


async def _clients(url: str, prompts, n_clients: int, new: int) -> tuple[float, list[float]]:
  """(wall seconds, per-request latencies) of ``prompts`` shared among ``n_clients`` clients."""
  import aiohttp  # pylint: disable=import-outside-toplevel

  queue = list(enumerate(prompts))
  latencies: list[float] = []

  async def client(session):
    while queue:
      _, ids = queue.pop()
      body = {"prompt": ids, "max_tokens": new, "temperature": 0, "ignore_eos": True}
      t0 = time.perf_counter()
      async with session.post(f"{url}/completions", json=body) as r:
        out = await r.json()
      assert r.status == 200, out
      assert out["usage"]["completion_tokens"] == new, out["usage"]
      latencies.append(time.perf_counter() - t0)

  timeout = aiohttp.ClientTimeout(total=None)
  async with aiohttp.ClientSession(timeout=timeout) as session:
    t0 = time.perf_counter()
    await asyncio.gather(*(client(session) for _ in range(n_clients)))
    return time.perf_counter() - t0, latencies


def _row(name, wall, latencies, new) -> str:
  n = len(latencies)
  q = np.percentile(latencies, [50, 90, 99]) if latencies else [float("nan")] * 3
  return (
    f"| {name} | {n} | {n / wall:,.2f} | {n * new / wall:,.0f} | "
    f"{q[0] * 1e3:,.0f} | {q[1] * 1e3:,.0f} | {q[2] * 1e3:,.0f} |"
  )


def _torch_child(path: str, prompts, new: int) -> str:
  """transformers' row, timed in a child process (torch and JAX never share one)."""
  code = f"""
import json, sys, time
import numpy as np, torch, transformers
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({path!r}, trust_remote_code=True).float().eval()
prompts = json.loads(sys.stdin.read())
def one(ids):
  x = torch.tensor([ids])
  with torch.inference_mode():
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens={new},
                         min_new_tokens={new}, do_sample=False, pad_token_id=0)
  assert out.shape[1] == len(ids) + {new}
for ids in prompts[:2]:
  one(ids)
lat = []
t0 = time.perf_counter()
for ids in prompts:
  t1 = time.perf_counter(); one(ids); lat.append(time.perf_counter() - t1)
print(json.dumps({{"wall": time.perf_counter() - t0, "lat": lat,
  "versions": f"torch {{torch.__version__}}, transformers {{transformers.__version__}}"}}))
"""
  proc = subprocess.run(
    [sys.executable, "-c", code], input=json.dumps(prompts), capture_output=True, text=True
  )
  if proc.returncode:
    raise RuntimeError(proc.stderr[-3000:])
  return json.loads(proc.stdout.strip().splitlines()[-1])


async def _load_run(url, references, seconds: float, n_clients: int, seed: int):
  """Random requests for ``seconds`` over ``references`` ((prompt ids, greedy tokens) pairs);
  counts of what happened to them."""
  import aiohttp  # pylint: disable=import-outside-toplevel

  from diffjax.data import ByteTokenizer  # pylint: disable=import-outside-toplevel

  tok = ByteTokenizer()
  rng = random.Random(seed)
  counts = dict(sent=0, completed=0, streamed=0, dropped=0, failed=0, corrupted=0)
  failures: list[str] = []
  stops = ["\n", "e", "ab", "xyz"]
  deadline = time.perf_counter() + seconds

  def expected(p, k, stop):
    tokens = references[p][1][:k]
    text = tok.decode(tokens)
    if stop is not None and stop in text:
      return text[: text.index(stop)], None
    return text, len(tokens)

  async def one(session):
    p = rng.randrange(len(references))
    k = rng.choice([1, 3, 8, 32, 64])
    stop = rng.choice(stops) if rng.random() < 0.3 else None
    stream = rng.random() < 0.35
    drop_after = rng.randrange(1, 6) if stream and rng.random() < 0.4 else None
    body = {"prompt": references[p][0], "max_tokens": k, "temperature": 0}
    if stop is not None:
      body["stop"] = stop
    if stream:
      body["stream"] = True
      body["stream_options"] = {"include_usage": True}
    counts["sent"] += 1
    want_text, want_tokens = expected(p, k, stop)
    try:
      async with session.post(f"{url}/completions", json=body) as r:
        if r.status != 200:
          counts["failed"] += 1
          failures.append(f"{r.status}: {await r.text()}")
          return
        if not stream:
          out = await r.json()
          text, made = out["choices"][0]["text"], out["usage"]["completion_tokens"]
        else:
          counts["streamed"] += 1
          pieces, made, events = [], None, 0
          async for line in r.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
              continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
              pieces.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
              made = chunk["usage"]["completion_tokens"]
            events += 1
            if drop_after is not None and events >= drop_after:
              counts["dropped"] += 1
              return  # leaving the block closes the connection mid-stream
          text = "".join(pieces)
    except (TimeoutError, aiohttp.ClientError) as e:
      counts["failed"] += 1
      failures.append(repr(e))
      return
    counts["completed"] += 1
    if text != want_text or (want_tokens is not None and made != want_tokens):
      counts["corrupted"] += 1
      failures.append(f"prompt {p} max_tokens {k} stop {stop!r}: {text!r} != {want_text!r}")

  async def client(session):
    while time.perf_counter() < deadline:
      await one(session)

  timeout = aiohttp.ClientTimeout(total=None)
  async with aiohttp.ClientSession(timeout=timeout) as session:
    await asyncio.gather(*(client(session) for _ in range(n_clients)))
  # Every slot is free once the last dropped stream is noticed.
  for _ in range(200):
    health = _health(url)
    if health["running"] == 0 and health["waiting"] == 0:
      break
    await asyncio.sleep(0.05)
  counts["slots held after"] = health["running"] + health["waiting"]
  return counts, failures


def _decode_program_times(engine, chunk: int) -> list[str]:
  """Table rows: the time of one call of ``engine``'s decode program (not started yet) for some
  (rows, cache slots read), median of 20 calls after one."""
  import jax  # pylint: disable=import-outside-toplevel

  out, per_call = [], {}
  for rows in sorted({1, min(8, engine.slots), engine.slots}):
    for window in engine.windows:
      program = engine._program(("decode", rows, window))  # pylint: disable=protected-access
      args = [np.zeros(rows, np.int32), np.full(rows, 40, np.int32), np.ones(rows, bool)]
      args += [np.zeros(rows, np.int32), np.zeros(rows, np.float32), np.zeros(rows, np.int32)]
      args += [np.ones(rows, np.float32), np.zeros(rows, np.int32)]
      times = []
      for _ in range(21):
        t0 = time.perf_counter()
        engine._cache, got = program(engine._leaves, engine._cache, *args)  # pylint: disable=protected-access
        jax.block_until_ready(got)
        times.append(time.perf_counter() - t0)
      ms = statistics.median(times[1:]) * 1e3
      out.append(f"| {rows} | {window} | {ms:.2f} | {rows * chunk / ms * 1e3:,.0f} |")
      per_call[rows, window] = ms
  if engine.slots >= 8:  # the machine's side of what 8 clients can gain over one
    out.append("")
    for window in engine.windows:
      gain = 8 * per_call[1, window] / per_call[8, window]
      out.append(f"8 rows / 1 row, {window} cache slots read: {gain:.2f}x the tokens/s of a call")
  return out


def _engine_run(engine, prompts, n_jobs: int, new: int) -> tuple[float, list[float]]:
  """(wall seconds, per-request latencies) of ``prompts`` through a started ``engine`` in this
  process, no HTTP: ``n_jobs`` in flight, each replaced as it ends (the closed loop of the
  clients)."""
  from diffjax.serve.engine import DoneEvent, Job  # pylint: disable=import-outside-toplevel

  queue, lock, done = list(prompts), threading.Lock(), threading.Event()
  latencies: list[float] = []
  failures: list[str] = []

  def submit() -> None:
    with lock:
      if not queue:
        return
      ids = queue.pop()
    t0, tokens = time.perf_counter(), [0]

    def on_event(event) -> None:  # the engine's thread
      if not isinstance(event, DoneEvent):
        tokens[0] += 1
        return
      if event.reason != "length" or tokens[0] != new:
        failures.append(f"{event.reason} after {tokens[0]} tokens {event.message}")
        done.set()  # no more submissions: the run is reported as failed
        return
      latencies.append(time.perf_counter() - t0)
      if len(latencies) == len(prompts):
        done.set()
      submit()

    engine.submit(Job(prompt=ids, max_tokens=new, on_event=on_event))

  t0 = time.perf_counter()
  for _ in range(n_jobs):
    submit()
  done.wait()
  assert not failures, failures[:3]
  return time.perf_counter() - t0, latencies


def _start_server(args, path_flag: str, context: int):
  """``python -m diffjax.serve`` in a child process: (process, base url, warm-up line)."""
  import re  # pylint: disable=import-outside-toplevel

  cmd = [sys.executable, "-m", "diffjax.serve", path_flag, "--port=0", "--model_name=bench"]
  cmd += [f"--slots={args.slots}", f"--context={context}", f"--decode_chunk={args.decode_chunk}"]
  cmd += [f"--replicas={args.replicas}"]
  proc = subprocess.Popen(
    cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}
  )
  lines = []
  for line in proc.stderr:
    lines.append(line.rstrip())
    found = re.search(r"on (http://127\.0\.0\.1:\d+/v1)", line)
    if found:
      threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
      compiled = sum("compiled " in x for x in lines)
      seconds = sum(
        float(re.search(r"in ([\d.]+) s", x).group(1)) for x in lines if "compiled " in x
      )
      return proc, found.group(1), f"the server compiled its {compiled} programs in {seconds:.1f} s"
  raise RuntimeError("the server did not start:\n" + "\n".join(lines[-20:]))


def _health(url: str) -> dict:
  import urllib.request  # pylint: disable=import-outside-toplevel

  with urllib.request.urlopen(url[: -len("/v1")] + "/health", timeout=30) as r:
    return json.loads(r.read())


def main() -> None:
  p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
  p.add_argument("--workdir", default=None, help="a train.py run (default: random weights)")
  p.add_argument("--arm", default="diff_v1", help="with random weights: the arm")
  p.add_argument("--size", default="default", help="with random weights: the size")
  p.add_argument("--clients", default="1,8,32", help="comma-separated concurrent clients")
  p.add_argument("--requests", type=int, default=64, help="timed requests per run")
  p.add_argument("--repeat", type=int, default=5, help="runs per peer, in turn (a row: the median)")
  p.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
  p.add_argument("--new", type=int, default=64, help="new tokens per request")
  p.add_argument("--slots", type=int, default=32, help="the server's slots")
  p.add_argument("--context", type=int, default=256, help="the server's context")
  p.add_argument("--decode_chunk", type=int, default=4, help="the server's decode steps per call")
  p.add_argument(
    "--replicas", type=int, default=1, help="the server's engines decoding at once (threads)"
  )
  p.add_argument("--load_seconds", type=float, default=120.0, help="the load run (0: none)")
  p.add_argument("--no_torch", action="store_true", help="leave out transformers' row")
  a = p.parse_args()
  if a.repeat < 1 or a.requests < 1:
    p.error(f"--repeat={a.repeat} and --requests={a.requests} must be at least 1.")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax  # pylint: disable=import-outside-toplevel

  import diffjax  # pylint: disable=import-outside-toplevel
  from diffjax.convert import save_hf  # pylint: disable=import-outside-toplevel
  from diffjax.data import ByteTokenizer  # pylint: disable=import-outside-toplevel

  model, source = _model(a)
  context = a.context
  from diffjax.serve import Engine, Replicas  # pylint: disable=import-outside-toplevel

  one = Engine(model, slots=a.slots, context=context, decode_chunk=a.decode_chunk)
  one.warm_up()
  program_rows = _decode_program_times(one, a.decode_chunk)
  engine = one
  if a.replicas > 1:  # the engine peer as the server runs it
    engine = Replicas(
      model, replicas=a.replicas, slots=a.slots, context=context, decode_chunk=a.decode_chunk
    )
    engine.warm_up()
  engine.start()
  prompts = _requests(a.requests, a.prompt, seed=0)
  load = os.getloadavg()[0]
  rows = []
  tmp = tempfile.TemporaryDirectory()
  export = os.path.join(tmp.name, "export")
  save_hf(model, export, max_position_embeddings=context, tokenizer=ByteTokenizer())
  flag = f"--workdir={a.workdir}" if a.workdir else f"--hf_dir={export}"
  server, url, warm = _start_server(a, flag, context)
  try:
    asyncio.run(_clients(url, prompts[:4], 4, a.new))  # the HTTP path once before timing
    for ids in prompts[:2]:
      diffjax.generate(model, [ids], max_new_tokens=a.new, preflight=False)
    # Each peer runs --repeat times, the peers in turn, so that a slow spell of the machine
    # falls on all of them; a row is the peer's median run.
    runs: dict[str, list] = {}
    for _ in range(a.repeat):
      for n in [int(x) for x in a.clients.split(",")]:
        wall, lat = asyncio.run(_clients(url, prompts, n, a.new))
        runs.setdefault(f"server, {n} client{'s' if n > 1 else ''}", []).append((wall, lat))
      for n in [int(x) for x in a.clients.split(",")]:  # the server idles meanwhile
        got = _engine_run(engine, prompts, n, a.new)
        runs.setdefault(
          f"engine in this process, {n} job{'s' if n > 1 else ''} at a time", []
        ).append(got)
      # The sequential diffjax.generate peer (the server idles meanwhile).
      lat, t0 = [], time.perf_counter()
      for ids in prompts:
        t1 = time.perf_counter()
        out = diffjax.generate(model, [ids], max_new_tokens=a.new, preflight=False)
        assert len(out.tokens[0]) == a.new
        lat.append(time.perf_counter() - t1)
      runs.setdefault("diffjax.generate, one at a time", []).append((time.perf_counter() - t0, lat))
    spread = {}
    for name, got in runs.items():
      got = sorted(got, key=lambda r: r[0])  # by wall time: the same requests every run
      rows.append((name, *got[len(got) // 2]))
      spread[name] = [len(lat) * a.new / wall for wall, lat in got]
    versions = f"jax {jax.__version__}"
    if not a.no_torch:
      try:
        import torch  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
        import transformers  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
      except ImportError:
        rows.append(("transformers generate: not installed (pip install -e '.[bench-torch]')",))
      else:
        got = _torch_child(export, prompts, a.new)
        rows.append(("transformers generate, one at a time", got["wall"], got["lat"]))
        versions += f", {got['versions']}"
    print(
      f"{source}; {versions}; {os.cpu_count()} CPUs ({_cpu_model()}), load average {load:.2f} at the start, "
      f"{os.getloadavg()[0]:.2f} at the end; {a.requests} requests of {a.prompt} prompt tokens "
      f"and {a.new} new tokens, greedy, float32; the server in its own process, {a.slots} slots, "
      f"decode chunk {a.decode_chunk}, {a.replicas} replica{'s' * (a.replicas > 1)}; {warm} before timing"
    )
    print(
      "| peer | requests | requests/s | new tokens/s | p50 latency (ms) | p90 (ms) | p99 (ms) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
      print(_row(*row, a.new) if len(row) == 3 else f"| {row[0]} | | | | | | |")
    print(f"\nOne call of the engine's decode program ({a.decode_chunk} steps), in this process:")
    print("| rows | cache slots read | ms per call | tokens/s of the call |")
    print("|---|---|---|---|")
    print("\n".join(program_rows))
    if a.repeat > 1:
      print(f"\nNew tokens/s of each of the {a.repeat} runs (the table gives the median):")
      for name, rates in spread.items():
        print(f"- {name}: " + ", ".join(f"{r:,.0f}" for r in sorted(rates, reverse=True)))
    rate = {name: len(lat) * a.new / wall for name, wall, lat in (r for r in rows if len(r) == 3)}
    engine8, engine1 = (
      "engine in this process, 8 jobs at a time",
      "engine in this process, 1 job at a time",
    )
    pairs = [
      ("server, 8 clients", p) for p in ("server, 1 client", "diffjax.generate, one at a time")
    ]
    for eight, peer in [*pairs, (engine8, engine1)]:
      if eight in rate and peer in rate:
        # Run by run: each repeat's 8-client run against the same repeat's peer.
        paired = [
          len(lat8) * w / (len(lat) * w8) for (w8, lat8), (w, lat) in zip(runs[eight], runs[peer])
        ]
        print(
          f"{eight} / {peer}: {rate[eight] / rate[peer]:.2f}x "
          f"new tokens/s (median runs); run by run "
          + ", ".join(f"{x:.2f}x" for x in paired)
          + f" (median {statistics.median(paired):.2f}x)"
        )
    if a.load_seconds > 0:
      # Prompts of random lengths and their greedy tokens, each from diffjax.generate alone.
      rng = np.random.default_rng(2)
      refs = []
      for n in rng.integers(1, 97, 12):
        ids = rng.integers(0, 256, int(n)).tolist()
        refs.append(
          (
            ids,
            diffjax.generate(
              model, [ids], max_new_tokens=64, stop_tokens=[EOS], preflight=False
            ).tokens[0],
          )
        )
      t0 = time.perf_counter()
      counts, failures = asyncio.run(_load_run(url, refs, a.load_seconds, 32, seed=3))
      print(
        f"load run: {time.perf_counter() - t0:.0f} s, 32 clients: "
        + ", ".join(f"{k} {v}" for k, v in counts.items())
      )
      for line in failures[:10]:
        print("  ", line)
  finally:
    engine.stop(cancel=True)
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=120)
    tmp.cleanup()


if __name__ == "__main__":
  main()
