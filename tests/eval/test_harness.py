"""The lm-eval model: every request of the fixture tasks against the model's plain forward.

The fixture tasks (tests/fixtures/harness: multiple choice, rolling perplexity, generation)
run through the harness's own ``simple_evaluate``; every request the harness makes is
recorded and scored again here without the adapter: the unpadded sequence through the
model's forward, log-softmax in float32, the continuation's log-probabilities summed.
``max_length`` is short, so some requests lose context on the left and the rolling task
takes several windows; batches of four mix lengths.
"""

from __future__ import annotations

import glob
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

lm_eval = pytest.importorskip("lm_eval", reason="needs the [harness] extra")

from helpers import REPO, WAIT_LIMIT_S, tiny_model, write_bpe_tokenizer  # noqa: E402
from lm_eval import utils as lm_utils  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from diffjax.data.tokenizers import ByteTokenizer  # noqa: E402
from diffjax.eval.harness import DiffjaxLM, TokenScorer, cut_at_stops, run_tasks  # noqa: E402
from diffjax.eval.harness import command as harness_command  # noqa: E402
from diffjax.eval.harness.lm_eval_cli import main as lm_eval_main  # noqa: E402
from diffjax.eval.harness.model import generation_options  # noqa: E402
from diffjax.generation import generate  # noqa: E402
from diffjax.model import DecoderLM, ModelConfig  # noqa: E402

FIXTURES = os.path.join("tests", "fixtures", "harness")  # data_files are relative to the repo
TASKS = ["diffjax_fixture_choice", "diffjax_fixture_perplexity", "diffjax_fixture_generate"]
MAX_LENGTH = 32
RTOL = 1e-5


_FORWARDS = {}


def _plain_forward(model: DecoderLM):
  """The model's own forward of one unpadded row, jitted (one compile per length)."""
  if id(model) not in _FORWARDS:
    graphdef, state = nnx.split(model)
    fn = jax.jit(
      lambda s, x: jax.nn.log_softmax(nnx.merge(graphdef, s)(x).astype(jnp.float32), axis=-1)
    )
    _FORWARDS[id(model)] = (model, lambda x: fn(state, x))
  return _FORWARDS[id(model)][1]


def plain_loglikelihood(model: DecoderLM, context, continuation, max_length=MAX_LENGTH):
  """(sum of log p(continuation), greedy?) from one unpadded forward, float32."""
  whole = (list(context) + list(continuation))[-(max_length + 1) :]
  inputs = jnp.asarray([whole[:-1]], jnp.int32)
  logp = np.asarray(_plain_forward(model)(inputs))[0]
  n, k = len(whole) - 1, len(continuation)
  rows = np.arange(n - k, n)
  targets = np.asarray(whole[1:])[rows]
  return (
    float(np.sum(logp[rows, targets], dtype=np.float64)),
    bool(np.all(np.argmax(logp[rows], axis=-1) == targets)),
  )


class Recording(DiffjaxLM):
  """Keeps every request the harness makes, with the adapter's answer."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.pairs, self.rolling, self.generations = [], [], []

  def _loglikelihood_tokens(self, requests, **kwargs):
    out = super()._loglikelihood_tokens(requests, **kwargs)
    self.pairs += [(ctx, cont, res) for (_, ctx, cont), res in zip(requests, out)]
    return out

  def loglikelihood_rolling(self, requests, **kwargs):
    out = super().loglikelihood_rolling(requests, **kwargs)
    self.rolling += [(r.args[0], total) for r, total in zip(requests, out)]
    return out

  def generate_until(self, requests, **kwargs):
    out = super().generate_until(requests, **kwargs)
    self.generations += [(r.args, text) for r, text in zip(requests, out)]
    return out


def _close(got, want, what):
  assert abs(got - want) <= RTOL * max(abs(want), 1.0), (what, got, want)


# The scorer is the same code for every arm: DIFF V1 in the unit tier, DIFF V2 in the integration
# tier, the Transformer under -m slow.
@pytest.fixture(
  scope="module",
  params=[
    pytest.param("transformer", marks=pytest.mark.slow),
    "diff_v1",
    pytest.param("diff_v2", marks=pytest.mark.integration),
  ],
)
def evaluated(request):
  cwd = os.getcwd()
  os.chdir(REPO)
  try:
    model = tiny_model(request.param)
    lm = Recording(
      model=model, tokenizer="byte", max_length=MAX_LENGTH, batch_size=4, max_gen_toks=12
    )
    results = run_tasks(lm, TASKS, include_path=FIXTURES, bootstrap_iters=0)
  finally:
    os.chdir(cwd)
  return request.param, model, lm, results


def test_every_loglikelihood_request_equals_the_plain_forward(evaluated):
  arm, model, lm, results = evaluated
  assert set(results["results"]) == set(TASKS)
  assert len(lm.pairs) == 18  # 6 questions x 3 choices
  truncated = [p for p in lm.pairs if len(p[0]) + len(p[1]) > MAX_LENGTH + 1]
  assert truncated, "no request was longer than the context"
  lengths = {min(len(c) + len(k) - 1, MAX_LENGTH) for c, k, _ in lm.pairs}
  assert len(lengths) > 4, "the requests do not mix lengths"
  for ctx, cont, (logp, greedy) in lm.pairs:
    want, want_greedy = plain_loglikelihood(model, ctx, cont)
    _close(logp, want, (arm, ctx[-8:], cont))
    assert greedy == want_greedy
  # The harness's accuracy follows from those log-likelihoods.
  by_question = [lm.pairs[i : i + 3] for i in range(0, 18, 3)]
  acc = np.mean([int(np.argmax([p[2][0] for p in q]) == 0) for q in by_question])
  assert results["results"]["diffjax_fixture_choice"]["acc,none"] == pytest.approx(acc)


def test_rolling_perplexity_scores_each_token_once_in_the_harness_windows(evaluated):
  arm, model, lm, _ = evaluated
  assert len(lm.rolling) == 4
  assert any(len(lm.tok_encode(text)) > 2 * MAX_LENGTH for text, _ in lm.rolling)
  for text, total in lm.rolling:
    tokens = lm.tok_encode(text)
    windows = [
      lm_utils.make_disjoint_window(w)
      for w in lm_utils.get_rolling_token_windows(tokens, lm.eot_token_id, MAX_LENGTH, 1)
    ]
    assert sum(len(cont) for _, cont in windows) == len(tokens)
    want = sum(plain_loglikelihood(model, ctx, cont)[0] for ctx, cont in windows)
    _close(total, want, (arm, text[:20]))


def test_greedy_generate_until_equals_generate_with_the_same_stops(evaluated):
  _, model, lm, _ = evaluated
  assert len(lm.generations) == 5
  for (context, kwargs), text in lm.generations:
    assert kwargs["until"] == ["\n"] and kwargs["max_gen_toks"] == 12
    prompt = lm.tok_encode(context)[-(MAX_LENGTH - 12) :]
    out = generate(model, [prompt], max_new_tokens=12, stop_tokens=[lm.eot_token_id])
    assert text == cut_at_stops(lm.tok_decode(out.tokens[0]), ["\n"])
    assert "\n" not in text


def test_a_stream_of_lengths_compiles_one_forward_per_bucket():
  model = tiny_model("diff_v1")
  scorer = TokenScorer(model, max_length=40, batch_size=3)
  rng = np.random.default_rng(0)
  requests = [
    (rng.integers(0, 258, int(n)).tolist(), rng.integers(0, 258, 2).tolist())
    for n in rng.integers(1, 60, 25)
  ]
  got = scorer.score(requests)
  # Widths 16, 32 and the context (40), three rows each.
  assert scorer.compiled_shapes == {(3, 16), (3, 32), (3, 40)}
  assert scorer._fn._cache_size() == 3  # pylint: disable=protected-access
  for (ctx, cont), (logp, _) in zip(requests[:6], got[:6]):
    _close(logp, plain_loglikelihood(model, ctx, cont, 40)[0], "scorer")


def test_scorer_refuses_what_it_cannot_score():
  scorer = TokenScorer(tiny_model("transformer"), max_length=8)
  with pytest.raises(ValueError, match="empty context"):
    scorer.score([([], [1, 2])])
  with pytest.raises(ValueError, match="does not fit"):
    scorer.score([([1], list(range(9)))])
  with pytest.raises(ValueError, match=r"outside \[0, 258\)"):
    scorer.score([([1], [300])])
  assert scorer.score([([5], [])]) == [(0.0, True)]


def _write_bpe(path):
  pytest.importorskip("tokenizers")
  write_bpe_tokenizer(path, ["<eos>"], ["def add(a, b):\n    return a + b\n"] * 50)
  return str(path)


def _write_sentencepiece(path):
  spm = pytest.importorskip("sentencepiece")
  text = path.parent / "spm.txt"
  text.write_text(
    "".join(f"the number {i} follows {i - 1} and precedes {i + 1}\n" for i in range(300))
  )
  spm.SentencePieceTrainer.train(
    input=str(text), model_prefix=str(path)[: -len(".model")], vocab_size=120, model_type="bpe"
  )
  return str(path)


@pytest.mark.parametrize("kind", ["byte", "bpe", "sentencepiece"])
def test_tokenizers_follow_the_harness_conventions(kind, tmp_path):
  spec = {
    "byte": lambda: "byte",
    "bpe": lambda: _write_bpe(tmp_path / "tok.json"),
    "sentencepiece": lambda: _write_sentencepiece(tmp_path / "sp.model"),
  }[kind]()
  lm = DiffjaxLM(
    model=tiny_model("diff_v2", vocab=320), tokenizer=spec, max_length=MAX_LENGTH, batch_size=2
  )
  pairs = [("def add(a, b):", " return a + b"), ("", "the number 7"), ("x = ", "5")]
  out = lm.loglikelihood(
    [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True
  )
  for (context, continuation), (logp, _) in zip(pairs, out):
    if context:  # the continuation is what encoding the pair adds to encoding the context
      ctx = lm.tok_encode(context.rstrip())
      cont = lm.tok_encode(context.rstrip() + context[len(context.rstrip()) :] + continuation)[
        len(ctx) :
      ]
    else:
      ctx, cont = [lm.eot_token_id], lm.tok_encode(continuation)
    _close(logp, plain_loglikelihood(lm.model, ctx, cont)[0], (kind, context))


@pytest.fixture(scope="module")
def trained_workdir(trained_run):
  return trained_run("diff_v1", small=True)


@pytest.mark.integration  # the whole command
def test_the_command_prints_the_table_and_writes_the_results_json(
  trained_workdir, capsys, monkeypatch
):
  monkeypatch.chdir(REPO)
  out = os.path.join(trained_workdir, "h.json")
  rc = harness_command.main(
    [
      f"--workdir={trained_workdir}",
      f"--include_path={FIXTURES}",
      "--tasks=diffjax_fixture_choice,diffjax_fixture_generate",
      "--limit=3",
      "--batch_size=2",
      "--max_gen_toks=4",
      "--bootstrap_iters=0",
      f"--output={out}",
    ]
  )
  captured = capsys.readouterr()
  assert rc == 0, captured.err[-2000:]
  assert "|diffjax_fixture_choice  |" in captured.out and "|acc " in captured.out
  results = json.loads(open(out, encoding="utf-8").read())
  assert results["diffjax"]["arm"] == "diff_v1" and results["diffjax"]["max_length"] == 32
  assert results["n-samples"]["diffjax_fixture_choice"]["effective"] == 3
  assert 0.0 <= results["results"]["diffjax_fixture_choice"]["acc,none"] <= 1.0


@pytest.mark.integration  # two whole commands on a trained run
def test_lm_evals_own_command_line_runs_the_registered_model_with_the_same_scores(
  trained_workdir, tmp_path, capsys, monkeypatch
):
  """``diffjax-lm-eval run --model diffjax`` is lm-eval's command line; it scores what
  ``python -m diffjax.eval.harness`` scores."""
  monkeypatch.chdir(REPO)
  tasks = "diffjax_fixture_choice,diffjax_fixture_generate"
  ours = tmp_path / "ours.json"
  rc = harness_command.main(
    [
      f"--workdir={trained_workdir}",
      f"--include_path={FIXTURES}",
      f"--tasks={tasks}",
      "--limit=3",
      "--batch_size=2",
      "--max_gen_toks=4",
      f"--output={ours}",
    ]
  )
  assert rc == 0, capsys.readouterr().err[-2000:]
  rc = lm_eval_main(
    [
      "run",
      "--model=diffjax",
      "--model_args",
      f"workdir={trained_workdir},max_gen_toks=4",
      "--batch_size=2",
      f"--include_path={FIXTURES}",
      f"--tasks={tasks}",
      "--limit=3",
      f"--output_path={tmp_path / 'theirs'}",
    ]
  )
  captured = capsys.readouterr()
  assert rc == 0, captured.err[-2000:]
  assert "diffjax_fixture_choice" in captured.out  # lm-eval's own table
  (path,) = glob.glob(str(tmp_path / "theirs" / "*" / "results_*.json"))
  theirs = json.loads(open(path, encoding="utf-8").read())
  want = json.loads(ours.read_text())
  for task in tasks.split(","):
    metrics = {k: v for k, v in want["results"][task].items() if "," in k and "stderr" not in k}
    assert metrics and {k: theirs["results"][task][k] for k in metrics} == metrics, task
    assert theirs["n-samples"][task] == want["n-samples"][task]
  assert theirs["config"]["model"] == "diffjax"
  # Mistakes are one error line with status 2, lm-eval's own and diffjax's alike.
  missing = tmp_path / "no_run"
  for argv, needle in (
    (["--model=no_such_model"], "no_such_model"),
    (["--model=diffjax", "--model_args", f"workdir={missing}"], str(missing)),
    (["--model=diffjax", "--model_args", f"wokdir={missing}"], "--model_args wokdir="),
  ):
    argv = ["run", *argv, f"--include_path={FIXTURES}", f"--tasks={tasks}"]
    assert lm_eval_main(argv) == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and needle in err[-1], err[-3:]


@pytest.mark.integration  # the whole command on a trained run
@pytest.mark.parametrize(
  "args,needle",
  [
    (["--workdir={empty}", "--tasks=diffjax_fixture_choice"], "No checkpoints in"),
    # Naming an unknown task makes lm-eval index all of its tasks, which is slow.
    pytest.param(
      ["--workdir={run}", "--tasks=no_such_task"],
      "unknown task(s) ['no_such_task']",
      marks=pytest.mark.slow,
    ),
    (
      ["--workdir={run}", "--tasks=diffjax_fixture_choice", "--tokenizer={bpe}"],
      "is not the one the run was trained with ('byte')",
    ),
  ],
)
def test_bad_input_is_one_error_line(args, needle, trained_workdir, tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(REPO)
  (tmp_path / "empty").mkdir()
  names = dict(empty=str(tmp_path / "empty"), run=trained_workdir, bpe=str(tmp_path / "other.json"))
  argv = [a.format(**names) for a in args] + [f"--include_path={FIXTURES}"]
  rc = harness_command.main(argv)
  err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
  assert rc == 2 and len(err) == 1 and needle in err[0], err
  assert not os.path.exists(os.path.join(names["empty"], "harness.json"))


def _sharded_agreement():
  """Per arm: whether the results on a 2x2x2 mesh of the test process's 8 CPU devices equal
  one device's."""
  from diffjax import sharding as shd  # pylint: disable=import-outside-toplevel

  assert jax.device_count() == 8
  out = {}
  rng = np.random.default_rng(3)
  requests = [
    (rng.integers(0, 64, int(n)).tolist(), rng.integers(0, 64, 3).tolist())
    for n in (5, 17, 30, 2, 11)
  ]
  for arm in ("transformer", "diff_v1", "diff_v2"):
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
    single = TokenScorer(model, max_length=32, batch_size=4).score(requests)
    scorer = TokenScorer(model, max_length=32, batch_size=4, mesh=shd.make_mesh((2, 2, 2)))
    sharded = scorer.score(requests)
    split = [
      len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated
      for leaf in jax.tree.leaves(scorer._state)
      if leaf.ndim >= 2
    ]  # pylint: disable=protected-access
    out[arm] = bool(any(split)) and all(
      abs(a[0] - b[0]) <= 1e-5 * max(1.0, abs(b[0])) and a[1] == b[1]
      for a, b in zip(sharded, single)
    )
  return out


@pytest.mark.integration  # compiles scoring on a 2x2x2 mesh
def test_scores_on_a_mesh_equal_one_device_with_parameters_left_sharded():
  assert _sharded_agreement() == {"transformer": True, "diff_v1": True, "diff_v2": True}


def test_an_imported_hf_directory_brings_its_tokenizer_and_context(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  import shutil  # pylint: disable=import-outside-toplevel

  from tokenizers import models, pre_tokenizers  # pylint: disable=import-outside-toplevel

  hf_dir = tmp_path / "llama"
  shutil.copytree(os.path.join(REPO, "tests", "fixtures", "hf", "llama"), hf_dir)
  words = ["</s>", "[UNK]"] + [f"w{i}" for i in range(60)]
  tok = tokenizers.Tokenizer(
    models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
  )
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.save(str(hf_dir / "tokenizer.json"))
  lm = DiffjaxLM(hf_dir=str(hf_dir), batch_size=2)
  assert lm.max_length == 2048 and lm.eot_token_id == 0  # max_position_embeddings, </s>
  assert lm.model.config.num_kv_heads == 2 and lm.model.config.vocab_size == 96
  pairs = [("w1 w2 w3", " w4 w5"), ("w7", " w8"), ("", "w9 w10")]
  out = lm.loglikelihood(
    [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True
  )
  for (context, continuation), (logp, _) in zip(pairs, out):
    ctx = lm.tok_encode(context) if context else [lm.eot_token_id]
    cont = (
      lm.tok_encode(context + continuation)[len(lm.tok_encode(context)) :]
      if context
      else lm.tok_encode(continuation)
    )
    _close(logp, plain_loglikelihood(lm.model, ctx, cont, lm.max_length)[0], context)


def test_sampled_generation_is_generate_with_the_tasks_options():
  model = tiny_model("diff_v1")
  lm = DiffjaxLM(model=model, tokenizer="byte", max_length=MAX_LENGTH, batch_size=2, seed=5)
  contexts = ["def f(x):", "import os\n"]

  def sampled():
    return lm.generate_texts(
      contexts, until=["\n\n"], max_gen_toks=10, do_sample=True, temperature=0.9, top_k=20
    )

  def generated(seed):
    ids = [lm.tok_encode(c) for c in contexts]
    out = generate(
      model, ids, max_new_tokens=10, temperature=0.9, top_k=20, seed=seed, stop_tokens=[256]
    )
    return [cut_at_stops(lm.tok_decode(t), ["\n\n"]) for t in out.tokens]

  got = sampled()
  assert lm.eot_token_id == 256 and got == generated(5)
  # The next call draws with the next seed: a repeated request in another batch is sampled anew.
  assert sampled() == generated(6) != got
  greedy = lm.generate_texts(contexts, max_gen_toks=10)
  assert greedy != got  # sampling at temperature 0.9 is not the greedy path
  with pytest.raises(ValueError, match=r"num_beams=4 is not supported \(only num_beams=1 is\)"):
    lm.generate_texts(contexts, num_beams=4)


@pytest.mark.integration
def test_a_task_without_local_data_fails_fast_naming_its_dataset(tmp_path):
  """In a fresh process, as a user runs it: no download is tried, the line names the dataset."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel

  (tmp_path / "tasks").mkdir()
  (tmp_path / "tasks" / "remote.yaml").write_text(
    "task: diffjax_remote_only\n"
    "dataset_path: diffjax-nobody/no-such-dataset\n"
    "test_split: test\n"
    "output_type: multiple_choice\n"
    'doc_to_text: "{{question}}"\n'
    'doc_to_choice: "{{choices}}"\n'
    'doc_to_target: "{{answer}}"\n'
  )
  env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
  t0 = time.time()
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "diffjax.eval.harness",
      f"--workdir={tmp_path / 'no_run'}",
      "--tasks=diffjax_remote_only",
      f"--include_path={tmp_path / 'tasks'}",
      "--limit=5",
    ],
    capture_output=True,
    text=True,
    cwd=REPO,
    env=dict(env, JAX_PLATFORMS="cpu", HF_DATASETS_CACHE=str(tmp_path / "cache")),
    timeout=WAIT_LIMIT_S,
  )
  err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
  assert r.returncode == 2 and len(err) == 1, (r.returncode, r.stderr[-3000:])
  assert "Traceback" not in r.stderr, r.stderr[-3000:]
  assert "'diffjax-nobody/no-such-dataset'" in err[0] and "--include_path" in err[0], err[0]
  assert str(tmp_path / "cache") in err[0], err[0]
  assert time.time() - t0 < 60


# -------------------------------------------------- lm-eval's options and command-line habits


def _generation_task(directory, name, **options):
  """The fixture generation task again as ``name``, with ``options`` as its generation_kwargs."""
  import yaml  # pylint: disable=import-outside-toplevel

  with open(os.path.join(REPO, FIXTURES, "generate.yaml"), encoding="utf-8") as f:
    spec = yaml.safe_load(f)
  spec["task"] = name
  spec["dataset_kwargs"]["data_files"]["test"] = os.path.join(REPO, FIXTURES, "generate.jsonl")
  spec["generation_kwargs"] = {"until": ["\n"], **options}
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, f"{name}.yaml"), "w", encoding="utf-8") as f:
    yaml.safe_dump(spec, f)
  return str(directory)


def test_generation_options_are_lm_evals_aliases_or_one_error_naming_the_task():
  options = generation_options({"max_new_tokens": 5, "num_beams": 1, "until": "\n"}, task="t")
  assert options == {"until": ["\n"], "max_gen_toks": 5, "do_sample": False}
  assert generation_options({"max_tokens": 7})["max_gen_toks"] == 7
  assert generation_options({"max_completion_tokens": 3})["max_gen_toks"] == 3
  assert generation_options({})["max_gen_toks"] is None  # the model's own --max_gen_toks
  for bad, needle in (
    ({"num_beams": 4}, "task 'qa': generation option num_beams=4 is not supported"),
    ({"repetition_penalty": 1.3}, "repetition_penalty=1.3 is not supported"),
    ({"min_p": 0.1}, "generation option min_p=0.1 is not supported"),
  ):
    with pytest.raises(ValueError, match=re.escape(needle)):
      generation_options(bad, task="qa")


def test_a_task_with_max_new_tokens_and_num_beams_1_runs(tmp_path):
  include = _generation_task(
    tmp_path / "tasks", "diffjax_new_tokens", max_new_tokens=5, num_beams=1
  )
  lm = Recording(model=tiny_model("diff_v1"), tokenizer="byte", max_length=MAX_LENGTH, batch_size=4)
  results = run_tasks(lm, ["diffjax_new_tokens"], include_path=include, bootstrap_iters=0)
  assert "diffjax_new_tokens" in results["results"] and len(lm.generations) == 5
  for (context, _), text in lm.generations:
    assert text == lm.generate_texts([context], until=["\n"], max_gen_toks=5)[0]
    assert len(text.encode("utf-8", "surrogateescape")) <= 5 * 3  # 5 byte tokens, U+FFFD each


def test_an_option_the_model_cannot_honour_fails_before_any_request(tmp_path):
  include = _generation_task(tmp_path / "tasks", "diffjax_beams", num_beams=4)
  lm = Recording(model=tiny_model("diff_v1"), tokenizer="byte", max_length=MAX_LENGTH, batch_size=4)
  with pytest.raises(ValueError, match=r"task 'diffjax_beams': generation option num_beams=4"):
    run_tasks(
      lm,
      ["diffjax_fixture_choice", "diffjax_beams"],
      include_path=[os.path.join(REPO, FIXTURES), include],
    )
  assert lm.pairs == [] and lm.generations == []  # the choice task's requests never ran


@pytest.mark.parametrize(
  "extra,needle",
  [
    # A workdir with no checkpoint: each line must come before the model is loaded.
    (["--tasks=diffjax_beams"], "task 'diffjax_beams': generation option num_beams=4"),
    (
      ["--tasks=diffjax_fixture_generate", "--gen_kwargs=num_beams=3"],
      "task 'diffjax_fixture_generate': generation option num_beams=3",
    ),
    (["--tasks=diffjax_fixture_choice", "--gen_kwargs=oops"], "'oops' is not KEY=VALUE"),
    (["--tasks=diffjax_fixture_choice", "--use_cache=/no/such/dir/c"], "--use_cache="),
  ],
)
def test_bad_generation_options_are_one_line_before_the_model_loads(
  extra, needle, tmp_path, capsys, monkeypatch
):
  monkeypatch.chdir(REPO)
  include = _generation_task(tmp_path / "tasks", "diffjax_beams", num_beams=4)
  (tmp_path / "empty").mkdir()
  argv = [f"--workdir={tmp_path / 'empty'}", f"--include_path={FIXTURES}", *extra]
  if "--tasks=diffjax_beams" in extra:
    argv[1] = f"--include_path={include}"
  rc = harness_command.main(argv)
  err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
  assert rc == 2 and len(err) == 1 and needle in err[0], err


def test_batch_size_auto_halves_while_the_device_runs_out_of_memory(monkeypatch):
  scorer = TokenScorer(tiny_model("diff_v1"), max_length=MAX_LENGTH, batch_size=1)
  real, tried = scorer._run, []  # pylint: disable=protected-access

  def limited(inputs, targets):
    tried.append(inputs.shape[0])
    if inputs.shape[0] > 8:
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
    return real(inputs, targets)

  monkeypatch.setattr(scorer, "_run", limited)
  assert scorer.fit_batch_size(48) == 8 and scorer.batch_size == 8
  assert tried == [32, 16, 8]
  monkeypatch.setattr(scorer, "_run", lambda *a: (_ for _ in ()).throw(RuntimeError("other")))
  with pytest.raises(RuntimeError, match="other"):  # anything but memory is not swallowed
    scorer.fit_batch_size(4)
  with pytest.raises(ValueError, match="auto"):
    DiffjaxLM(model=tiny_model("diff_v1"), tokenizer="byte", batch_size="big")


def _samples(directory, task):
  (path,) = glob.glob(os.path.join(directory, "*", f"samples_{task}_*.jsonl"))
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


@pytest.mark.integration
def test_output_path_samples_gen_kwargs_auto_batch_and_the_answer_cache(
  trained_workdir, tmp_path, capsys, monkeypatch
):
  monkeypatch.chdir(REPO)
  argv = [
    f"--workdir={trained_workdir}",
    f"--include_path={FIXTURES}",
    "--tasks=diffjax_fixture_choice,diffjax_fixture_generate",
    "--limit=3",
    "--batch_size=auto",
    "--max_batch_size=16",
    "--gen_kwargs=max_gen_toks=3",
    "--bootstrap_iters=0",
    f"--output={tmp_path / 'h.json'}",
    f"--output_path={tmp_path / 'out'}",
    "--log_samples",
    f"--use_cache={tmp_path / 'answers'}",
  ]
  assert harness_command.main(argv) == 0, capsys.readouterr().err[-2000:]
  err = capsys.readouterr().err
  assert "context 32 tokens (the run's seq_len), batch 16" in err
  first = json.loads((tmp_path / "h.json").read_text())
  assert first["diffjax"]["batch_size"] == 16
  (results,) = glob.glob(str(tmp_path / "out" / "*" / "results_*.json"))
  assert json.loads(open(results, encoding="utf-8").read())["results"] == first["results"]
  choice = _samples(tmp_path / "out", "diffjax_fixture_choice")
  generated = _samples(tmp_path / "out", "diffjax_fixture_generate")
  assert len(choice) == 3 and len(generated) == 3
  tok = ByteTokenizer()
  for sample in generated:  # --gen_kwargs=max_gen_toks=3 over the task's 12
    text = sample["resps"][0][0]
    assert len(tok.encode(text.replace("\ufffd", "?"))) <= 3, text
  assert os.path.isfile(tmp_path / "answers_rank0.db")

  # The same command again answers every request from the cache: the model is never asked.
  def refuse(*args, **kwargs):
    raise AssertionError("the model was asked although the cache holds the answer")

  monkeypatch.setattr(TokenScorer, "score", refuse)
  monkeypatch.setattr(DiffjaxLM, "generate_texts", refuse)
  assert harness_command.main(argv) == 0, capsys.readouterr().err[-2000:]
  assert json.loads((tmp_path / "h.json").read_text())["results"] == first["results"]


@pytest.mark.integration  # the whole command on a trained run
def test_predict_only_keeps_the_outputs_and_computes_no_metric(
  trained_workdir, tmp_path, capsys, monkeypatch
):
  monkeypatch.chdir(REPO)
  rc = harness_command.main(
    [
      f"--workdir={trained_workdir}",
      f"--include_path={FIXTURES}",
      "--tasks=diffjax_fixture_choice",
      "--limit=2",
      "--predict_only",
      f"--output={tmp_path / 'h.json'}",
      f"--output_path={tmp_path / 'out'}",
    ]
  )
  assert rc == 0, capsys.readouterr().err[-2000:]
  metrics = json.loads((tmp_path / "h.json").read_text())["results"]["diffjax_fixture_choice"]
  assert not any(k.startswith(("acc,", "acc_norm,")) for k in metrics), metrics
  samples = _samples(tmp_path / "out", "diffjax_fixture_choice")
  assert len(samples) == 2 and all(len(s["resps"]) == 3 for s in samples)


@pytest.mark.integration  # a whole export evaluated by the harness
def test_an_export_is_evaluated_at_the_runs_context_with_the_runs_tokenizer(
  trained_workdir, tmp_path, monkeypatch
):
  from diffjax.convert.command import main as convert_main  # pylint: disable=import-outside-toplevel

  monkeypatch.chdir(REPO)
  out = str(tmp_path / "hf")
  assert convert_main(["export", f"--workdir={trained_workdir}", f"--hf={out}"]) == 0
  config = json.loads(open(os.path.join(out, "config.json"), encoding="utf-8").read())
  assert config["max_position_embeddings"] == 32  # the run's seq_len
  assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
    None,
    256,
    257,
  )
  generation = json.loads(
    open(os.path.join(out, "generation_config.json"), encoding="utf-8").read()
  )
  assert generation["eos_token_id"] == 256 and generation["do_sample"] is False
  from_run = DiffjaxLM(trained_workdir, batch_size=4)
  from_hf = DiffjaxLM(hf_dir=out, batch_size=4)
  assert from_hf.max_length == from_run.max_length == 32
  assert "max_position_embeddings" in from_hf.context_source
  assert isinstance(from_hf.tok, ByteTokenizer)
  requests = [
    ("def add(a, b):", " return a + b"),
    ("The standard library provides modules for files, processes", " and text."),
  ]
  instances = [Instance("loglikelihood", {}, r, i) for i, r in enumerate(requests)]
  for (a, ga), (b, gb) in zip(
    from_run.loglikelihood(instances, disable_tqdm=True),
    from_hf.loglikelihood(instances, disable_tqdm=True),
  ):
    _close(b, a, "export vs run")
    assert ga == gb


def test_eval_says_how_many_validation_batches_and_generation_refuses_another_tokenizer(
  trained_workdir, tmp_path, capsys, monkeypatch
):
  """Two commands beside the harness on the same run: ``python -m diffjax.eval`` says what its
  val/loss measured, and generation takes only the run's tokenizer."""
  from diffjax.eval.command import main as eval_main  # pylint: disable=import-outside-toplevel
  from diffjax.generation.command import main as generate_main  # pylint: disable=import-outside-toplevel

  monkeypatch.chdir(REPO)
  argv = [
    f"--workdir={trained_workdir}",
    f"--out={tmp_path / 'e.json'}",
    "--config.context_len=256",
  ]
  assert eval_main([*argv, "--config.sections=('validation',)", "--config.val_batches=2"]) == 0
  out = capsys.readouterr().out
  assert "val/loss over 2 validation batch(es), not the 1 of the trainer's eval/loss" in out, out
  assert eval_main([*argv, "--config.sections=('validation',)"]) == 0
  out = capsys.readouterr().out
  assert "val/loss over 1 validation batch(es)" in out and "not the" not in out, out
  write_bpe_tokenizer(tmp_path / "other.json")
  rc = generate_main([argv[0], "--prompt=hi", f"--tokenizer={tmp_path / 'other.json'}"])
  err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
  assert rc == 2 and len(err) == 1 and "is not the one the run was trained with ('byte')" in err[0]


def test_generation_leaves_room_for_the_context_or_says_why():
  lm = DiffjaxLM(model=tiny_model("transformer"), tokenizer="byte", max_length=16, batch_size=2)
  with pytest.raises(ValueError, match="max_gen_toks=16 leaves no room for a context in max_len"):
    lm.generate_texts(["abc"], max_gen_toks=16)
  with pytest.raises(ValueError, match="max_gen_toks=-1 must be at least 0"):
    lm.generate_texts(["abc"], max_gen_toks=-1)
  assert lm.generate_texts(["abc", "d"], max_gen_toks=0) == ["", ""]
  assert len(lm.generate_texts(["abc"], max_gen_toks=15)) == 1  # one token of context is room


def test_model_args_are_checked_by_name_and_pretrained_is_the_directory(tmp_path):
  from diffjax.convert import save_hf  # pylint: disable=import-outside-toplevel

  save_hf(tiny_model("transformer"), str(tmp_path / "hf"), tokenizer=ByteTokenizer())
  lm = DiffjaxLM.create_from_arg_string(
    f"pretrained={tmp_path / 'hf'},batch_size=3,max_gen_toks=7",
    {"batch_size": 1, "max_batch_size": None, "device": "cpu"},
  )
  assert lm.batch_size == 3 and lm.max_gen_toks == 7  # --model_args win over lm-eval's defaults
  assert lm.context_source == "config.json's max_position_embeddings"
  with pytest.raises(ValueError, match="--model_args wokdir='x': the diffjax model takes pretr"):
    DiffjaxLM.create_from_arg_string("wokdir=x", {"batch_size": 1})
  with pytest.raises(ValueError, match="max_length='abc' must be an integer"):
    DiffjaxLM.create_from_arg_string(f"hf_dir={tmp_path / 'hf'},max_length=abc")
  with pytest.raises(ValueError, match="no chat template"):
    lm.chat_template(True)
