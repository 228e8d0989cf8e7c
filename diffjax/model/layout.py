"""The two on-disk layouts of a model's layers (unrolled ``blocks``, scanned ``layers``), and
conversion between them for parameter and optimizer trees (docs/scaling.md#scanned-layers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

UNSCANNED, SCANNED = "blocks", "layers"


def _holds_layers(x: Any) -> bool:
  return isinstance(x, dict) and (UNSCANNED in x or SCANNED in x)


def tree_layout(tree: Any) -> str | None:
  """``"blocks"`` or ``"layers"``: the layout of the layer dicts in ``tree``; None if none.

  Raises ValueError for a tree that mixes both.
  """
  found = set()
  for node in jax.tree.leaves(tree, is_leaf=_holds_layers):
    if _holds_layers(node):
      found.update(k for k in (UNSCANNED, SCANNED) if k in node)
  if len(found) > 1:
    raise ValueError("The tree holds both per-layer 'blocks' and stacked 'layers'.")
  return found.pop() if found else None


def _rewrite(tree: Any, fn: Callable[[dict], dict]) -> Any:
  return jax.tree.map(lambda x: fn(x) if _holds_layers(x) else x, tree, is_leaf=_holds_layers)


def stack_layers(tree: Any, stack: Callable[[list[Any]], Any] | None = None) -> Any:
  """``{"blocks": {i: block_i}}`` to ``{"layers": stacked}`` wherever it occurs in ``tree``.

  ``stack`` joins the L corresponding leaves (default ``jnp.stack``; pass another to
  stack e.g. ``jax.ShapeDtypeStruct`` leaves).
  """
  stack = stack or (lambda xs: jnp.stack(xs))

  def convert(d: dict) -> dict:
    if UNSCANNED not in d:
      return d
    blocks = d[UNSCANNED]
    keys = sorted(blocks, key=int)
    if [int(k) for k in keys] != list(range(len(keys))):
      raise ValueError(f"Layer keys {keys} are not 0..{len(keys) - 1}.")
    out = {k: v for k, v in d.items() if k != UNSCANNED}
    out[SCANNED] = jax.tree.map(lambda *xs: stack(list(xs)), *[blocks[k] for k in keys])
    return out

  return _rewrite(tree, convert)


def unstack_layers(
  tree: Any, num_layers: int, take: Callable[[Any, int], Any] | None = None
) -> Any:
  """``{"layers": stacked}`` to ``{"blocks": {i: block_i}}`` wherever it occurs in ``tree``.

  ``take(leaf, i)`` returns layer ``i`` of a stacked leaf (default ``leaf[i]``).
  """
  take = take or (lambda x, i: x[i])

  def convert(d: dict) -> dict:
    if SCANNED not in d:
      return d
    stacked = d[SCANNED]
    for leaf in jax.tree.leaves(stacked):
      if not jnp.shape(leaf) or jnp.shape(leaf)[0] != num_layers:
        raise ValueError(
          f"A stacked layer leaf of shape {jnp.shape(leaf)} does not lead with "
          f"num_layers={num_layers}."
        )
    out = {k: v for k, v in d.items() if k != SCANNED}
    out[UNSCANNED] = {
      i: jax.tree.map(lambda x, i=i: take(x, i), stacked) for i in range(num_layers)
    }
    return out

  return _rewrite(tree, convert)


def convert_layout(
  tree: Any,
  layout: str,
  num_layers: int,
  *,
  stack: Callable[[list[Any]], Any] | None = None,
  take: Callable[[Any, int], Any] | None = None,
) -> Any:
  """``tree`` in ``layout`` (``"blocks"`` or ``"layers"``); unchanged if already there."""
  if layout not in (UNSCANNED, SCANNED):
    raise ValueError(f"layout={layout!r} must be {UNSCANNED!r} or {SCANNED!r}.")
  current = tree_layout(tree)
  if current is None or current == layout:
    return tree
  if layout == SCANNED:
    return stack_layers(tree, stack)
  return unstack_layers(tree, num_layers, take)


def num_layers_of(tree: Any) -> int | None:
  """The number of layers the layer dicts in ``tree`` hold (None if it has none)."""
  for node in jax.tree.leaves(tree, is_leaf=_holds_layers):
    if not _holds_layers(node):
      continue
    if UNSCANNED in node:
      return len(node[UNSCANNED])
    leaves = jax.tree.leaves(node[SCANNED])
    if leaves:
      return int(jnp.shape(leaves[0])[0])
  return None


def names_layout(leaf_names: Any) -> str | None:
  """The layout of a checkpoint from its leaf names (``.../blocks/0/...`` or ``.../layers/...``)."""
  for name in leaf_names:
    parts = str(name).split("/")
    if UNSCANNED in parts:
      return UNSCANNED
    if SCANNED in parts:
      return SCANNED
  return None
