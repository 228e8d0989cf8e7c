"""``python -m tools.gpu_compile``: the compile check of :mod:`tools.gpu_compile.check`."""

import sys

from tools.gpu_compile.check import main

sys.exit(main())
