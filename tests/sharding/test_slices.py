"""Meshes over several TPU slices: the DCN share of each axis, what may cross slices, and the
count of what a compiled program sends between slices."""

import dataclasses

import jax
import numpy as np
import pytest

from diffjax import aot
from diffjax import sharding as shd
from diffjax.train.sections import MeshConfig


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  """Enough of a device for a Mesh: an id and the slice it sits in."""

  id: int
  slice_index: int
  platform: str = "tpu"


def _devices(slices: int, per_slice: int) -> list[FakeDevice]:
  return [FakeDevice(i, i // per_slice) for i in range(slices * per_slice)]


def _slices_along(mesh, axis: str) -> np.ndarray:
  i = mesh.axis_names.index(axis)
  ids = np.vectorize(lambda d: d.slice_index)(mesh.devices)
  return np.moveaxis(ids, i, -1).reshape(-1, mesh.shape[axis])


def test_slices_go_on_data_by_default_and_shape_is_the_mesh_within_a_slice():
  mesh = shd.make_mesh((1, -1, 2), devices=_devices(2, 8))
  assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 2, "context": 1}
  assert shd.mesh_dcn_shape(mesh) == (2, 1, 1, 1)
  # Along fsdp and tensor every device is in one slice; along data the slices alternate.
  assert all(len(set(row)) == 1 for row in _slices_along(mesh, "fsdp").tolist())
  assert all(len(set(row)) == 1 for row in _slices_along(mesh, "tensor").tolist())
  assert all(row == [0, 1] for row in _slices_along(mesh, "data").tolist())


def test_fsdp_across_slices_when_asked():
  mesh = shd.make_mesh((2, 2, 1), devices=_devices(4, 4), dcn_shape=(2, 2, 1))
  assert dict(mesh.shape) == {"data": 4, "fsdp": 4, "tensor": 1, "context": 1}
  assert shd.mesh_dcn_shape(mesh) == (2, 2, 1, 1)
  # The slices are the outer part of each axis: devices 0-1 of fsdp share a slice.
  rows = _slices_along(mesh, "fsdp").tolist()
  assert all(r[0] == r[1] and r[2] == r[3] and r[0] != r[2] for r in rows), rows


def test_gpu_hosts_are_not_slices():
  """A GPU's ``slice_index`` names its host: a multi-node GPU job is one mesh, as before."""
  devs = [FakeDevice(i, i // 4, platform="gpu") for i in range(8)]
  mesh = shd.make_mesh((1, -1, 1), devices=devs)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1, "context": 1}
  assert list(mesh.devices.flat) == devs
  assert shd.mesh_dcn_shape(mesh) == (1, 1, 1, 1)
  mesh = shd.make_mesh((1, 2, 4), devices=devs)  # tensor across hosts is the user's choice
  assert shd.mesh_dcn_shape(mesh) == (1, 1, 1, 1)


def test_one_slice_is_unchanged():
  devs = _devices(1, 8)
  mesh = shd.make_mesh((2, -1, 1), devices=devs)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1, "context": 1}
  assert list(mesh.devices.flat) == devs
  assert shd.mesh_dcn_shape(mesh) == (1, 1, 1, 1)


@pytest.mark.parametrize(
  "dcn, words",
  [((1, 1, 2), "tensor axis across 2 slices"), ((1, 1, 1, -1), "context axis across the")],
)
def test_tensor_or_context_across_slices_is_refused_in_one_line(dcn, words):
  for build in (
    lambda: shd.make_mesh((1, -1, 1), devices=_devices(2, 4), dcn_shape=dcn),
    lambda: MeshConfig(dcn_shape=dcn),
  ):
    with pytest.raises(ValueError) as e:
      build()
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert "mesh.dcn_shape=(-1, 1, 1, 1)" in str(e.value)


def test_a_dcn_shape_that_does_not_match_the_slices_is_refused():
  with pytest.raises(
    ValueError, match=r"spans 4 slices, but there are 2\. Make its product the 2 slices"
  ):
    shd.make_mesh((1, -1, 1), devices=_devices(2, 4), dcn_shape=(4, 1, 1))
  with pytest.raises(ValueError, match=r"spans 2 slices, but there are 1\."):
    shd.make_mesh((1, -1, 1), devices=_devices(1, 4), dcn_shape=(2, 1, 1))
  with pytest.raises(
    ValueError, match=r"the 3 slices do not divide by the fixed entries' product 2"
  ):
    shd.make_mesh((1, -1, 1), devices=_devices(3, 2), dcn_shape=(-1, 2, 1))
  with pytest.raises(ValueError, match="unequal sizes"):
    shd.make_mesh((1, -1, 1), devices=_devices(1, 4) + [FakeDevice(9, 1)])


def test_rules_that_would_split_the_sequence_or_heads_across_slices_are_refused():
  rules = dict(shd.DEFAULT_RULES)
  with pytest.raises(ValueError, match=r"would split 'length' across slices"):
    MeshConfig(dcn_shape=(2, 1, 1), rules={**rules, "length": "data"})
  with pytest.raises(ValueError, match=r"would split 'heads' across slices"):
    MeshConfig(dcn_shape=(1, 2, 1), rules={**rules, "heads": "fsdp"})
  # The default rules put only the batch (data, fsdp) and the embedding (fsdp) on those axes.
  MeshConfig(dcn_shape=(2, 2, 1))
  mesh = shd.make_mesh((1, -1, 1), devices=_devices(2, 4))
  shd.check_mesh_slices(mesh, shd.DEFAULT_RULES)
  with pytest.raises(ValueError, match=r"'vocab'"):
    shd.check_mesh_slices(mesh, tuple({**rules, "vocab": "data"}.items()))


# A hand-written compiled program in the TPU compiler's multi-slice form: one transfer before
# a loop of 3 trips that holds two more (one inside a nested loop of 4), a loop the compiler
# says runs 5 times, and a loop whose bound is not a constant (its transfer in the newer compilers' form, with a layout on u32[]).
_HLO = """\
HloModule m

%cond3 (p: (s32[])) -> pred[] {
  %c = s32[]{:T(128)} constant(3)
  %g = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%g, %c), direction=LT
}

%cond4 (p: (s32[])) -> pred[] {
  %c = s32[]{:T(128)} constant(4)
  %g = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%g, %c), direction=LT
}

%condx (p: (s32[], s32[])) -> pred[] {
  %a = s32[]{:T(128)} get-tuple-element(%p), index=0
  %b = s32[]{:T(128)} get-tuple-element(%p), index=1
  ROOT %lt = pred[]{:T(512)} compare(%a, %b), direction=LT
}

%inner (p: (s32[])) -> (s32[]) {
  %s = (bf16[8,8]{1,0:T(8,128)(2,1)}, u32[], token[]) send(%x, %t), channel_id=3, is_host_transfer=true, frontend_attributes={_xla_megascale_target="{1,2}x{0:7}",_xla_megascale_transfer_type="ALL_GATHER"}
}

%body (p: (s32[])) -> (s32[]) {
  %s = (f32[2,8]{1,0:T(8,128)}, u32[], token[]) send(%x, %t), channel_id=2, is_host_transfer=true, frontend_attributes={_xla_megascale_reduce_operation="SUM",_xla_megascale_transfer_type="ALL_REDUCE"}
  %w = (s32[]) while(%p), condition=%cond4, body=%inner
}

%other (p: (s32[], s32[])) -> (s32[], s32[]) {
  %s = (f32[16]{0:T(128)}, u32[]{:S(2)}, token[]) send(%x, %t), channel_id=4, is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type="ONE_TO_ONE"}
}

%known (p: (s32[])) -> (s32[]) {
  %s = (f8e4m3fn[16]{0}, u32[], token[]) send(%x, %t), channel_id=5, is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type="ALL_GATHER"}
  %s2 = (s4[8]{0}, u32[], token[]) send(%x, %t), channel_id=6, is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type="ALL_GATHER"}
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %s = (f32[4,4]{1,0:T(4,128)}, u32[], token[]) send(%a, %t), channel_id=1, is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}
  %r = (f32[4,4]{1,0}, u32[], token[]) recv(%t), channel_id=1, is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}
  %w = (s32[]) while(%init), condition=%cond3, body=%body, backend_config={}
  %v = (s32[], s32[]) while(%init2), condition=%condx, body=%other
  %k = (s32[]) while(%init3), condition=%cond3, body=%known, backend_config={"known_trip_count":{"n":"5"}}
  %l = f32[4]{0} all-reduce(%a), replica_groups={{0,1}}, to_apply=%add
}
"""


def test_dcn_traffic_counts_transfers_times_their_loops():
  t = aot.dcn_traffic(_HLO)
  assert t.bytes_by_kind == {
    "ALL_REDUCE": 4 * 4 * 4 + 3 * (2 * 8 * 4),  # once, then 3 trips
    # 3 x 4 trips of bf16[8,8]; the compiler's known trip count (5) over the condition's
    # bound (3) for f8e4m3fn[16] and s4[8] (half a byte each).
    "ALL_GATHER": 3 * 4 * (8 * 8 * 2) + 5 * (16 + 4),
    "ONE_TO_ONE": 16 * 4,  # a loop of unknown length: counted once
  }
  assert t.transfers == 1 + 3 + 12 + 1 + 10
  assert t.largest == "ALL_GATHER bf16[8,8]"
  assert t.unknown_loops == 1
  assert t.total_bytes == sum(t.bytes_by_kind.values())
  # Recvs, in-slice collectives and a program without transfers add nothing.
  assert aot.dcn_traffic("ENTRY %main () -> f32[] {\n}\n").total_bytes == 0
  with pytest.raises(ValueError, match="no ENTRY"):
    aot.dcn_traffic("not hlo")


def test_data_shard_rules_take_data_off_batch_only_when_it_leads_it():
  mesh = shd.make_mesh((2, 2, 1, 1), jax.devices()[:4])
  assert shd.data_shard_rules() is None  # no active rules
  with shd.activation_sharding(mesh, shd.DEFAULT_RULES):
    inner = dict(shd.data_shard_rules())
  assert inner["batch"] == "fsdp" and inner["embed"] == dict(shd.DEFAULT_RULES)["embed"]
  pure_data = tuple((n, "data" if n == "batch" else a) for n, a in shd.DEFAULT_RULES)
  with shd.activation_sharding(mesh, pure_data):
    assert dict(shd.data_shard_rules())["batch"] is None
  refused = [
    tuple((n, ("fsdp", "data") if n == "batch" else a) for n, a in shd.DEFAULT_RULES),
    tuple((n, "data" if n == "mlp" else a) for n, a in shd.DEFAULT_RULES),
  ]
  for rules in refused:
    with shd.activation_sharding(mesh, rules):
      assert shd.data_shard_rules() is None, rules
  with shd.activation_sharding(shd.make_mesh((1, 4, 1, 1), jax.devices()[:4]), shd.DEFAULT_RULES):
    assert shd.data_shard_rules() is None  # a data axis of 1
