"""`python -m diffjax.compare --config=FILE --workdir=DIR`; see `diffjax.compare.command`."""

import sys

from diffjax.compare.command import main

if __name__ == "__main__":
  sys.exit(main())
