"""`python -m diffjax.convert import|export ...`; see :mod:`diffjax.convert.cli`."""

import sys

from diffjax.convert.cli import main

if __name__ == "__main__":
  sys.exit(main())
