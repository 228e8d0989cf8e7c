"""`python -m diffjax.eval --workdir=RUN [--out=PATH] [--quick]`; see `diffjax.eval.cli`."""

import sys

from diffjax.eval.cli import main

if __name__ == "__main__":
  sys.exit(main())
