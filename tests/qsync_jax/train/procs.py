"""Helpers to run ``qsync train`` in subprocesses (kill-and-resume, multi-process tests)."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

ROOT = str(pathlib.Path(__file__).resolve().parents[3])  # the checkout


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
  """The test's environment without its 8-device XLA flag (processes pass --local-devices)."""
  out = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  flags = [f for f in out.get("XLA_FLAGS", "").split() if "device_count" not in f]
  out["XLA_FLAGS"] = " ".join(flags)
  out.update(extra)
  return out


def train(args: list[str], log_path: str, **extra_env: str) -> subprocess.Popen:
  """Starts ``python -m qsync_cli train ARGS`` with stdout and stderr to ``log_path``."""
  with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
    return subprocess.Popen(
      [sys.executable, "-m", "qsync_cli", "train", *args],
      cwd=ROOT,
      env=env(**extra_env),
      stdout=log,
      stderr=subprocess.STDOUT,
    )
