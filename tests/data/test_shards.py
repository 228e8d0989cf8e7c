"""The `.tokens` shard format: round trip, damage refused with the path, legacy ArrayRecord shards."""

import os

import numpy as np
import pytest

from diffjax.data.shards import (
  HEADER_BYTES,
  TokenShard,
  TokenShardWriter,
  shard_bytes,
  shard_documents,
)


def _docs(seed=0, n=40, lo=-5, hi=2**31 - 1):
  rng = np.random.default_rng(seed)
  return [
    rng.integers(lo, hi, size=int(rng.integers(0, 90)), dtype=np.int64, endpoint=True)
    for _ in range(n)
  ]


def _write(path, docs, token_bytes=4):
  with TokenShardWriter(path, token_bytes) as w:
    for d in docs:
      w.write(d)
  return str(path)


@pytest.mark.parametrize("token_bytes", [2, 4])
def test_round_trip_in_any_order_and_exact_size(tmp_path, token_bytes):
  docs = _docs(hi=2**16 - 1 if token_bytes == 2 else 2**31 - 1, lo=0 if token_bytes == 2 else -5)
  docs[1][:3] = [0, 2**16 - 1, 2**15] if token_bytes == 2 else [-(2**31), 2**31 - 1, 0]
  path = _write(tmp_path / "a.tokens", docs, token_bytes)
  assert os.path.getsize(path) == shard_bytes(len(docs), sum(d.size for d in docs), token_bytes)
  shard = TokenShard(path)
  assert len(shard) == len(docs) and shard.num_tokens == sum(d.size for d in docs)
  for i in np.random.default_rng(1).permutation(len(docs)):
    got = shard[i]
    assert got.dtype == np.int32 and np.array_equal(got, docs[i]), i
  assert all(np.array_equal(a, b) for a, b in zip(shard_documents(path), docs))
  with pytest.raises(IndexError, match="outside"):
    shard[len(docs)]
  shard.close()


def test_output_is_byte_identical_on_a_rerun(tmp_path):
  a, b = _write(tmp_path / "a.tokens", _docs(3)), _write(tmp_path / "b.tokens", _docs(3))
  assert open(a, "rb").read() == open(b, "rb").read()


def test_writer_refuses_what_is_not_int32_token_ids(tmp_path):
  with TokenShardWriter(tmp_path / "w.tokens") as w:
    with pytest.raises(ValueError, match="1-D sequence of integer"):
      w.write(np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="1-D sequence of integer"):
      w.write(np.array([0.5]))
    with pytest.raises(ValueError, match=r"\[-2147483648, 2147483647\]"):
      w.write(np.array([2**31]))
  with TokenShardWriter(tmp_path / "w2.tokens", token_bytes=2) as w:
    with pytest.raises(ValueError, match=r"\[0, 65535\] for 2-byte tokens"):
      w.write(np.array([3, 65536]))
    with pytest.raises(ValueError, match=r"\[0, 65535\]"):
      w.write(np.array([-1]))
  with pytest.raises(ValueError, match="2 or 4 bytes"):
    TokenShardWriter(tmp_path / "w3.tokens", token_bytes=3)


@pytest.mark.parametrize("damage", ["truncated", "magic", "version", "offsets"])
def test_damaged_shard_is_refused_naming_the_file(tmp_path, damage):
  docs = _docs(2)
  path = _write(tmp_path / "d.tokens", docs)
  raw = bytearray(open(path, "rb").read())
  if damage == "truncated":
    raw = raw[:-9]
  elif damage == "magic":
    raw[:8] = b"NOTATOKS"
  elif damage == "version":
    raw[8] = 7
  else:  # document 3's end offset beyond the tokens
    n = sum(d.size for d in docs)
    at = HEADER_BYTES + 4 * n + 8 * 4
    raw[at : at + 8] = (n + 100).to_bytes(8, "little")
  open(path, "wb").write(bytes(raw))
  with pytest.raises(ValueError, match=str(path).replace(".", r"\.")):
    shard = TokenShard(path)
    for i in range(len(docs)):
      shard[i]  # pylint: disable=pointless-statement
