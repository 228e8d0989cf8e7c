"""``python -m diffjax.generation``: see :mod:`diffjax.generation.command`."""

import sys

from diffjax.generation.command import main

if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
