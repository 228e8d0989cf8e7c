"""``python -m diffjax.generate --workdir=RUN --prompt="..."``: text from a train.py run.

The command is :mod:`diffjax.generation.command` (also ``python -m diffjax.generation``).
Imported rather than run, this name stays the function :func:`diffjax.generation.generate`:
the module puts the function in its own place, so ``import diffjax.generate`` does not
shadow ``diffjax.generate(model, prompts, ...)``.
"""

import sys

from diffjax.generation import generate
from diffjax.generation.command import main

if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
else:
  sys.modules[__name__] = generate
