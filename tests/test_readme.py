"""The README's Python examples run as written."""

import os
import re

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_readme_python_examples_run():
  text = open(README, encoding="utf-8").read()
  blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
  assert len(blocks) >= 2
  namespace: dict = {}
  for block in blocks:
    exec(compile(block, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  out = namespace["out"]
  assert out.shape == (2, 128, 16, 64)
  assert namespace["y"].shape == (2, 16, 512)
  assert set(namespace["aux"]) >= {"probs1", "probs2", "lambda"}
