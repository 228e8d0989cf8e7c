"""`python -m diffjax.eval --workdir=RUN [--out=PATH] [--quick]`; see `diffjax.eval.command`."""

import sys

from diffjax import cli
from diffjax.eval.command import main

if __name__ == "__main__":
  code = main()
  if code == cli.EXIT_INTERRUPTED:
    cli.exit_now(code)  # no interpreter shutdown in the middle of an interrupted compile
  sys.exit(code)
