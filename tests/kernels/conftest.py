"""The kernels' ``slow`` tests are their full grids (every shape, dtype and tile of the
interpreted kernels, every kernel compiled through ptxas): hours on a 2-core machine. They also
carry the ``grid`` marker, which the full suite's second call leaves out; run them with
``python -m pytest -m grid`` before a kernel change lands."""

import pytest


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the markers
def pytest_collection_modifyitems(items):
  here = __file__.rsplit("/", 1)[0] + "/"
  for item in items:
    if str(item.fspath).startswith(here) and item.get_closest_marker("slow"):
      item.add_marker(pytest.mark.grid)
