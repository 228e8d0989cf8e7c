"""`python -m diffjax.eval --workdir=RUN [--out=PATH] [--quick]`; see `diffjax.eval.command`."""

import sys

from diffjax.eval.command import main

if __name__ == "__main__":
  sys.exit(main())
