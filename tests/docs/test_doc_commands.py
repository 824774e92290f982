"""Every command and code block of README.md and docs/*.md runs as written, or says why not.

Each doc's shell blocks run with ``bash -e``, in order, in a fresh directory that holds the
checkout's files as links (so ``PYTHONPATH=.``, ``python -m benchmarks…`` and relative paths
work as from the checkout's root, and what the commands write stays in the directory); first
its ``<!-- file: NAME -->`` blocks are written there. ``qsync`` and ``python`` are this
environment's; the environment is a user's (no ``XLA_FLAGS`` of the test harness). Python blocks
run in order, in one namespace, in that directory. The README's python blocks and all of
docs/nnx_and_checkpoints.md run in their own tests, with assertions of their own (``DEDICATED``).

A block is left out only by a ``<!-- not run in CI: REASON -->`` comment right above it
(``tests/docs/blocks.py``), and every such comment gives its reason.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from tests.docs.blocks import DOCS, ROOT, all_blocks, doc_blocks

DEDICATED = {  # doc -> (kinds a dedicated test runs, with its own assertions; that test)
  "README.md": ({"python"}, "tests/docs/test_readme.py"),
  "docs/nnx_and_checkpoints.md": ({"python", "shell"}, "tests/docs/test_nnx_and_checkpoints.py"),
}

EXPECTED = {  # doc -> files its commands leave in its directory
  "README.md": [
    "omega.json",
    "profile_t4.json",
    "plan.json",
    "step.png",
    "run/checkpoints/20",
    "mlp.msgpack",
  ],
  "docs/multi_host.md": ["p0.log", "p1.log", "run/metrics.jsonl", "run/checkpoints/20"],
}

RUNNABLE = {"python", "shell"}


def _run_here(block) -> bool:
  """Whether this test runs ``block``: runnable, unmarked, and not a dedicated test's."""
  kinds, _ = DEDICATED.get(block.doc, (set(), None))
  return block.kind in RUNNABLE and block.skip is None and block.kind not in kinds


def _docs_to_run() -> list[str]:
  return [doc for doc in DOCS if any(_run_here(b) for b in doc_blocks(doc))]


def test_every_block_left_out_says_why():
  skipped = [b for b in all_blocks() if b.skip is not None]
  assert skipped, "the README's quickstart, GPU and multi-host blocks are marked"
  assert [b.where for b in skipped if not b.skip.strip()] == [], "a `not run in CI` marker without a reason"
  # A marker on a block that would not run anyway (output, data) is a mistake: it hides nothing.
  assert [b.where for b in skipped if b.kind not in RUNNABLE] == []


def test_file_markers_name_data_blocks_once_per_doc():
  files = [b for b in all_blocks() if b.file]
  assert {(b.doc, b.file) for b in files} >= {
    ("README.md", "cluster.json"),
    ("docs/multi_host.md", "cluster.json"),
  }
  assert all(b.kind == "data" for b in files)
  assert len({(b.doc, b.file) for b in files}) == len(files)


def test_the_accuracy_benchmarks_generated_section_marks_its_command():
  """``benchmarks/accuracy.py`` writes a section of docs/results.md whose command trains for
  minutes: the generator puts the marker above it, and the committed section has it."""
  from benchmarks import accuracy

  (block,) = [b for b in doc_blocks("docs/results.md") if b.text.startswith("python -m benchmarks.accuracy ")]
  assert block.skip is not None
  assert accuracy.NOT_RUN_IN_CI.startswith("<!-- not run in CI: ")
  lines = accuracy.markdown(
    {}, _accuracy_args(), "cpu", "today", "python -m benchmarks.accuracy"
  ).splitlines()
  assert lines[lines.index(accuracy.NOT_RUN_IN_CI) + 1] == "```"


def _accuracy_args():
  import types

  return types.SimpleNamespace(
    pool_batch_per_device=128,
    batch_per_device=16,
    steps=150,
    lr=3e-3,
    seeds=[0],
    pretrain_steps=40,
    indicator_batches=16,
  )


def test_dedicated_tests_exist():
  for _, test in DEDICATED.values():
    assert (ROOT / test).is_file(), test


def test_untagged_blocks_are_output_or_commands_that_run():
  """An untagged block that starts with a command counts as a shell block (it runs or is marked);
  the other untagged blocks are a program's output or a listing."""
  untagged = [b for b in all_blocks() if not b.lang]
  assert {b.kind for b in untagged} <= {"shell", "text"}
  assert any(b.kind == "text" for b in untagged) and any(b.kind == "shell" for b in untagged)


def _checkout_view(directory: pathlib.Path) -> None:
  """Links to the checkout's top-level files and folders (those git does not ignore) in ``directory``."""
  try:
    git = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    out = subprocess.run(git, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    names = {line.split("/")[0] for line in out.splitlines() if line}
  except (OSError, subprocess.CalledProcessError):  # not a git checkout: all but hidden ones
    names = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}
  for name in sorted(names):
    if (ROOT / name).exists() and not name.startswith("."):
      (directory / name).symlink_to(ROOT / name)


def _environment() -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
  env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
  env["JAX_PLATFORMS"] = "cpu"
  return env


@pytest.mark.standard_promotion  # user code as written in the docs, under default promotion
@pytest.mark.parametrize("doc", _docs_to_run())
def test_doc_runs_as_written(doc, tmp_path, monkeypatch):
  blocks = doc_blocks(doc)
  _checkout_view(tmp_path)
  for block in blocks:
    if block.file:
      (tmp_path / block.file).write_text(block.text)
  monkeypatch.chdir(tmp_path)
  namespace: dict = {}
  for block in filter(_run_here, blocks):
    if block.kind == "python":
      exec(compile(block.text, block.where, "exec"), namespace)
      continue
    done = subprocess.run(
      ["bash", "-e", "-o", "pipefail", "-c", block.text],
      cwd=tmp_path,
      env=_environment(),
      capture_output=True,
      text=True,
      timeout=480,
    )
    logs = "".join(f"\n--- {p.name}:\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))
    assert done.returncode == 0, f"{block.where} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}{logs}"
  for name in EXPECTED.get(doc, []):
    assert (tmp_path / name).exists(), f"{doc}: its commands wrote no {name}"
