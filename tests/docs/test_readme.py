"""README.md runs as written: every python block (each in a fresh namespace, in a fresh
directory), the quickstart commands that dev.py and CI run, the CLI pipeline's commands as
the ``qsync`` parser reads them, and the cluster spec example. The shell blocks run in
``tests/docs/test_doc_commands.py``; both read the blocks with ``tests/docs/blocks.py``."""

import json
import shlex

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qsync_cli.main import build_parser
from qsync_jax import ClusterSpec
from tests.docs.blocks import ROOT, doc_blocks


def blocks(language: str) -> list[str]:
  """The README's blocks in ``language``, those marked ``not run in CI`` too."""
  return [b.text for b in doc_blocks("README.md") if b.lang == language]


def run_block(code: str, name: str) -> dict:
  namespace: dict = {}
  exec(compile(code, name, "exec"), namespace)
  return namespace


def test_readme_has_the_documented_blocks():
  assert len(blocks("python")) == 4, "README.md: linen, nnx, Trainer and own-step examples"
  assert len(blocks("json")) == 1, "README.md: the cluster spec example"


@pytest.mark.standard_promotion  # user code as written in the README, under default promotion
def test_quantize_a_linen_model(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  ns = run_block(blocks("python")[0], "README.md[linen]")
  out = capsys.readouterr().out
  assert "'layers_0:dense': OpPolicy(fwd='int8', dlhs='fp16', drhs='fp16'" in out
  assert "'layers_2:dense': OpPolicy(fwd='int8', dlhs='int8', drhs='int8'" in out
  assert jax.tree.structure(ns["grads"]) == jax.tree.structure(ns["params"])
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(ns["grads"]))


@pytest.mark.standard_promotion
def test_quantize_an_nnx_model(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  ns = run_block(blocks("python")[1], "README.md[nnx]")
  assert ns["y"].shape == (32, 10)
  ops = ns["qmodel"].ops(ns["variables"], jnp.ones((32, 784)))
  assert (ops["hidden:dense"].fwd, ops["out:dense"].fwd) == ("fp8", "bf16")


@pytest.mark.standard_promotion
def test_train_with_the_trainer(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  ns = run_block(blocks("python")[2], "README.md[Trainer]")
  lines = [json.loads(line) for line in (tmp_path / "runs/mlp/metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in lines] == list(range(1, 51))
  assert lines[-1]["loss"] < 0.5 * lines[0]["loss"]  # the task is learnable: the loss falls
  assert (tmp_path / "runs/mlp/checkpoints/50").is_dir()
  assert ns["trainer"].program.mesh.size == 8
  assert "'loss':" in capsys.readouterr().out


@pytest.mark.standard_promotion
def test_use_a_plans_policy_in_your_own_step(tmp_path, monkeypatch):
  """Self-contained: the block writes the plan.json it loads, in an empty directory."""
  monkeypatch.chdir(tmp_path)
  ns = run_block(blocks("python")[3], "README.md[own step]")
  assert (tmp_path / "plan.json").is_file() and set(ns["plan"].policies) == {"train", "infer"}
  ops = ns["model"].ops(ns["variables"], ns["x"])
  assert (ops["layers_0:dense"].fwd, ops["layers_2:dense"].fwd) == ("int8", "fp16")
  model, x, y = ns["model"], ns["x"], ns["y"]

  def loss_at(variables):
    logits = model.apply(variables, x, rngs={"qsync": jax.random.key(0)})
    return float(optax.softmax_cross_entropy_with_integer_labels(logits, y).mean())

  assert loss_at(ns["variables"]) < 0.5 * loss_at(model.init(jax.random.key(0), x))


def test_quickstart_commands_are_what_dev_py_and_ci_run():
  (quickstart_block,) = [b for b in doc_blocks("README.md") if "python3 dev.py test" in b.text]
  assert "CI itself" in quickstart_block.skip and "test_demo.py" in quickstart_block.skip
  quickstart = [line.split("#")[0].split() for line in quickstart_block.text.strip().splitlines()]
  assert quickstart == [["python3", "dev.py", "demo"], ["python3", "dev.py", "test"]]
  assert "python3 dev.py test" in (ROOT / ".ci/run").read_text()
  dev = (ROOT / "dev.py").read_text()
  assert 'argv[0] not in ("demo", "test", "qsync")' in dev


def test_cli_pipeline_commands_parse():
  pipeline = next(b for b in blocks("bash") if "qsync indicator" in b)
  commands = [shlex.split(line, comments=True) for line in pipeline.strip().splitlines()]
  names = [argv[1] for argv in commands]
  assert names == ["indicator", "profile", "plan", "predict", "train", "export"]
  parser = build_parser()
  for argv in commands:
    assert argv[0] == "qsync"
    args = parser.parse_args(argv[1:])  # exits (fails the test) on an unknown or missing flag
    assert args.command == argv[1]


def test_cluster_spec_example_loads():
  spec = ClusterSpec.from_json(json.loads(blocks("json")[0]))
  assert spec.group_names == ("train", "infer")
  assert spec.global_batch == 64
  np.testing.assert_allclose([g.link_gbps for g in spec.groups], [100.0, 32.0])
