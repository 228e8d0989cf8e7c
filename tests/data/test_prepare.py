"""`python -m diffjax.data.prepare` and the tokenizer trainer: inputs, resumability,
idempotence, one-line errors, and a training run on a prepared corpus that resumes exactly."""

import hashlib
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, own_stderr

from diffjax.data import prepare as prepare_lib
from diffjax.data import stdlib_files
from diffjax.data.manifest import read_manifest
from diffjax.data.prepare import prepare
from diffjax.data.shards import HEADER_BYTES, TokenShard, shard_documents


def _inputs(tmp_path):
  src = tmp_path / "raw"
  src.mkdir()
  for i in range(30):
    (src / f"{i:03d}.txt").write_text(f"text file {i} " * (i + 1))
  with open(src / "docs.jsonl", "w") as f:
    for i in range(25):
      f.write(json.dumps({"text": f"json doc {i} " * (i % 7 + 1), "id": i}) + "\n")
  return str(src)


def _shard_bytes(out):
  return {
    p: open(os.path.join(out, p), "rb").read()
    for p in sorted(os.listdir(out))
    if p.endswith(".tokens")
  }


def test_reads_jsonl_and_text_into_counted_shards(tmp_path):
  out = prepare(
    [_inputs(tmp_path)], str(tmp_path / "p"), shard_tokens=300, files_per_unit=8, progress=False
  )
  m = read_manifest(out)
  assert m.num_documents == 55 and len(m.shards) > 5
  docs = [bytes(d.astype(np.uint8)).decode() for s in m.shards for d in shard_documents(s.path)]
  assert sum(d.startswith("json doc") for d in docs) == 25
  assert sum(len(d) for d in docs) == m.num_tokens
  assert all(TokenShard(s.path).token_bytes == 2 for s in m.shards)  # byte ids: 2 bytes each
  # Each shard's digest is of what follows its header: the tokens, then the document offsets.
  for s in m.shards:
    with open(s.path, "rb") as f:
      assert s.sha256 == hashlib.sha256(f.read()[HEADER_BYTES:]).hexdigest(), s.path


def test_interrupted_prepare_resumes_without_duplicates(tmp_path, monkeypatch):
  src = _inputs(tmp_path)
  clean = prepare(
    [src], str(tmp_path / "clean"), shard_tokens=300, files_per_unit=8, progress=False
  )
  out = str(tmp_path / "broken")
  real = prepare_lib.iter_documents

  def dies_in_unit_2(unit, text_field):
    for i, doc in enumerate(real(unit, text_field)):
      if unit.index == 2 and i == 3:
        raise KeyboardInterrupt
      yield doc

  monkeypatch.setattr(prepare_lib, "iter_documents", dies_in_unit_2)
  with pytest.raises(KeyboardInterrupt):
    prepare([src], out, shard_tokens=300, files_per_unit=8, progress=False)
  assert not os.path.exists(os.path.join(out, "manifest.json"))
  monkeypatch.setattr(prepare_lib, "iter_documents", real)
  resumed = prepare([src], out, shard_tokens=300, files_per_unit=8, progress=False)
  assert not [p for p in os.listdir(out) if p.startswith("tmp-")]
  assert _shard_bytes(out) == _shard_bytes(os.path.dirname(clean))
  strip = lambda path: {k: v for k, v in json.load(open(path)).items()}
  assert strip(resumed) == strip(clean)
  before = open(resumed).read()
  prepare([src], out, shard_tokens=300, files_per_unit=8, progress=False)  # idempotent
  assert open(resumed).read() == before and _shard_bytes(out) == _shard_bytes(
    os.path.dirname(clean)
  )


def test_an_output_inside_an_input_directory_is_not_read_and_resumes(tmp_path):
  """`--input corpus --output corpus/prepared`: the shards and markers written are no input of
  the rerun, which resumes; an input holding nothing else is refused."""
  src = _inputs(tmp_path)
  clean = prepare(
    [src], str(tmp_path / "clean"), shard_tokens=300, files_per_unit=1, progress=False
  )
  out = os.path.join(src, "prepared")
  manifest = prepare([src], out, shard_tokens=300, files_per_unit=1, progress=False)
  assert _shard_bytes(out) == _shard_bytes(os.path.dirname(clean))
  os.remove(manifest)
  last = max(p for p in os.listdir(out) if p.startswith("unit-"))
  os.remove(os.path.join(out, last))  # as if stopped in the last unit
  prepare([src], out, shard_tokens=300, files_per_unit=1, progress=False)
  assert _shard_bytes(out) == _shard_bytes(os.path.dirname(clean))
  with pytest.raises(FileNotFoundError, match=r"no file outside the output"):
    prepare([out], out, progress=False)


def test_other_arguments_on_same_output_are_refused(tmp_path):
  src = _inputs(tmp_path)
  prepare([src], str(tmp_path / "p"), shard_tokens=300, progress=False)
  with pytest.raises(ValueError, match="different shard_tokens"):
    prepare([src], str(tmp_path / "p"), shard_tokens=400, progress=False)


def test_bad_jsonl_line_named(tmp_path):
  (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
  with pytest.raises(ValueError, match=r"a.jsonl:2: .*'text'"):
    prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "p"), progress=False)


def test_parquet_without_pyarrow_is_one_clear_error(tmp_path):
  try:
    import pyarrow  # noqa: F401

    pytest.skip("pyarrow is installed")
  except ImportError:
    pass
  (tmp_path / "a.parquet").write_bytes(b"PAR1")
  r = subprocess.run(
    [
      sys.executable,
      "-m",
      "diffjax.data.prepare",
      "--input",
      str(tmp_path / "a.parquet"),
      "--output",
      str(tmp_path / "p"),
    ],
    capture_output=True,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
    cwd=REPO,
  )
  assert r.returncode == 2 and len(own_stderr(r.stderr)) == 1, r.stderr
  assert "pip install pyarrow" in r.stderr


def test_trained_tokenizer_prepares_and_mismatch_is_refused(tmp_path):
  pytest.importorskip("tokenizers")
  from diffjax.data import DataConfig, build_datasets, load_tokenizer
  from diffjax.data.train_tokenizer import train_bpe

  src = _inputs(tmp_path)
  tok = train_bpe(["text file json doc " * 5, "another line of text"] * 20, vocab_size=300)
  tok.save(str(tmp_path / "tok.json"))
  out = prepare([src], str(tmp_path / "p"), str(tmp_path / "tok.json"), progress=False)
  t = load_tokenizer(str(tmp_path / "tok.json"))
  assert read_manifest(out).tokenizer["vocab_size"] == t.vocab_size
  good = DataConfig(kind="prepared", paths=(out,), tokenizer=str(tmp_path / "tok.json"))
  assert next(build_datasets(good, 16, 4, 0).train_iter)["inputs"].max() < t.vocab_size
  with pytest.raises(ValueError) as e:
    build_datasets(DataConfig(kind="prepared", paths=(out,), tokenizer="byte"), 16, 4, 0)
  assert "\n" not in str(e.value) and "tok.json" in str(e.value)


def _bpe_corpus(tmp_path):
  """A byte-level BPE tokenizer of 1,000 ids trained on 30 stdlib files, and the files prepared."""
  from diffjax.data.train_tokenizer import train_bpe

  files = stdlib_files()[:30]
  tok_path = str(tmp_path / "tok.json")
  train_bpe(
    [open(f, encoding="utf-8", errors="replace").read() for f in files], vocab_size=1000
  ).save(tok_path)
  return tok_path, prepare(
    files, str(tmp_path / "p"), tok_path, shard_tokens=50_000, progress=False
  )


def _tokens_per_byte_by_decoding(batches, tok):
  count = nbytes = 0
  for b in batches:
    for targets, mask in zip(b["targets"], b["loss_mask"]):
      kept = targets[mask > 0]
      count += kept.size
      nbytes += len(tok.decode(kept).encode("utf-8")) + int(np.sum(kept == tok.eos_id))
  return count / nbytes


def test_tokens_per_byte_of_bpe_batches_matches_decoding_them(tmp_path):
  pytest.importorskip("tokenizers")
  from diffjax.data import DataConfig, build_datasets, load_tokenizer, tokens_per_byte

  tok_path, out = _bpe_corpus(tmp_path)
  tok = load_tokenizer(tok_path)
  data = build_datasets(DataConfig(kind="prepared", paths=(out,), tokenizer=tok_path), 64, 4, 0)
  batches = data.val_batches(3)
  want = _tokens_per_byte_by_decoding(batches, tok)
  assert want < 0.5  # BPE: over two bytes per token
  assert tokens_per_byte(batches, tok) == pytest.approx(want, rel=1e-12)
  byte_batches = build_datasets(
    DataConfig(
      kind="prepared", paths=(prepare(stdlib_files()[:12], str(tmp_path / "b"), progress=False),)
    ),
    64,
    4,
    0,
  ).val_batches(1)
  assert tokens_per_byte(byte_batches, load_tokenizer("byte")) == 1.0


@pytest.mark.slow  # a training run: the trainer logs what tokens_per_byte gives
def test_bits_per_byte_of_a_bpe_run_counts_the_text_bytes(tmp_path):
  """A run on BPE tokens reports bits per byte: its loss per token times the validation
  targets' tokens per byte (eos counted as one byte), here recounted by decoding them."""
  pytest.importorskip("tokenizers")
  import math  # pylint: disable=import-outside-toplevel

  from helpers import tiny_config  # pylint: disable=import-outside-toplevel

  from diffjax.data import DataConfig, build_datasets, load_tokenizer
  from diffjax.train.trainer import train_and_evaluate

  tok_path, out = _bpe_corpus(tmp_path)
  c = tiny_config(steps=2)
  c.data.kind, c.data.paths, c.data.max_documents = "prepared", (os.path.dirname(out),), None
  c.data.tokenizer, c.eval_batches = tok_path, 2
  final = train_and_evaluate(c, str(tmp_path / "run"))
  data = build_datasets(DataConfig.from_dict(c.data), c.seq_len, c.global_batch_size, c.seed)
  ratio = _tokens_per_byte_by_decoding(data.val_batches(2), load_tokenizer(tok_path))
  want = final["eval/loss"] * ratio / math.log(2.0)
  with open(tmp_path / "run" / "metrics.jsonl", encoding="utf-8") as f:
    logged = [r for r in map(json.loads, f) if "eval/bits_per_byte" in r]
  assert final["eval/bits_per_byte"] == pytest.approx(want, rel=1e-6)
  assert [r["eval/bits_per_byte"] for r in logged] == [final["eval/bits_per_byte"]]


def test_paper_configs_need_both_paths():
  from diffjax.data import DataConfig
  from diffjax.presets import load_config

  configs = os.path.join(REPO, "configs")
  for c in (
    load_config(os.path.join(configs, "paper_3b.py")),
    load_config(os.path.join(configs, "paper_sweep.py"), "830m"),
  ):
    with pytest.raises(ValueError, match="missing: data.paths, data.tokenizer"):
      DataConfig.from_dict(c.data)
    c.data.tokenizer = "tok.json"
    with pytest.raises(ValueError, match="missing: data.paths$|missing: data.paths "):
      DataConfig.from_dict(c.data)


@pytest.mark.integration
def test_train_on_prepared_stdlib_resumes_exactly(tmp_path):
  from helpers import read_metrics, tiny_config  # pylint: disable=import-outside-toplevel

  from diffjax.train.trainer import train_and_evaluate

  out = prepare(
    stdlib_files()[:40], str(tmp_path / "p"), shard_tokens=50_000, files_per_unit=10, progress=False
  )

  def config(steps):
    c = tiny_config(steps=steps)
    c.data.kind, c.data.paths, c.data.max_documents = "prepared", (os.path.dirname(out),), None
    c.checkpoint.every = 2
    c.eval_every, c.eval_batches = 2, 1
    return c

  straight = train_and_evaluate(config(4), str(tmp_path / "straight"))
  train_and_evaluate(config(2), str(tmp_path / "resumed"))
  resumed = train_and_evaluate(config(4), str(tmp_path / "resumed"))
  a, b = read_metrics(str(tmp_path / "straight")), read_metrics(str(tmp_path / "resumed"))
  assert sorted(a) == sorted(b) == [1, 2, 3, 4]
  for s in a:
    assert (
      a[s]["train/loss"] == b[s]["train/loss"]
      and a[s]["data/batch_hash"] == b[s]["data/batch_hash"]
    )
  assert straight["eval/loss"] == resumed["eval/loss"]


def _marked_processes(mark: str) -> list[int]:
  """The live processes whose environment holds ``mark`` (this user's, from /proc)."""
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/environ", "rb") as f:
        if mark.encode() in f.read():
          found.append(int(pid))
    except OSError:  # gone, or not ours
      pass
  return found


@pytest.mark.integration  # a preparation in worker processes, stopped
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_sigterm_stops_prepare_and_its_workers_and_the_rerun_resumes(tmp_path):
  src = tmp_path / "raw"
  src.mkdir()
  rng = np.random.default_rng(0)
  for i in range(120):
    (src / f"{i:03d}.txt").write_bytes(
      rng.integers(97, 123, size=100_000, dtype=np.uint8).tobytes()
    )
  mark = f"DIFFJAX_PREPARE_TEST_{os.getpid()}_{id(tmp_path)}"
  args = [
    "--input",
    str(src),
    "--output",
    str(tmp_path / "p"),
    "--workers",
    "2",
    "--files_per_unit",
    "1",
  ]
  proc = subprocess.Popen(
    [sys.executable, "-m", "diffjax.data.prepare", *args],
    stderr=subprocess.PIPE,
    text=True,
    cwd=REPO,
    env=dict(os.environ, JAX_PLATFORMS="cpu", **{mark: "1"}),
  )
  seen = []
  for line in proc.stderr:  # the first unit done: the workers are at work
    seen.append(line)
    if line.startswith("prepare: "):
      proc.send_signal(signal.SIGTERM)
      break
  err = "".join(seen) + proc.stderr.read()
  assert proc.wait(timeout=60) == 130, err[-3000:]
  assert _marked_processes(mark) == [], "workers outlived the command"
  lines = [line for line in own_stderr(err) if line.strip() and not line.startswith("prepare: 1")]
  assert lines and "stopped by signal 15" in lines[-1] and "Traceback" not in err, err[-3000:]
  done = subprocess.run(
    [sys.executable, "-m", "diffjax.data.prepare", *args],
    capture_output=True,
    text=True,
    cwd=REPO,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert read_manifest(str(tmp_path / "p")).num_documents == 120
