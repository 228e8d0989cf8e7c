"""Deviceless GPU compile checks of the Mosaic GPU kernels: :mod:`.check` (the command,
``python -m tools.gpu_compile``) and :mod:`.ptxas` (what ptxas and Mosaic GPU report
per compiled kernel). Run from the repository root with the ``[gpu-compile]`` extra."""
