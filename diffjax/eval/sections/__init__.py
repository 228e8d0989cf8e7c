"""The evaluation sections: one module per section, each defining a `Section` named `SECTION`,
and the registry `evaluate_model`, the scalars and the report read.

A section of your own is a `Section` passed to `register` (see docs/evaluation.md).
"""

from diffjax.eval.registry import (
  DESCRIPTIVE,
  HIGHER_IS_BETTER,
  LOWER_IS_BETTER,
  Direction,
  Section,
  get,
  register,
  registered,
  section_names,
  unregister,
)
from diffjax.eval.sections import (
  allocation,
  heatmap,
  lowbit,
  mechanisms,
  mqar,
  mqar_grid,
  probes,
  retrieval,
  text,
  validation,
)
from diffjax.eval.sections.context import Context

# The built-in sections in the order they run (and the report lists their scalars).
for _module in (
  validation,
  retrieval,
  heatmap,
  mqar,
  mqar_grid,
  allocation,
  text,
  mechanisms,
  lowbit,
  probes,
):
  register(_module.SECTION)
del _module

# The names of the built-in sections.
SECTIONS = section_names()

__all__ = [
  "DESCRIPTIVE",
  "HIGHER_IS_BETTER",
  "LOWER_IS_BETTER",
  "SECTIONS",
  "Context",
  "Direction",
  "Section",
  "get",
  "register",
  "registered",
  "section_names",
  "unregister",
]
