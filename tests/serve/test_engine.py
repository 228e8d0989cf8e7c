"""The continuous-batching engine against :func:`diffjax.generate` and the plain forward.

More jobs than slots, of mixed lengths, so rows are refilled while others decode; every arm's
cache (DIFF V1: K1, K2 and a 2d-wide V) goes through the same slot writes.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_model

from diffjax.generation import generate
from diffjax.serve import (
  ContextTooLong,
  DoneEvent,
  Engine,
  EngineStopped,
  Job,
  PromptEvent,
  QueueFull,
  Replicas,
  TokenEvent,
)

EOS = 256


class Collect:
  """Events of several jobs; ``wait`` blocks until all are done."""

  def __init__(self):
    self.tokens, self.logprobs, self.prompt, self.done = {}, {}, {}, {}
    self._all = threading.Condition()

  def job(self, key, prompt, **kw) -> Job:
    self.tokens[key], self.logprobs[key] = [], []

    def on_event(ev):
      if isinstance(ev, TokenEvent):
        self.tokens[key].append(ev.token)
        self.logprobs[key].append((ev.logprob, ev.top))
      elif isinstance(ev, PromptEvent):
        self.prompt[key] = ev
      else:
        assert isinstance(ev, DoneEvent)
        with self._all:
          self.done[key] = ev
          self._all.notify_all()

    return Job(prompt, on_event=on_event, **kw)

  def wait(self, n: int, timeout: float = 120) -> None:
    with self._all:
      assert self._all.wait_for(lambda: len(self.done) >= n, timeout), self.done


def _prompts(n, seed=0, longest=40):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, size=int(k)).tolist() for k in rng.integers(1, longest, size=n)]


# Each arm with the CPU's default cache (head-major), and DIFF V1 with the sequence-major one
# the TPU and GPU decode kernels read.
@pytest.fixture(
  scope="module",
  params=[
    ("transformer", None),
    ("diff_v1", None),
    ("diff_v2", None),
    ("diff_v1", "sequence_major"),
  ],
)
def warm(request):
  arm, layout = request.param
  model = tiny_model(arm)
  engine = Engine(model, slots=3, context=64, decode_chunk=3, cache_layout=layout)
  assert engine.cache_layout == (layout or "head_major")
  engine.warm_up()
  engine.start()
  yield model, engine
  engine.stop(cancel=True)


class Compiles:
  """Counts XLA backend compiles in the process while it is open."""

  def __enter__(self):
    self.names = []
    self._listen = lambda name, *a, **k: (
      self.names.append(name) if name.endswith("backend_compile_duration") else None
    )
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listen)


def test_greedy_jobs_through_refilled_slots_equal_generate_and_compile_nothing(warm):
  model, engine = warm
  before = engine.compiles
  prompts = _prompts(8)
  lengths = [5, 17, 1, 9, 23, 2, 12, 7]
  got = Collect()
  with Compiles() as compiles:
    for i, (p, n) in enumerate(zip(prompts, lengths)):
      engine.submit(got.job(i, p, max_tokens=n, stop_tokens=frozenset({EOS})))
    got.wait(len(prompts))
    assert engine.compiles == before and not compiles.names  # nothing compiled once warm
    jax.jit(lambda x: x * 3 + len(prompts))(jnp.ones(7)).block_until_ready()
    assert compiles.names  # the count sees a compile when there is one
  for i, (p, n) in enumerate(zip(prompts, lengths)):
    want = generate(model, [p], max_new_tokens=n, stop_tokens=[EOS], preflight=False)
    assert got.tokens[i] == want.tokens[0], i
    assert got.done[i].reason == ("stop" if want.stopped[0] else "length")


def test_echo_scores_the_prompt_as_the_plain_forward(warm):
  model, engine = warm
  prompt = _prompts(1, seed=3, longest=30)[0] + [1, 2, 3]
  got = Collect()
  engine.submit(got.job(0, prompt, max_tokens=1, echo=True, top_logprobs=2))
  got.wait(1)
  logp = np.asarray(
    jax.nn.log_softmax(model(jnp.asarray([prompt], jnp.int32)).astype(jnp.float32), axis=-1)
  )[0]
  event = got.prompt[0]
  assert event.logprobs[0] is None and event.top[0] is None
  want = [logp[t - 1, prompt[t]] for t in range(1, len(prompt))]
  np.testing.assert_allclose(event.logprobs[1:], want, rtol=1e-5, atol=1e-6)
  for t in range(1, len(prompt)):
    ids = [i for i, _ in event.top[t]]
    assert ids == list(np.argsort(-logp[t - 1], kind="stable")[:2])
  ((lp, top),) = got.logprobs[0]
  np.testing.assert_allclose(lp, logp[-1, got.tokens[0][0]], rtol=1e-5)
  assert top[0][1] == lp == max(v for _, v in top)  # greedy: the token is the top entry


def test_a_sampled_job_does_not_depend_on_its_neighbours(warm):
  _, engine = warm
  prompt = [10, 20, 30, 40]
  options = dict(max_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=7)
  alone = Collect()
  engine.submit(alone.job(0, prompt, **options))
  alone.wait(1)
  crowd = Collect()
  for i, p in enumerate(_prompts(5, seed=1)):
    engine.submit(crowd.job(i, p, max_tokens=9, temperature=1.0, seed=i))
  engine.submit(crowd.job("same", prompt, **options))
  engine.submit(crowd.job("other seed", prompt, **{**options, "seed": 8}))
  crowd.wait(7)
  assert crowd.tokens["same"] == alone.tokens[0]
  assert crowd.tokens["other seed"] != alone.tokens[0]


def test_top_k_1_samples_the_greedy_token(warm):
  _, engine = warm
  prompt = [5, 6, 7]
  got = Collect()
  engine.submit(got.job("greedy", prompt, max_tokens=8))
  engine.submit(got.job("top1", prompt, max_tokens=8, temperature=2.0, top_k=1, seed=3))
  got.wait(2)
  assert got.tokens["top1"] == got.tokens["greedy"]


def test_a_cancelled_job_frees_its_slot_and_waiting_jobs_run():
  model = tiny_model("diff_v1")
  # A job long enough to be in flight while the checks run (2,000 tokens, a program call per
  # token, the larger cache windows compiled as it reaches them).
  engine = Engine(model, slots=1, context=2100, decode_chunk=1, max_waiting=1).start()
  try:
    got = Collect()
    first_token = threading.Event()
    long = got.job("long", [1, 2, 3], max_tokens=2000)
    inner = long.on_event

    def on_event(ev):
      inner(ev)
      first_token.set()

    long.on_event = on_event
    engine.submit(long)
    engine.submit(got.job("next", [4, 5], max_tokens=3))
    with pytest.raises(QueueFull, match="retry later"):
      engine.submit(got.job("too many", [4], max_tokens=3))
    assert first_token.wait(60)
    long.cancel()
    got.wait(2)
    assert got.done["long"].reason == "cancelled" and len(got.tokens["long"]) < 2000
    assert got.done["next"].reason == "length" and len(got.tokens["next"]) == 3
    assert engine.load()["running"] == 0
  finally:
    engine.stop(cancel=True)


def test_bad_jobs_are_refused_before_they_queue():
  with pytest.raises(ValueError, match="cache_layout='bsk'.*head_major"):
    Engine(tiny_model("transformer"), slots=1, context=16, cache_layout="bsk")
  engine = Engine(tiny_model("transformer"), slots=1, context=16)
  job = lambda prompt, **kw: Job(prompt, on_event=lambda ev: None, **kw)  # noqa: E731
  with pytest.raises(ContextTooLong, match="context is 16 tokens; the prompt has 10"):
    engine.submit(job(list(range(10)), max_tokens=7))
  for bad, needle in (
    (job([], max_tokens=1), "prompt is empty"),
    (job([1], max_tokens=-1), "max_tokens=-1"),
    (job([1], max_tokens=0), "ask for echo"),
    (job([300], max_tokens=1), "in [0, 258)"),
    (job([1], max_tokens=1, top_logprobs=6), "between 0 and 5"),
    (job([1], max_tokens=1, top_p=0.0), "top_p=0.0"),
    (job([1], max_tokens=1, temperature=-1.0), "temperature=-1.0"),
  ):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace(")", r"\)")):
      engine.submit(bad)
  assert engine.load()["waiting"] == 0


def test_on_a_mesh_the_slots_are_split_over_data_and_the_tokens_are_the_same():
  from diffjax import sharding as shd  # pylint: disable=import-outside-toplevel

  model = tiny_model("diff_v1")
  prompts, lengths = _prompts(5, seed=4), [6, 3, 9, 4, 7]
  shape = (2, 1, 1)
  mesh = shd.make_mesh(shape, jax.devices()[:2])
  engine = Engine(model, slots=3, context=64, decode_chunk=2, mesh=mesh).start()
  try:
    assert engine.slots % shape[0] == 0
    got = Collect()
    for i, (p, n) in enumerate(zip(prompts, lengths)):
      engine.submit(got.job(i, p, max_tokens=n))
    got.wait(len(prompts))
    leaf = jax.tree.leaves(engine._cache)[0]
    assert len(leaf.sharding.device_set) == int(np.prod(shape))
  finally:
    engine.stop(cancel=True)
  for i, (p, n) in enumerate(zip(prompts, lengths)):
    assert got.tokens[i] == generate(model, [p], max_new_tokens=n, preflight=False).tokens[0]


def test_a_failing_program_ends_every_job_with_an_error_instead_of_hanging(monkeypatch):
  engine = Engine(tiny_model("transformer"), slots=1, context=32)

  def broken(name):
    raise RuntimeError(f"no program {name[0]}")

  monkeypatch.setattr(engine, "_program", broken)
  got = Collect()
  engine.submit(got.job("a", [1, 2], max_tokens=3))
  engine.submit(got.job("b", [3], max_tokens=3))
  engine.start()
  got.wait(2, timeout=30)
  assert {d.reason for d in got.done.values()} == {"error"}
  assert "no program prefill" in got.done["a"].message and "no program" in engine.error


def test_a_job_being_prefilled_holds_its_slot_against_new_jobs():
  """The first token is handed out during the prefill, before the job sits in its slot: a job
  submitted from that moment on must still find the one slot taken."""
  engine = Engine(tiny_model("transformer"), slots=1, context=64, max_waiting=0).start()
  try:
    got, refused = Collect(), []
    first = got.job("first", [1, 2], max_tokens=30)
    inner = first.on_event

    def on_event(ev):
      if isinstance(ev, TokenEvent) and not refused:
        try:
          engine.submit(Job([3], max_tokens=1, on_event=lambda e: None))
        except QueueFull as e:
          refused.append(str(e))
        else:
          refused.append(None)
      inner(ev)

    first.on_event = on_event
    engine.submit(first)
    got.wait(1)
    assert refused and refused[0] is not None and "retry later" in refused[0]
    assert engine.load() == {"running": 0, "waiting": 0, "slots": 1}
  finally:
    engine.stop(cancel=True)


@pytest.mark.parametrize("arm", ["gda_v1", "gda_v2"])
def test_grouped_differential_arms_decode_through_the_slots_as_generate(arm):
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from diffjax.model import DecoderLM, ModelConfig  # pylint: disable=import-outside-toplevel

  cfg = ModelConfig(
    attention=arm,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=1,
    head_dim=8,
    mlp_dim=64,
    vocab_size=258,
  )
  model = DecoderLM(cfg, rngs=nnx.Rngs(0))
  engine = Engine(model, slots=2, context=64).start()
  try:
    prompts = [[1, 2, 3], list(range(10, 40)), [7]]
    got = Collect()
    for i, p in enumerate(prompts):
      engine.submit(got.job(i, p, max_tokens=9))
    got.wait(len(prompts))
  finally:
    engine.stop(cancel=True)
  for i, p in enumerate(prompts):
    assert got.tokens[i] == generate(model, [p], max_new_tokens=9, preflight=False).tokens[0]


def test_a_job_left_in_a_high_slot_moves_down_so_steps_read_only_the_rows_in_use():
  model = tiny_model("diff_v1")
  engine = Engine(model, slots=4, context=64, decode_chunk=2)
  engine.warm_up()
  called = []
  program = engine._program  # pylint: disable=protected-access
  engine._program = lambda name: called.append(name) or program(name)  # pylint: disable=protected-access
  prompts, lengths = _prompts(3, seed=7), [2, 3, 21]
  got = Collect()
  for i, (p, n) in enumerate(zip(prompts, lengths)):  # queued together: slots 0, 1 and 2
    engine.submit(got.job(i, p, max_tokens=n))
  engine.start()
  try:
    got.wait(3)
  finally:
    engine.stop(cancel=True)
  # Once the jobs of slots 0 and 1 ended, the last one moved to slot 0 and the steps after it
  # read one row, not the four that reach slot 2.
  assert engine.counts["moves"] == 1
  moved = called.index(("move",))
  rows = [name[1] for name in called if name[0] == "decode"]
  assert max(rows) == 4 and all(name[1] == 1 for name in called[moved + 1 :]), called
  for i, (p, n) in enumerate(zip(prompts, lengths)):
    want = generate(model, [p], max_new_tokens=n, preflight=False)
    assert got.tokens[i] == want.tokens[0], i


def test_a_job_submitted_as_another_ends_finds_its_slot_free():
  """A closed-loop client (or a replica chosen by load) submits on hearing a job end: the
  engine frees the slot before it tells."""
  model = tiny_model("diff_v1")
  engine = Engine(model, slots=1, context=64, decode_chunk=2, max_waiting=0)
  engine.warm_up()
  engine.start()
  seen, done = [], threading.Event()

  def on_event(ev):
    if isinstance(ev, DoneEvent):
      seen.append(engine.load())
      done.set()

  try:
    engine.submit(Job(_prompts(1)[0], max_tokens=3, on_event=on_event))
    assert done.wait(120)
    done.clear()
    engine.submit(Job(_prompts(1)[0], max_tokens=0, echo=True, on_event=on_event))  # prefill only
    assert done.wait(120)
  finally:
    engine.stop(cancel=True)
  assert [(s["running"], s["waiting"]) for s in seen] == [(0, 0), (0, 0)]


def test_replicas_share_one_set_of_programs_spread_the_jobs_and_equal_generate():
  model = tiny_model("diff_v1")
  pool = Replicas(model, replicas=2, slots=3, context=64, decode_chunk=3, max_waiting=8)
  first, second = pool.engines
  assert pool.slots == 4 and first.slots == second.slots == 2 and first.max_waiting == 4
  pool.warm_up()
  assert first.compiles == len(pool.program_names()) and second.compiles == 0
  pool.start()
  prompts, lengths = _prompts(8, seed=5), [5, 17, 1, 9, 23, 2, 12, 7]
  got = Collect()
  try:
    with Compiles() as compiles:
      for i, (p, n) in enumerate(zip(prompts, lengths)):
        pool.submit(got.job(i, p, max_tokens=n, stop_tokens=frozenset({EOS})))
      got.wait(len(prompts))
      assert not compiles.names and pool.compiles == len(pool.program_names())
    # Each job went to the replica with fewer jobs: both decoded some.
    assert min(e.counts["submitted"] for e in pool.engines) >= 2
    assert pool.counts["submitted"] == len(prompts) and pool.load()["running"] == 0
  finally:
    pool.stop(cancel=True)
  for i, (p, n) in enumerate(zip(prompts, lengths)):
    want = generate(model, [p], max_new_tokens=n, stop_tokens=[EOS], preflight=False)
    assert got.tokens[i] == want.tokens[0], i


def test_replicas_stop_cancels_in_flight_jobs_on_every_replica_and_refuse_bad_options():
  model = tiny_model("transformer")
  pool = Replicas(model, replicas=2, slots=2, context=2100, decode_chunk=1).start()
  got, started = Collect(), {"a": threading.Event(), "b": threading.Event()}
  for key, first_token in started.items():
    job = got.job(key, [1, 2, 3], max_tokens=2000)
    inner = job.on_event
    job.on_event = lambda ev, inner=inner, first_token=first_token: (inner(ev), first_token.set())
    pool.submit(job)
  assert all(first_token.wait(60) for first_token in started.values())  # both jobs in flight
  assert all(e.load()["running"] == 1 for e in pool.engines)  # one long job on each
  pool.stop(cancel=True, timeout=60)
  got.wait(2)
  assert {d.reason for d in got.done.values()} == {"cancelled"}
  with pytest.raises(EngineStopped):
    pool.submit(got.job("late", [1], max_tokens=1))
  for bad, needle in ((0, "replicas=0"), (True, "replicas=True"), (1.5, "replicas=1.5")):
    with pytest.raises(ValueError, match=needle):
      Replicas(model, replicas=bad, slots=2, context=16)
  with pytest.raises(ValueError, match="drop the mesh or the replicas"):
    Replicas(model, replicas=2, slots=2, context=16, mesh=object())
  with pytest.raises(ValueError, match="give at least 3 slots or at most 2 replicas"):
    Replicas(model, replicas=3, slots=2, context=16)


def test_jobs_cancelled_while_waiting_give_up_their_places():
  """Jobs queued before the engine starts: one cancelled frees its place at once (not when the
  engine reaches it) and hears that it was cancelled; the others run."""
  engine = Engine(tiny_model("transformer"), slots=1, context=32, max_waiting=1)
  got = Collect()
  first, gone = got.job("first", [1, 2], max_tokens=2), got.job("gone", [3], max_tokens=2)
  engine.submit(first)
  engine.submit(gone)
  with pytest.raises(QueueFull):
    engine.submit(got.job("refused", [4], max_tokens=2))
  gone.cancel()
  assert engine.load() == {"running": 0, "waiting": 1, "slots": 1}
  engine.submit(got.job("late", [4], max_tokens=2))
  engine.start()
  try:
    got.wait(3)
    assert {k: d.reason for k, d in got.done.items()} == {
      "first": "length",
      "gone": "cancelled",
      "late": "length",
    }
    assert got.tokens["gone"] == [] and engine.load()["waiting"] == 0
  finally:
    engine.stop(cancel=True)


def test_stop_counts_the_jobs_it_cancels_and_not_those_already_cancelled():
  engine = Engine(tiny_model("transformer"), slots=1, context=32, max_waiting=4)
  got = Collect()
  jobs = [got.job(i, [1 + i], max_tokens=2) for i in range(3)]
  for job in jobs:
    engine.submit(job)
  jobs[0].cancel()  # its client left (or a stop string ended it)
  engine.stop(cancel=True)  # before the loop runs: every job is ended by the stop
  engine.start()
  got.wait(3)
  assert {d.reason for d in got.done.values()} == {"cancelled"}
  assert engine.counts["cancelled_on_stop"] == 2 and engine.counts["finished_cancelled"] == 3


def test_at_most_max_prefill_prompts_share_a_prefill_call():
  model = tiny_model("transformer")
  engine = Engine(model, slots=4, context=32, max_prefill=3)
  assert engine.prefill_rows == (1, 2, 4)  # three prompts are padded to four rows
  got = Collect()
  prompts = [[i + 1, 2, 3] for i in range(4)]
  for i, p in enumerate(prompts):  # queued before the engine starts: admitted together
    engine.submit(got.job(i, p, max_tokens=2))
  engine.start()
  try:
    got.wait(4)
  finally:
    engine.stop(cancel=True)
  assert engine.counts["prefills"] == 2
  for i, p in enumerate(prompts):
    assert got.tokens[i] == generate(model, [p], max_new_tokens=2, preflight=False).tokens[0]
