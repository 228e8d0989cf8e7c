"""``python -m diffjax.eval.harness``: see :mod:`diffjax.eval.harness.command`."""

import sys

from diffjax.eval.harness.command import main

if __name__ == "__main__":
  sys.exit(main())
