"""``python -m diffjax.serve``: an OpenAI-compatible HTTP server for a trained run.

    python -m diffjax.serve --workdir=runs/default [--port=8000] [--host=127.0.0.1]
        [--slots=8] [--replicas=1] [--context=N] [--chat_template=FILE] [--model_name=NAME]
    python -m diffjax.serve --hf_dir=DIR ...     # an HF Llama / DiffLlama / DIFF V2 directory

Compiles every program it will run first (a run's compile_cache/ keeps them for the next start),
then serves ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` and ``/health`` until
SIGINT or SIGTERM: it stops taking requests, lets those in flight finish for ``--drain_seconds``
and cancels the rest. A mistake in the arguments is one ``error:`` line (exit 2). Requests and
every option: docs/serving.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
from collections.abc import Sequence

from diffjax import cli
from diffjax.errors import import_extra, run_guarded


def _parser() -> argparse.ArgumentParser:
  p = cli.ArgumentParser(
    prog="python -m diffjax.serve",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--workdir", help="a train.py run directory (its newest good checkpoint)")
  src.add_argument("--hf_dir", help="an HF directory (config.json, safetensors, tokenizer)")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  p.add_argument("--tokenizer", default=None, help="tokenizer spec (default: the model's own)")
  p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
  p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free one)")
  p.add_argument("--model_name", default=None, help="the model id (default: the directory name)")
  p.add_argument("--slots", type=int, default=8, help="sequences decoded together (default 8)")
  p.add_argument(
    "--context",
    type=int,
    default=None,
    help="longest prompt + new tokens (default: the run's seq_len or the HF config's "
    "max_position_embeddings, else 2048)",
  )
  p.add_argument(
    "--decode_chunk", type=int, default=4, help="decode steps per program call (default 4)"
  )
  p.add_argument(
    "--max_prefill", type=int, default=4, help="prompts prefilled in one call at most (default 4)"
  )
  p.add_argument(
    "--max_waiting",
    type=int,
    default=256,
    help="requests queued beyond the slots; more get HTTP 429 (default 256)",
  )
  p.add_argument(
    "--replicas",
    type=int,
    default=1,
    help="engines decoding at once, each on its own thread with its share of the slots "
    "(default 1; on a CPU, up to its cores for a small model)",
  )
  p.add_argument(
    "--chat_template", default=None, help="a Jinja chat template file (default: the model's own)"
  )
  p.add_argument(
    "--mesh",
    default=None,
    help="serve over a device mesh: data,fsdp,tensor sizes (e.g. 2,1,1; -1 for the rest)",
  )
  p.add_argument(
    "--compile_cache",
    default=None,
    help="a directory for JAX's persistent compilation cache, so that a restart loads the "
    "programs instead of compiling them (default: compile_cache/ in a --workdir run on a local "
    "disk, none for --hf_dir; '' for none; JAX_COMPILATION_CACHE_DIR, when set, wins)",
  )
  p.add_argument(
    "--drain_seconds",
    type=float,
    default=30.0,
    help="on SIGTERM, how long requests in flight may finish (default 30)",
  )
  return p


def build(args: argparse.Namespace, progress=print):
  """(the engine, started and warm; the HTTP server object) from parsed arguments."""
  from diffjax.generation.loading import load_model, model_tokenizer  # pylint: disable=import-outside-toplevel
  from diffjax.serve.app import Server  # pylint: disable=import-outside-toplevel
  from diffjax.serve.engine import Engine  # pylint: disable=import-outside-toplevel
  from diffjax.serve.replicas import Replicas  # pylint: disable=import-outside-toplevel

  for name in ("slots", "decode_chunk", "max_prefill", "replicas"):
    if getattr(args, name) < 1:
      raise ValueError(f"--{name}={getattr(args, name)} must be at least 1.")
  if args.context is not None and args.context < 2:
    raise ValueError(f"--context={args.context} must be at least 2 tokens.")
  if args.replicas > 1 and args.mesh:
    raise ValueError(
      f"--replicas={args.replicas} with --mesh={args.mesh!r}: a mesh shards decoding over its "
      "devices; replicas run one engine per thread on one device. Give one or the other."
    )
  if args.replicas > args.slots:
    raise ValueError(
      f"--replicas={args.replicas} with --slots={args.slots}: each replica decodes at least "
      f"one slot; raise --slots to {args.replicas} or lower --replicas."
    )
  if not 0 <= args.port < 65536:
    raise ValueError(f"--port={args.port} must be in [0, 65536).")
  template = None
  if args.chat_template is not None:
    if not os.path.isfile(args.chat_template):
      raise FileNotFoundError(
        f"--chat_template={args.chat_template!r} is not a file: pass a Jinja template file."
      )
    with open(args.chat_template, encoding="utf-8") as f:
      template = f.read()
  shape = None
  if args.mesh:
    try:
      shape = [int(x) for x in args.mesh.split(",")]
    except ValueError:
      raise ValueError(f"--mesh={args.mesh!r} must be comma-separated sizes, e.g. 2,1,1.") from None
  loaded = load_model(args.workdir, args.hf_dir, args.step)
  tokenizer = model_tokenizer(loaded, loaded.model, args.tokenizer)
  mesh = None
  if shape is not None:
    from diffjax import sharding as shd  # pylint: disable=import-outside-toplevel

    mesh = shd.make_mesh(shape)
  many = dict(replicas=args.replicas) if args.replicas > 1 else {}
  engine = (Replicas if many else Engine)(
    loaded.model,
    **many,
    slots=args.slots,
    context=args.context or loaded.context,
    decode_chunk=args.decode_chunk,
    max_waiting=args.max_waiting,
    max_prefill=args.max_prefill,
    pad_id=int(tokenizer.pad_id) if tokenizer.pad_id < loaded.model.config.vocab_size else 0,
    mesh=mesh,
  )
  name = args.model_name or os.path.basename(os.path.normpath(loaded.source))
  cfg = loaded.model.config
  progress(
    f"[{cfg.attention}{'' if loaded.step is None else f', step {loaded.step}'}] {engine.slots} "
    f"slots of {engine.context} tokens"
    + (f" in {args.replicas} replicas" if many else "")
    + f"; compiling {len(engine.program_names())} programs"
  )
  engine.warm_up(progress)
  server = Server(
    engine.start(), tokenizer, model_name=name, chat_template=template or loaded.chat_template
  )
  return engine, server


async def serve(engine, server, host: str, port: int, drain_seconds: float, ready=None) -> None:
  """Serves until SIGINT/SIGTERM (or ``ready``'s stop event), then drains: no new requests,
  those in flight finish within ``drain_seconds``, the rest are cancelled."""
  web = import_extra("aiohttp.web", "serve", "serving over HTTP")
  runner = web.AppRunner(
    server.app(), handler_cancellation=True, access_log=None, shutdown_timeout=drain_seconds
  )
  await runner.setup()
  site = web.TCPSite(runner, host, port)
  await site.start()
  bound = runner.addresses[0][1] if runner.addresses else port
  stop = asyncio.Event()
  loop = asyncio.get_running_loop()
  for sig in (signal.SIGINT, signal.SIGTERM):
    try:
      loop.add_signal_handler(sig, stop.set)
    except (NotImplementedError, RuntimeError):  # not the main thread
      pass
  print(f"serving {server.model_name!r} on http://{host}:{bound}/v1", flush=True, file=sys.stderr)
  if ready is not None:
    ready(bound, stop, loop)
  await stop.wait()
  print("shutting down: finishing requests in flight", flush=True, file=sys.stderr)
  server.draining = True
  await loop.run_in_executor(None, lambda: engine.stop(timeout=drain_seconds))
  engine.stop(cancel=True, timeout=10)
  await runner.cleanup()
  print(
    f"stopped; {engine.counts['cancelled_on_stop']} requests cancelled", flush=True, file=sys.stderr
  )


class ServerThread:
  """Serves ``server`` from a background thread (for tests, benchmarks and notebooks):
  ``url`` is the base address (``http://host:port/v1``); :meth:`close` drains and stops it.
  Also a context manager."""

  def __init__(self, engine, server, host: str = "127.0.0.1", port: int = 0, drain_seconds=5.0):
    self.engine, self.server = engine, server
    started = threading.Event()
    box = {}

    def ready(bound, stop, loop):
      box.update(port=bound, stop=stop, loop=loop)
      started.set()

    def run():
      try:
        asyncio.run(serve(engine, server, host, port, drain_seconds, ready=ready))
      except BaseException as e:  # noqa: BLE001 - reported by the constructor
        box["error"] = e
        started.set()

    self._thread = threading.Thread(target=run, name="diffjax-serve-http", daemon=True)
    self._thread.start()
    started.wait()
    if "error" in box:
      raise box["error"]
    self.port, self._stop, self._loop = box["port"], box["stop"], box["loop"]
    self.url = f"http://{host}:{self.port}/v1"

  def close(self) -> None:
    if self._thread.is_alive():
      self._loop.call_soon_threadsafe(self._stop.set)
      self._thread.join()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
    return False


def compile_cache_dir(args: argparse.Namespace) -> str | None:
  """Where the server keeps its compiled programs between starts: ``--compile_cache`` when
  given ('' for nowhere), else ``compile_cache/`` in a ``--workdir`` run directory on a local
  disk, else nowhere."""
  if args.compile_cache is not None:
    return args.compile_cache or None
  if args.workdir and "://" not in args.workdir and os.path.isdir(args.workdir):
    return os.path.join(args.workdir, "compile_cache")
  return None  # (a missing workdir is reported by the model's loading)


def _writable_cache_dir(args: argparse.Namespace, progress) -> str | None:
  """:func:`compile_cache_dir`; None (said in one line) when it cannot be written. Nothing is
  made here: JAX makes the directory when it first keeps a program, so a run directory that
  the model's loading refuses is left as it was."""
  path = compile_cache_dir(args)
  if path is None:
    return None
  if not _can_make(path):
    progress(f"not caching compiled programs: cannot write to {path} (see --compile_cache)")
    return None
  return path


def _can_make(path: str) -> bool:
  """Whether ``path`` is a writable directory, or one that can be made (its nearest existing
  parent is a writable directory)."""
  path = cli.nearest_existing(path)
  return os.path.isdir(path) and os.access(path, os.W_OK)


def _use_compile_cache(args: argparse.Namespace, progress) -> None:
  """Points JAX's persistent compilation cache at :func:`compile_cache_dir`, keeping every
  program (a server compiles the same ones at every start), unless
  ``JAX_COMPILATION_CACHE_DIR`` chose a cache."""
  import jax  # pylint: disable=import-outside-toplevel

  if jax.config.jax_compilation_cache_dir:
    return
  path = _writable_cache_dir(args, progress)
  if path is not None:
    cli.use_compile_cache(path, every_program=True)


def _main(args: argparse.Namespace) -> None:
  def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

  _use_compile_cache(args, progress)
  engine, server = build(args, progress=progress)
  asyncio.run(serve(engine, server, args.host, args.port, args.drain_seconds))


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  return run_guarded(lambda: _main(args))
