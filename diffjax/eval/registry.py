"""`Section`, one evaluation of `evaluate_model`, and the ordered registry of sections.

Everything about a section lives on its `Section`: how it runs, its scalars and their directions,
the headline and the report's figure and table (docs/evaluation.md#adding-a-section).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

# Which way a scalar is better: the value `diffjax.eval.stats.verdict` takes.
Direction = bool | None
HIGHER_IS_BETTER: Direction = True
LOWER_IS_BETTER: Direction = False
DESCRIPTIVE: Direction = None


def _always(_config: Any) -> bool:
  return True


def _no_scalars(_result: Mapping[str, Any]) -> dict[str, float]:
  return {}


@dataclasses.dataclass(frozen=True)
class Section:
  """One evaluation section.

  Attributes:
    name: its key in the eval JSON's "sections", in `EvalConfig.sections` and in `--sections`.
    run: `Context` -> the section's result, a dict of numbers, strings, lists and dicts (numpy
      values are converted to JSON types after it returns).
    scalars: the result -> {scalar name: number}, the flat summary the report aggregates over
      seeds. Name the scalars "<prefix>/<what>" with a prefix no other section uses.
    directions: {scalar name pattern: direction} with `fnmatch` patterns ("retrieval/*"):
      HIGHER_IS_BETTER, LOWER_IS_BETTER or DESCRIPTIVE; the first pattern that matches a name
      wins, and a scalar that no pattern matches is descriptive. The report says "better" or
      "worse" only for scalars with a direction.
    headline: scalar names the report's summary states first, in this order.
    needs_validation: the section scores validation batches; without any it is skipped with a
      log line.
    enabled: `EvalConfig` -> whether the config gives the section anything to do (the heatmap
      without lengths has not); a disabled section is skipped silently.
    plot: (pyplot, {arm: runs}, {arm: colour}, out_dir) -> (PNG file name, caption) of the
      report's figure of this section, or None when no run has its data.
    table: ({arm: runs}, aggregate) -> markdown lines of the report's table of this section
      ([] when no run has its data); the aggregate is `diffjax.eval.aggregate.aggregate`'s.
  """

  name: str
  run: Callable[[Any], Mapping[str, Any]]
  scalars: Callable[[Mapping[str, Any]], dict[str, float]] = _no_scalars
  directions: Mapping[str, Direction] = dataclasses.field(default_factory=dict)
  headline: tuple[str, ...] = ()
  needs_validation: bool = False
  enabled: Callable[[Any], bool] = _always
  plot: Callable[..., tuple[str, str] | None] | None = None
  table: Callable[..., list[str]] | None = None

  def __post_init__(self):
    if not self.name or not isinstance(self.name, str) or "," in self.name:
      raise ValueError(
        f"Section name {self.name!r} must be a non-empty string without commas "
        "(--sections takes a comma list)."
      )

  def direction(self, metric: str) -> tuple[bool, Direction]:
    """(whether one of `directions`' patterns matches `metric`, the direction it gives)."""
    for pattern, direction in self.directions.items():
      if fnmatch.fnmatchcase(metric, pattern):
        return True, direction
    return False, None


_REGISTRY: dict[str, Section] = {}


def register(section: Section, *, replace: bool = False) -> Section:
  """Adds `section` after the registered ones (in place of the one of its name with
  `replace=True`); returns it."""
  if not isinstance(section, Section):
    raise TypeError(f"register takes a Section; got {type(section).__name__}.")
  if section.name in _REGISTRY and not replace:
    raise ValueError(
      f"A section named {section.name!r} is already registered; pick another name, "
      "unregister it first, or pass replace=True."
    )
  _REGISTRY[section.name] = section
  return section


def unregister(name: str) -> Section:
  """Removes the section called `name`; returns it."""
  if name not in _REGISTRY:
    raise KeyError(f"No section named {name!r}; the sections are {section_names()}.")
  return _REGISTRY.pop(name)


def get(name: str) -> Section:
  """The registered section called `name`."""
  if name not in _REGISTRY:
    raise KeyError(f"No section named {name!r}; the sections are {section_names()}.")
  return _REGISTRY[name]


def registered() -> tuple[Section, ...]:
  """Every registered section, in the order `evaluate_model` runs them."""
  return tuple(_REGISTRY.values())


def section_names() -> tuple[str, ...]:
  """The names of the registered sections, in order."""
  return tuple(_REGISTRY)
