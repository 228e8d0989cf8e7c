"""``python -m diffjax.serve``: see :mod:`diffjax.serve.command`."""

import sys

from diffjax.serve.command import main

if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
