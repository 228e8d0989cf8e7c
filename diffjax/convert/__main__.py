"""`python -m diffjax.convert import|export ...`; see :mod:`diffjax.convert.command`."""

import sys

from diffjax.convert.command import main

if __name__ == "__main__":
  sys.exit(main())
