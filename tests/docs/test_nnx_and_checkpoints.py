"""docs/nnx_and_checkpoints.md runs as written: its python blocks in order, in one namespace,
and its ``qsync`` commands through the CLI, in a fresh directory (the blocks as
``tests/docs/blocks.py`` reads them; ``tests/docs/test_doc_commands.py`` leaves this doc to this test)."""

import pathlib
import shlex

import jax
import numpy as np
import pytest
from flax import nnx

from qsync_cli.main import main as cli_main
from tests.docs.blocks import doc_blocks
from tests.jaxpr_dtypes import gemm_dtypes

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "nnx_and_checkpoints.md"


@pytest.mark.standard_promotion  # user code as written in the docs, under default promotion
def test_doc_examples_run(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  blocks = [
    (b.lang, b.text) for b in doc_blocks("docs/nnx_and_checkpoints.md") if b.kind in ("python", "shell")
  ]
  assert [kind for kind, _ in blocks] == ["python", "python", "python", "python", "bash", "python"]
  assert not [b.where for b in doc_blocks("docs/nnx_and_checkpoints.md") if b.skip is not None]
  namespace: dict = {}
  for i, (kind, code) in enumerate(blocks):
    if kind == "python":
      exec(compile(code, f"{DOC.name}[{i}]", "exec"), namespace)
      continue
    for line in code.strip().splitlines():
      argv = shlex.split(line)
      assert argv[0] == "qsync"
      assert cli_main(argv[1:]) == 0, capsys.readouterr().err
  out = capsys.readouterr().out
  assert "'hidden:dense': OpPolicy(fwd='int8'" in out and "'out:dense': None" in out
  ns = namespace
  # The quantized nnx module trains in a plain nnx loop, its int8 ops in the step, into `net` itself.
  assert isinstance(ns["qnet"], nnx.Module) and ns["qnet"].module is ns["net"]
  assert ns["losses"][-1] < 0.5 * ns["losses"][0]
  step = jax.make_jaxpr(ns["train_step"])(ns["qnet"], ns["optimizer"], ns["x"], ns["y"])
  assert gemm_dtypes(step)[("dot_general", "int8", "int8")] == 6  # 2 ops × 3 legs
  # The plain restores, the nnx module updated from them and the export are the trained params.
  trained = ns["trainer"].params
  for tree in (ns["params"], ns["checkpoint"]["params"], ns["exported"]):
    jax.tree.map(np.testing.assert_array_equal, dict(tree), jax.tree.map(np.asarray, trained))
  np.testing.assert_array_equal(ns["model"].hidden.kernel[...], trained["hidden"]["kernel"])
  assert ns["checkpoint"]["meta"]["step"] == 20
  assert jax.tree.structure(ns["adam_mu"]) == jax.tree.structure(trained)
  assert (tmp_path / "nnx_mlp_params").is_dir()
