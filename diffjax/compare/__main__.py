"""`python -m diffjax.compare --config=FILE --workdir=DIR`; see `diffjax.compare.command`."""

import sys

from diffjax import cli
from diffjax.compare.command import EXIT_INTERRUPTED, main

if __name__ == "__main__":
  code = main()
  if code == EXIT_INTERRUPTED:
    cli.exit_now(code)  # no interpreter shutdown in the middle of an interrupted compile
  sys.exit(code)
