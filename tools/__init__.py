"""Tools that work on diffjax from beside the package (not installed with it).

Run them from the repository root, where ``tools`` is importable:

  python -m tools.gpu_compile [--target=h100] [--scope=default|widths|full]
  python benchmarks/tpu_roofline.py [--seq 1024] [--cross-check]

See tools/README.md.
"""
