"""The README's code example runs as written."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.standard_promotion  # user code as written in the README, under default promotion
def test_readme_python_example_runs(capsys):
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
  assert blocks, "README.md lost its python example"
  exec(compile(blocks[0], "README.md", "exec"), {})
  assert "layers_0:dense" in capsys.readouterr().out
