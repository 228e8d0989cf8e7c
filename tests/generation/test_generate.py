"""Cached generation: exact against the full forward for every arm, sampling, stopping, sharding."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import REPO, WAIT_LIMIT_S, own_stderr
from kernel_checks import rel_err as _rel_err

from diffjax.generation import SamplingOptions, generate, top_k_filter, top_p_filter
from diffjax.generation.programs import decode_cache_layout
from diffjax.model import DecoderLM, ModelConfig
from diffjax.nn.attention import CACHE_LAYOUTS, cache_layout

ARMS = ("transformer", "diff_v1", "diff_v2")
VOCAB = 61


def _model(arm: str, **kw) -> DecoderLM:
  # GQA: 4 query heads over 2 kv heads in every arm.
  cfg = ModelConfig(
    attention=arm,
    vocab_size=VOCAB,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=64,
    implementation="xla",
    **kw,
  )
  return DecoderLM(cfg, rngs=nnx.Rngs(3))


@pytest.mark.parametrize("layout", CACHE_LAYOUTS)
@pytest.mark.parametrize(
  "arm", [pytest.param("transformer", marks=pytest.mark.slow), "diff_v1", "diff_v2"]
)
def test_cached_logits_equal_full_forward_at_every_position(arm, layout):
  model = _model(arm)
  lens = np.array([3, 9, 1, 6])
  seq_BxT = jax.random.randint(jax.random.key(0), (4, 14), 0, VOCAB)
  full_BxTxV = jax.jit(lambda t: model(t))(seq_BxT)
  # Prefill a ragged batch (left-aligned, garbage past each row's length), then decode
  # every row's own next positions one token at a time.
  with cache_layout(layout):  # the cache is made, jitted and read under one layout
    cache = model.init_cache(4, 16)
    assert cache[0]["v"].shape[1:3] == ((16, 2) if layout == "sequence_major" else (2, 16))
    prefill_BxTxV, cache = jax.jit(
      lambda c, t: model(t, cache=c, cache_lengths_B=jnp.zeros(4, jnp.int32))
    )(cache, seq_BxT[:, :9])
    for b, n in enumerate(lens):
      assert _rel_err(prefill_BxTxV[b, :n], full_BxTxV[b, :n]) <= 1e-5
    pos_B = jnp.asarray(lens)
    step = jax.jit(lambda c, t, p: model(t[:, None], p[:, None], cache=c, cache_lengths_B=p))
    for _ in range(14 - int(lens.max())):
      rows = jnp.arange(4)
      logits_Bx1xV, cache = step(cache, seq_BxT[rows, pos_B], pos_B)
      assert _rel_err(logits_Bx1xV[:, 0], full_BxTxV[rows, pos_B]) <= 1e-5
      pos_B = pos_B + 1


def test_a_cache_used_under_another_layout_is_refused_and_the_layouts_are_named():
  model = _model("diff_v1")
  cache = model.init_cache(2, 16)  # sequence-major: [2, 16, 2, 8]
  with cache_layout("head_major"), pytest.raises(ValueError, match="cache_layout"):
    model(jnp.zeros((2, 3), jnp.int32), cache=cache, cache_lengths_B=jnp.zeros(2, jnp.int32))
  with pytest.raises(ValueError, match="sideways.*head_major"):
    with cache_layout("sideways"):
      pass
  assert decode_cache_layout() == "head_major"  # these tests run on a CPU


@pytest.mark.parametrize("layout", CACHE_LAYOUTS)
def test_a_cache_call_that_would_be_computed_wrong_is_refused(layout):
  model = _model("diff_v1")
  tokens = jnp.arange(10, dtype=jnp.int32).reshape(1, 10) % VOCAB
  with cache_layout(layout):
    cache = model.init_cache(1, 8)
    _, cache = model(tokens[:, :5], cache=cache, cache_lengths_B=jnp.zeros(1, jnp.int32))
    # More tokens after a filled prefix would attend to themselves only: refused (outside jit).
    with pytest.raises(ValueError, match=r"prefill into an empty cache.*\[5\] has filled slots"):
      model(tokens[:, 5:8], jnp.arange(5, 8)[None], cache=cache, cache_lengths_B=jnp.array([5]))
    with pytest.raises(ValueError, match="10 tokens do not fit a KV cache of 8 slots"):
      model(tokens, cache=model.init_cache(1, 8), cache_lengths_B=jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match=r"init_cache\(batch=1, max_length=0\)"):
      model.init_cache(1, 0)
  with pytest.raises(ValueError, match=r"rank 3 \[batch, length, d_model\]; got shape \(10, 32\)"):
    model.layer(0).attn(jnp.zeros((10, 32)))


def _next_logits_fn(model, width: int = 24):
  """Full-forward next-token logits of a token list (padded to one jitted width: causal)."""
  forward = jax.jit(lambda toks_1xT: model(toks_1xT)[0])

  def next_logits(seq):
    return forward(jnp.asarray([list(seq) + [0] * (width - len(seq))]))[len(seq) - 1]

  return next_logits


def _greedy_by_full_forward(model, prompt, n):
  next_logits = _next_logits_fn(model)
  seq = list(prompt)
  for _ in range(n):
    seq.append(int(jnp.argmax(next_logits(seq))))
  return seq[len(prompt) :]


@pytest.mark.parametrize("arm", ARMS)
def test_greedy_equals_argmax_of_repeated_full_forwards(arm):
  model = _model(arm)
  prompts = [[5, 8, 13], [1, 2, 3, 4, 5, 6, 7], [40]]
  out = generate(model, prompts, max_new_tokens=8)
  for prompt, got in zip(prompts, out.tokens):
    assert got == _greedy_by_full_forward(model, prompt, 8)


def test_array_prompts_with_lengths_equal_list_prompts():
  model = _model("diff_v1")
  arr = np.array([[5, 8, 13, 0, 0], [1, 2, 3, 4, 5]])
  a = generate(model, arr, lengths=[3, 5], max_new_tokens=5).tokens
  b = generate(model, [[5, 8, 13], [1, 2, 3, 4, 5]], max_new_tokens=5).tokens
  assert a == b


class _BackendCompiles:
  """Counts XLA compilations (every program jax builds, not only generate's own)."""

  def __enter__(self):
    self.count = 0
    self._listener = lambda event, *a, **k: setattr(
      self, "count", self.count + (event == "/jax/core/compile/backend_compile_duration")
    )
    jax.monitoring.register_event_duration_secs_listener(self._listener)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listener)


def test_a_stream_of_calls_compiles_one_program_per_bucket_and_same_structure_models_share_it():
  from diffjax.generation import programs

  programs.clear_cache()
  model = _model("diff_v1")
  rng = np.random.default_rng(0)
  # Rows 1..4 (batch buckets 1, 2, 4), prompts of 1..16 tokens (one 16-wide bucket), 2..9
  # new tokens (one 128-slot cache), stops or none: three programs.
  calls = [(int(rng.integers(1, 5)), int(rng.integers(2, 10))) for _ in range(12)]
  calls += [(1, 3), (2, 3), (3, 3), (4, 3)]

  def prompts(rows):
    return [rng.integers(0, VOCAB, int(rng.integers(1, 17))).tolist() for _ in range(rows)]

  for rows, new in calls:
    generate(model, prompts(rows), max_new_tokens=new, stop_tokens=[7] if new % 2 else ())
  assert programs.cache_info()["compiled"] == 3
  # Warm now: more calls, and another model of the same structure, compile nothing at all.
  other = DecoderLM(model.config, rngs=nnx.Rngs(11))
  probe = [[5, 8, 13], [1, 2, 3, 4, 5, 6, 7], [40]]
  with _BackendCompiles() as compiles:
    for rows, new in calls[:6]:
      generate(model, prompts(rows), max_new_tokens=new, seed=3)
    mine = generate(model, probe, max_new_tokens=8).tokens
    theirs = generate(other, probe, max_new_tokens=8).tokens
  assert compiles.count == 0 and programs.cache_info()["compiled"] == 3
  # The shared program runs each model's own weights.
  assert mine != theirs
  for prompt, got in zip(probe, theirs):
    assert got == _greedy_by_full_forward(other, prompt, 8)
  # Another sampling setting is another program.
  generate(model, probe, max_new_tokens=4, temperature=0.7)
  assert programs.cache_info()["compiled"] == 4


def test_sampling_with_a_seed_is_reproducible_and_seeds_differ():
  model = _model("diff_v2")
  kw = dict(max_new_tokens=12, temperature=1.5)
  a = generate(model, [[1, 2], [3]], seed=7, **kw).tokens
  assert a == generate(model, [[1, 2], [3]], seed=7, **kw).tokens
  assert a != generate(model, [[1, 2], [3]], seed=8, **kw).tokens


def test_top_k_and_top_p_keep_the_right_support():
  logits_BxV = jnp.log(jnp.array([[0.5, 0.05, 0.3, 0.15], [0.1, 0.2, 0.3, 0.4]]))
  kept = np.isfinite(np.asarray(top_k_filter(logits_BxV, 2)))
  assert kept.tolist() == [[True, False, True, False], [False, False, True, True]]
  # p = 0.75: row 0 needs 0.5 + 0.3; row 1 needs 0.4 + 0.3 + 0.2.
  kept = np.isfinite(np.asarray(top_p_filter(logits_BxV, 0.75)))
  assert kept.tolist() == [[True, False, True, False], [False, True, True, True]]
  # Sampling with top_k=1 is greedy whatever the temperature.
  model = _model("transformer")
  greedy = generate(model, [[3, 4]], max_new_tokens=6).tokens
  assert generate(model, [[3, 4]], max_new_tokens=6, temperature=5.0, top_k=1).tokens == greedy
  sampled = generate(model, [[3, 4]] * 4, max_new_tokens=6, temperature=3.0, top_k=3, seed=1)
  next_logits = _next_logits_fn(model)
  for row in sampled.tokens:
    for i, tok in enumerate(row):  # each token among the 3 likeliest after its prefix
      logits = next_logits([3, 4] + row[:i])
      assert tok in np.argsort(np.asarray(logits))[-3:]


def test_processors_run_on_every_step():
  model = _model("transformer")
  seen = []

  def ban_greedy_choice(logits_BxV, step):
    return logits_BxV.at[:, 7].set(-jnp.inf)

  streamed = []

  def on_tokens(step, toks, active):
    seen.append(step)
    streamed.extend(int(t) for t, a in zip(toks, active) if a)

  # More steps than the loop runs between two returns to the host (STREAM_EVERY).
  out = generate(
    model, [[1, 2, 3]], max_new_tokens=20, processors=[ban_greedy_choice], on_tokens=on_tokens
  )
  assert 7 not in out.tokens[0] and len(out.tokens[0]) == 20
  assert seen == list(range(20)) and streamed == out.tokens[0]
  assert (
    generate(model, [[1, 2, 3]], max_new_tokens=20, processors=[ban_greedy_choice]).tokens
    == out.tokens
  )


def test_each_row_stops_at_its_own_stop_token():
  model = _model("diff_v1")
  prompts = [[5, 8, 13], [1, 2, 3, 4, 5, 6, 7]]
  free = generate(model, prompts, max_new_tokens=10).tokens
  stop = free[0][2]  # the third token of row 0
  out = generate(model, prompts, max_new_tokens=10, stop_tokens=[stop])
  assert out.tokens[0] == free[0][: free[0].index(stop)]
  assert out.stopped[0]
  row1 = free[1][: free[1].index(stop)] if stop in free[1] else free[1]
  assert out.tokens[1] == row1


def test_prompt_longer_than_the_cache_is_one_clear_error():
  with pytest.raises(
    ValueError,
    match=r"prompt of 20 tokens does not fit the cache of "
    r"max_length=16",
  ):
    generate(_model("transformer"), [list(range(20))], max_length=16)


@pytest.mark.integration
@pytest.mark.parametrize("arm", ["diff_v1", "diff_v2"])
def test_cli_continues_a_prompt_with_a_trained_run(trained_run, arm, capsys):
  # The command on a trained run (shared with the eval and harness tests) prints the prompt
  # and the greedy continuation of the run's own model, then one line of speeds.
  from diffjax.data import DataConfig, load_tokenizer  # pylint: disable=import-outside-toplevel
  from diffjax.generation.command import main  # pylint: disable=import-outside-toplevel
  from diffjax.train.loading import load_run  # pylint: disable=import-outside-toplevel

  workdir = trained_run(arm)
  capsys.readouterr()  # the training's own output, when this test trained the run
  assert main([f"--workdir={workdir}", "--prompt=ab", "--max_new_tokens=6"]) == 0
  out, err = capsys.readouterr()
  run = load_run(workdir, None)
  tokenizer = load_tokenizer(
    (run.config.get("data") or {}).get("tokenizer", DataConfig().tokenizer)
  )
  want = generate(
    run.model, [tokenizer.encode("ab").tolist()], max_new_tokens=6, stop_tokens=[tokenizer.eos_id]
  )
  assert len(want.tokens[0]) >= 1
  assert out == "ab" + tokenizer.decode(want.tokens[0]) + "\n"
  assert err.startswith(f"[{arm}, step {run.step}] prefill 2 tokens") and err.count("\n") == 1


@pytest.mark.integration
def test_cli_refuses_a_missing_or_empty_workdir_in_one_line_writing_nothing(tmp_path, capsys):
  from diffjax.generation.command import main  # pylint: disable=import-outside-toplevel

  empty = tmp_path / "empty"
  empty.mkdir()
  assert main([f"--workdir={empty}", "--prompt=hi"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "No checkpoints" in err and "train.py" in err
  assert not list(empty.iterdir())
  # The documented command name, in a fresh process.
  missing = tmp_path / "missing"
  r = subprocess.run(
    [sys.executable, "-m", "diffjax.generation", f"--workdir={missing}", "--prompt=hi"],
    capture_output=True,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
    cwd=REPO,
    timeout=WAIT_LIMIT_S,
  )
  assert r.returncode == 2 and len(own_stderr(r.stderr)) == 1, r.stderr
  assert "is not a directory" in r.stderr and str(missing) in r.stderr and not missing.exists()


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(top_k=0), "top_k=0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(max_new_tokens=0), "max_new_tokens=0"),
  ],
)
def test_bad_sampling_options_are_refused(kw, match):
  with pytest.raises(ValueError, match=match):
    generate(_model("transformer"), [[1, 2]], **kw)


def test_sampling_options_validate():
  with pytest.raises(ValueError, match="top_p"):
    SamplingOptions(top_p=0.0)


def _sharded_agreement():
  """Per arm: whether the results on a 2x2x2 mesh of the test process's 8 CPU devices equal
  one device's."""
  from diffjax import sharding as shd

  assert jax.device_count() == 8
  out = {}
  for arm in ARMS:
    # kv heads 4 for the baseline and V2, 2 kv groups for V1: tensor = 2 divides both.
    heads = (
      dict(num_heads=4, num_kv_heads=2) if arm == "diff_v1" else dict(num_heads=8, num_kv_heads=4)
    )
    cfg = ModelConfig(
      attention=arm,
      vocab_size=64,
      d_model=32,
      num_layers=2,
      head_dim=4,
      mlp_dim=64,
      implementation="xla",
      **heads,
    )
    model = DecoderLM(cfg, rngs=nnx.Rngs(3))
    prompts = [[5, 8, 13], [1, 2, 3, 4, 5, 6, 7], [40], [9, 9]]
    single = generate(model, prompts, max_new_tokens=8).tokens
    mesh = shd.make_mesh((2, 2, 2))
    sharded = generate(model, prompts, max_new_tokens=8, mesh=mesh).tokens
    out[arm] = single == sharded
  return out


@pytest.mark.integration  # compiles prefill and decode on a 2x2x2 mesh
def test_sharded_generation_gives_the_single_device_tokens():
  assert _sharded_agreement() == {a: True for a in ARMS}
