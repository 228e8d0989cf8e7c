"""The TPU DIFF V1 decode kernel, checked against the plain-JAX decode reference.

Without a TPU the kernel runs in the TPU interpreter (``interpret=True``), and the
Mosaic compiler is exercised by ahead-of-time compiles for v5e and v5p topologies
(libtpu, no TPU needed), which also check that the kernel reads the cache in its
default TPU layout without a copy. ``slow`` tests widen the shapes and run a model's
decode steps through the kernel (``pytest -m slow``).

Tolerances: ``max|kernel - reference| / max|reference|`` against the float32 reference
on the same (rounded) inputs: float32 1e-5 (observed below 1e-6), bfloat16 2e-2.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_checks import TOL, normal, rel_err  # noqa: E402

from diffjax import ops, sharding
from diffjax.aot import without_persistent_cache
from diffjax.generation import CACHE_MULTIPLE
from diffjax.kernels import tpu as kt
from diffjax.kernels.gpu.decode import diff_v1_decode_reference
from diffjax.kernels.tpu import decode as tpu_decode
from diffjax.ops import dispatch

F32_TOL = 1e-5


def _inputs(b, s, h, kh, d, dv, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 6)
  q1, q2 = (normal(ks[i], (b, 1, h, d), dtype) for i in (0, 1))
  k1, k2 = (normal(ks[i], (b, s, kh, d), dtype) for i in (2, 3))
  v = normal(ks[4], (b, s, kh, dv), dtype)
  lam = jax.random.uniform(ks[5], (h,), jnp.float32, 0.1, 0.8)
  return q1, q2, k1, k2, v, lam


def _reference(q1, q2, k1, k2, v, lam, kv_len):
  f32 = lambda x: x.astype(jnp.float32)
  return jax.jit(diff_v1_decode_reference)(f32(q1), f32(q2), f32(k1), f32(k2), f32(v), lam, kv_len)


def _junk_past(x, kv_len, value):
  """x with every slot at or past kv_len[b] set to ``value``."""
  s = x.shape[1]
  valid = (jnp.arange(s)[None, :] < jnp.clip(kv_len, 0, s)[:, None])[:, :, None, None]
  return jnp.where(valid, x, jnp.asarray(value, x.dtype))


# Each case names the views the kernel reads the cache through (k's, v's): see
# diffjax.kernels.tpu.decode.cache_view.
CASES = {
  # D=64, Dv=128; S=384 is not a multiple of the 256 block (read in 128 blocks);
  # lengths 0, mid-block and S.
  "d64_gqa2": dict(
    b=3, s=384, h=4, kh=2, d=64, dv=128, lens=(0, 200, 384), block_kv=256, views=("kds", "skd")
  ),
  # One head per group (G=1), three groups; S=200 > block: the padded (copied) path;
  # lengths 1, one block, one past a block boundary, S.
  "g1_padded": dict(
    b=4,
    s=200,
    h=3,
    kh=3,
    d=128,
    dv=256,
    lens=(1, 128, 129, 200),
    block_kv=128,
    views=("ksd", "ksd"),
  ),
  # An odd group (G=3) and a single row: two splits of two blocks each.
  "g3_split": dict(
    b=1, s=512, h=6, kh=2, d=32, dv=64, lens=(300,), block_kv=128, views=("kds", "kds")
  ),
  # Odd head dims, one kv group, S below the block (one block of S); lengths past S
  # and below 0 are clipped.
  "odd_d": dict(
    b=3, s=100, h=4, kh=1, d=20, dv=40, lens=(107, 5, -2), block_kv=512, views=("kds", "kds")
  ),
  # Row-major cache tiles (K=2, D=128): the kernel's flat form.
  "d128_rows": dict(
    b=2, s=256, h=4, kh=2, d=128, dv=256, lens=(129, 256), block_kv=128, views=("skd", "skd")
  ),
}


def _run_case(case, dtype=jnp.float32, seed=0):
  c = CASES[case]
  args = _inputs(c["b"], c["s"], c["h"], c["kh"], c["d"], c["dv"], dtype, seed)
  kv_len = jnp.array(c["lens"], jnp.int32)
  blocks = kt.DecodeBlockSizes(block_kv=c["block_kv"])
  out = kt.diff_v1_decode_pallas_tpu(*args, kv_len, block_sizes=blocks, interpret=True)
  return args, kv_len, blocks, out


@pytest.mark.parametrize("case", list(CASES))
def test_decode_matches_reference(case):
  c = CASES[case]
  itemsize = 4
  assert (
    tpu_decode.cache_view(c["kh"], c["d"], itemsize),
    tpu_decode.cache_view(c["kh"], c["dv"], itemsize),
  ) == c["views"]
  args, kv_len, _, out = _run_case(case)
  want = _reference(*args, kv_len)
  assert out.shape == (c["b"], 1, c["h"], c["dv"]) and out.dtype == jnp.float32
  assert rel_err(out, want) <= F32_TOL, rel_err(out, want)
  for row, n in enumerate(c["lens"]):
    if n <= 0:
      np.testing.assert_array_equal(np.asarray(out[row]), 0.0)


@pytest.mark.parametrize("case", ["d64_gqa2", "g1_padded", "d128_rows"])
def test_slots_past_kv_len_do_not_matter(case):
  args, kv_len, blocks, out = _run_case(case)
  q1, q2, k1, k2, v, lam = args
  for value in (1e4, jnp.nan):
    junk = lambda x, value=value: _junk_past(x, kv_len, value)
    out_junk = kt.diff_v1_decode_pallas_tpu(
      q1, q2, junk(k1), junk(k2), junk(v), lam, kv_len, block_sizes=blocks, interpret=True
    )
    # The kernel never mixes a slot past kv_len into a result: bit-identical outputs.
    np.testing.assert_array_equal(np.asarray(out_junk), np.asarray(out))


@pytest.mark.parametrize("case", ["d64_gqa2", "d128_rows"])
def test_decode_bf16(case):
  args, kv_len, _, out = _run_case(case, jnp.bfloat16, seed=1)
  assert out.dtype == jnp.bfloat16
  assert rel_err(out, _reference(*args, kv_len)) <= TOL[jnp.bfloat16]


def test_default_blocks_and_cache_multiple():
  # The generation engine's cache length is one the kernel reads in place.
  assert CACHE_MULTIPLE % kt.cache_length_multiple(64, 128) == 0
  assert kt.DecodeBlockSizes.get_default(64, 128, kv_heads=2, itemsize=2).block_kv == 1024
  # 8 groups of D=128, Dv=256 in bfloat16: 8 KiB per position, 512 positions in 4 MiB.
  assert kt.DecodeBlockSizes.get_default(128, 256, kv_heads=8, itemsize=2).block_kv == 512
  assert kt.DecodeBlockSizes.get_default(128, 256, kv_heads=64, itemsize=4).block_kv == 128
  assert tpu_decode._block_kv(640, kt.DecodeBlockSizes(block_kv=512)) == (128, 640)
  assert tpu_decode._block_kv(1536, kt.DecodeBlockSizes(block_kv=512)) == (512, 1536)
  assert tpu_decode._block_kv(300, kt.DecodeBlockSizes(block_kv=512)) == (300, 300)
  assert tpu_decode._block_kv(700, kt.DecodeBlockSizes(block_kv=512)) == (384, 768)  # padded


@pytest.mark.parametrize("kv_len", [0, 1, 127, 128, 129, 640, 700])
@pytest.mark.parametrize("splits", [1, 2, 3])
def test_no_block_past_kv_len_is_read(kv_len, splits):
  # The block index of each grid step: the valid blocks in order, then the last one
  # again (the pipeline issues no DMA for an unchanged index).
  bk, n_blocks = 128, 6
  per_split = -(-n_blocks // splits)
  lens = jnp.array([kv_len], jnp.int32)
  valid = max(-(-kv_len // bk), 1)
  for si in range(splits):
    got = [
      int(tpu_decode._kv_block(0, si, j, lens, block_kv=bk, blocks_per_split=per_split))
      for j in range(per_split)
    ]
    want = [min(si * per_split + j, valid - 1) for j in range(per_split)]
    assert got == want, (si, got)


def test_decode_rejects_bad_arguments():
  q1, q2, k1, k2, v, lam = _inputs(2, 64, 2, 2, 16, 32)
  two = lambda x: jnp.concatenate([x, x], axis=1)
  with pytest.raises(ValueError, match="one query token"):
    kt.diff_v1_decode_pallas_tpu(
      two(q1), two(q2), k1, k2, v, lam, jnp.array([3, 4]), interpret=True
    )
  with pytest.raises(ValueError, match="kv_len must be an integer array of shape"):
    kt.diff_v1_decode_pallas_tpu(q1, q2, k1, k2, v, lam, jnp.array([3.0, 4.0]), interpret=True)
  with pytest.raises(ValueError, match="multiple of 128"):
    kt.DecodeBlockSizes(block_kv=96)
  with pytest.raises(ValueError, match="Unknown DecodeBlockSizes fields"):
    kt.diff_v1_decode_pallas_tpu(
      q1, q2, k1, k2, v, lam, jnp.array([3, 4]), block_sizes={"bq": 8}, interpret=True
    )


# ----------------------------------------------------------------------------------
# Dispatch: the ops run the kernel for "auto" on a TPU and for "pallas_tpu".


@pytest.mark.integration  # the interpreted kernel through the ops API
def test_auto_on_tpu_and_pallas_tpu_run_the_kernel_and_match_xla():
  q1, q2, k1, k2, v, _ = _inputs(3, 128, 6, 2, 16, 32, seed=2)
  args = (q1, q2, k1, k2, v, 0.3, jnp.array([1, 77, 128]))
  spec = dispatch.OPS["diff_v1_decode"]
  with ops.target_platform("tpu"):
    assert dispatch.choose(spec, "auto", (*args[:5], jnp.asarray(0.3), args[6])) == "pallas_tpu"
  (row,) = [r for r in dispatch.rows("diff_v1_decode") if r.name == "pallas_tpu"]
  assert row.fn is kt.diff_v1_decode_pallas_tpu
  got = ops.diff_v1_attention_decode(*args, implementation="pallas_tpu", interpret=True)
  want = ops.diff_v1_attention_decode(*args, implementation="xla")
  assert rel_err(got, want) <= F32_TOL
  # Under activation_sharding the op wraps the kernel in shard_map (one device here).
  mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  with sharding.activation_sharding(mesh, sharding.DEFAULT_RULES):
    run = lambda *a: ops.diff_v1_attention_decode(*a, implementation="pallas_tpu", interpret=True)
    assert "shard_map" in str(jax.make_jaxpr(run)(*args))
    got_sharded = run(*args)
  assert rel_err(got_sharded, want) <= F32_TOL


@pytest.mark.slow  # the interpreted kernel inside a jitted model step compiles slowly
def test_model_decode_steps_with_the_kernel_equal_the_full_forward():
  # Prefill a ragged batch into a cache on the XLA path, then decode steps of the same
  # DIFF V1 model with its attention on the TPU kernels (interpreted) must give the
  # full forward's logits.
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from diffjax.model import DecoderLM, ModelConfig  # pylint: disable=g-import-not-at-top

  kw = dict(
    attention="diff_v1",
    vocab_size=61,
    d_model=32,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=64,
  )
  model = DecoderLM(ModelConfig(implementation="xla", **kw), rngs=nnx.Rngs(3))
  kernel_model = DecoderLM(
    ModelConfig(implementation="pallas_tpu", interpret=True, **kw), rngs=nnx.Rngs(3)
  )
  seq_BxT = jax.random.randint(jax.random.key(0), (3, 8), 0, 61)
  full_BxTxV = model(seq_BxT)
  lens = jnp.array([2, 6, 4])
  _, cache = model(
    seq_BxT[:, :6], cache=model.init_cache(3, 8), cache_lengths_B=jnp.zeros(3, jnp.int32)
  )
  step = jax.jit(lambda c, t, p: kernel_model(t[:, None], p[:, None], cache=c, cache_lengths_B=p))
  rows = jnp.arange(3)
  assert "diff_v1_decode" in str(jax.make_jaxpr(step)(cache, seq_BxT[rows, lens], lens))
  for pos_B in (lens, lens + 1):
    logits_Bx1xV, cache = step(cache, seq_BxT[rows, pos_B], pos_B)
    assert rel_err(logits_Bx1xV[:, 0], full_BxTxV[rows, pos_B]) <= F32_TOL


# ----------------------------------------------------------------------------------
# Mosaic compiles for real TPU topologies (libtpu, no TPU).


def _topology(name: str):
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    return topologies.get_topology_desc(name, "tpu")
  except Exception as e:  # pylint: disable=broad-except
    pytest.skip(f"no TPU compiler here (install jax[tpu] / libtpu): {e}")


def _cache_copies(hlo: str, cache_size: int) -> list[str]:
  """Copies and transposes in ``hlo`` of arrays at least ``cache_size`` elements big."""
  out = []
  for line in hlo.splitlines():
    m = re.search(r"= \(?\w+\[([\d,]+)\]", line)
    if m and ("copy" in line or "transpose" in line) and "ENTRY" not in line:
      if np.prod([int(x) for x in m.group(1).split(",")]) >= cache_size:
        out.append(line.strip()[:200])
  return out


def _compile_decode_step(devices, b, s, h, kh, d, dv, dtype):
  """Compiles a generation-like step: write one slot of each cache array, then decode."""
  mesh = jax.sharding.Mesh(np.array(devices[:1]), ("x",))
  sds = lambda shape, dt=dtype: jax.ShapeDtypeStruct(
    shape, dt, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  )
  args = (
    sds((b, 1, h, d)),
    sds((b, 1, h, d)),
    sds((b, s, kh, d)),
    sds((b, s, kh, d)),
    sds((b, s, kh, dv)),
    sds((h,), jnp.float32),
    sds((b,), jnp.int32),
  )

  def step(q1, q2, k1, k2, v, lam, kv_len):
    write = lambda x: jax.lax.dynamic_update_slice(
      x, jnp.ones((b, 1) + x.shape[2:], x.dtype), (0, kv_len[0] - 1, 0, 0)
    )
    k1, k2, v = write(k1), write(k2), write(v)
    return kt.diff_v1_decode_pallas_tpu(q1, q2, k1, k2, v, lam, kv_len), (k1, k2, v)

  with without_persistent_cache(), jax.set_mesh(mesh):
    return jax.jit(step, donate_argnums=(2, 3, 4)).lower(*args).compile().as_text()


AOT_CASES = [
  # topology, (b, s, h, kh, d, dv, dtype): one of each cache view.
  ("v5e:2x2", (4, 2048, 8, 2, 64, 128, jnp.float32)),  # kds, skd
  ("v5e:2x2", (2, 2048, 6, 3, 128, 256, jnp.bfloat16)),  # ksd
  ("v5p:2x2x1", (1, 4096, 8, 4, 32, 64, jnp.bfloat16)),  # kds, two splits
  ("v5p:2x2x1", (8, 4096, 16, 8, 128, 256, jnp.bfloat16)),  # skd (flat), 8 groups
  pytest.param("v5e:2x2", (4, 2048, 8, 2, 128, 256, jnp.bfloat16), marks=pytest.mark.slow),
  pytest.param("v5e:2x2", (4, 2048, 8, 4, 64, 128, jnp.bfloat16), marks=pytest.mark.slow),
  pytest.param("v5e:2x2", (8, 4096, 24, 24, 64, 128, jnp.bfloat16), marks=pytest.mark.slow),
  pytest.param("v5e:2x2", (2, 2048, 8, 1, 128, 256, jnp.float32), marks=pytest.mark.slow),
  pytest.param("v5p:2x2x1", (2, 2048, 8, 1, 128, 256, jnp.bfloat16), marks=pytest.mark.slow),
  pytest.param("v5p:2x2x1", (4, 2048, 8, 4, 96, 192, jnp.float32), marks=pytest.mark.slow),
]


@pytest.mark.integration  # an AOT compile gate
@pytest.mark.parametrize("topology,shape", AOT_CASES)
def test_aot_compile_reads_the_cache_in_place(topology, shape):
  topo = _topology(topology)
  b, s, _, kh, d, dv, _ = shape
  hlo = _compile_decode_step(topo.devices, *shape)
  assert "tpu_custom_call" in hlo and "diff_v1_decode" in hlo
  # The kernel's operands are bitcasts of the cache in its default layout: no copy.
  assert not _cache_copies(hlo, b * s * kh * min(d, dv)), _cache_copies(hlo, b * s * kh * d)


@pytest.mark.integration  # an AOT compile gate
def test_aot_compile_sharded_op_on_v5e():
  """The op under a mesh: "auto" resolves to the kernel, run per device in shard_map."""
  topo = _topology("v5e:2x2")
  mesh = sharding.make_mesh((2, 1, 2), devices=topo.devices)  # data 2, tensor 2
  b, s, h, kh, d = 4, 1024, 8, 4, 64
  P = jax.sharding.PartitionSpec
  sds = lambda shape, spec, dt=jnp.bfloat16: jax.ShapeDtypeStruct(
    shape, dt, sharding=jax.sharding.NamedSharding(mesh, spec)
  )
  heads = P("data", None, "tensor", None)
  args = (
    sds((b, 1, h, d), heads),
    sds((b, 1, h, d), heads),
    sds((b, s, kh, d), heads),
    sds((b, s, kh, d), heads),
    sds((b, s, kh, 2 * d), heads),
    sds((h,), P(), jnp.float32),
    sds((b,), P("data"), jnp.int32),
  )

  def decode(*a):
    with sharding.activation_sharding(mesh, sharding.DEFAULT_RULES):
      return ops.diff_v1_attention_decode(*a, implementation="auto", block_sizes={"block_kv": 256})

  with ops.target_platform("tpu"), without_persistent_cache():
    hlo = jax.jit(decode).lower(*args).compile().as_text()
  assert "tpu_custom_call" in hlo and "diff_v1_decode" in hlo
  # Each device reads its shard of the cache in place.
  assert not _cache_copies(hlo, (b // 2) * s * (kh // 2) * d), _cache_copies(hlo, 0)


# ----------------------------------------------------------------------------------
# Wider coverage.


@pytest.mark.slow
@pytest.mark.parametrize(
  "b,s,h,kh,d,dv,block_kv,splits,dtype",
  [
    (2, 1024, 8, 4, 64, 128, 256, None, jnp.float32),
    (1, 1000, 4, 2, 64, 128, 256, 3, jnp.float32),  # padded, three splits
    (3, 640, 12, 4, 32, 64, 512, None, jnp.float32),  # 640: blocks of 128
    (2, 512, 16, 8, 128, 256, 128, 2, jnp.float32),
    (2, 384, 6, 6, 128, 256, 128, None, jnp.bfloat16),
    (2, 384, 8, 1, 128, 256, 256, None, jnp.bfloat16),
  ],
)
def test_decode_matches_reference_wide(b, s, h, kh, d, dv, block_kv, splits, dtype):
  args = _inputs(b, s, h, kh, d, dv, dtype, seed=5)
  kv_len = jnp.array([s, 1, s // 2 + 3][:b], jnp.int32)
  blocks = kt.DecodeBlockSizes(block_kv=block_kv, num_splits=splits)
  out = kt.diff_v1_decode_pallas_tpu(*args, kv_len, block_sizes=blocks, interpret=True)
  tol = F32_TOL if dtype == jnp.float32 else TOL[jnp.bfloat16]
  assert rel_err(out, _reference(*args, kv_len)) <= tol


@pytest.mark.integration  # the interpreter's race detector
def test_no_races_in_interpreter():
  """The split decode (two programs per row, each double-buffering its cache blocks) under
  the interpreter's race detector, on two simulated cores."""
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top

  c = CASES["g3_split"]
  args = _inputs(c["b"], c["s"], c["h"], c["kh"], c["d"], c["dv"])
  kv_len = jnp.array(c["lens"], jnp.int32)
  pltpu.reset_tpu_interpret_mode_state()
  out = kt.diff_v1_decode_pallas_tpu(
    *args,
    kv_len,
    block_sizes=kt.DecodeBlockSizes(block_kv=c["block_kv"]),
    interpret=pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2),
  )
  assert rel_err(out, _reference(*args, kv_len)) <= F32_TOL
  assert ipc.races is not None and not ipc.races.races_found
