"""``diffjax-lm-eval``: lm-eval's own command line, with the ``diffjax`` model registered.

lm-eval 0.4 reads no entry points for models, so this imports the package before handing over;
every flag and output is lm-eval's (docs/evaluation.md#lm-evaluation-harness-tasks).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from diffjax.errors import import_extra, run_guarded


def main(argv: Sequence[str] | None = None) -> int:
  """Runs lm-eval's command line on ``argv`` (default: ``sys.argv[1:]``) with ``diffjax``
  registered; returns its exit status (2 with one ``error:`` line for a mistake the user can
  fix, such as an unknown task or model, or a missing run)."""
  os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  main_module = import_extra("lm_eval.__main__", "harness", "diffjax-lm-eval")
  # Importing the model module registers DiffjaxLM as "diffjax" in lm-eval's model registry.
  import diffjax.eval.harness.model  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

  args = list(sys.argv[1:] if argv is None else argv)
  saved, status = sys.argv, []

  def run() -> None:
    try:
      main_module.cli_evaluate()
    except SystemExit as e:  # argparse's own errors and --help
      status.append(e.code if isinstance(e.code, int) else (0 if e.code is None else 1))

  # lm-eval's parser reads sys.argv itself.
  sys.argv = ["diffjax-lm-eval", *args]
  try:
    rc = run_guarded(run)
  finally:
    sys.argv = saved
  return rc or (status[0] if status else 0)


if __name__ == "__main__":
  sys.exit(main())
