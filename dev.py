#!/usr/bin/env python3
"""Self-contained developer entry point: needs only python3 (with pip).

  python3 dev.py demo [ARGS...]   # the end-to-end demo on simulated CPU devices
  python3 dev.py test [ARGS...]   # lint + the test suite (what CI runs)
  python3 dev.py qsync ARGS...    # any qsync CLI command, in the project's environment

Creates ``.venv`` beside this file on first use and installs the package with its test and
example extras (re-installs when ``pyproject.toml`` changes).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
EXTRAS = "test,examples"


def _python() -> Path:
  return VENV / ("Scripts" if os.name == "nt" else "bin") / "python"


def _run(cmd: list[str], **kwargs) -> int:
  print("+ " + " ".join(str(c) for c in cmd), flush=True)
  return subprocess.call([str(c) for c in cmd], cwd=ROOT, **kwargs)


def _create_venv() -> None:
  """``python3 -m venv``; where the interpreter lacks ``ensurepip`` (e.g. Debian without
  python3-venv), fall back to the ``virtualenv`` package installed with pip."""
  try:
    venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    return
  except Exception as e:  # noqa: BLE001 - any failure here means: try virtualenv
    print(f"venv could not bootstrap pip ({e}); trying virtualenv", flush=True)
  pip = [sys.executable, "-m", "pip", "install", "-q", "--user", "virtualenv"]
  if _run(pip) != 0 and _run([*pip, "--break-system-packages"]) != 0:
    sys.exit("could not create .venv: install python3-venv (or virtualenv) and try again")
  if _run([sys.executable, "-m", "virtualenv", "--clear", str(VENV)]) != 0:
    sys.exit("virtualenv failed: see the messages above")


def ensure_env() -> Path:
  """Creates the virtual environment and installs the project; returns its python."""
  stamp = VENV / ".qsync-installed"
  want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
  if stamp.exists() and stamp.read_text() == want and _python().exists():
    return _python()
  if not _python().exists():
    print(f"creating {VENV}", flush=True)
    _create_venv()
  py = _python()
  if _run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"]) != 0:
    sys.exit("could not upgrade pip in .venv")
  if _run([py, "-m", "pip", "install", "-q", "-e", f".[{EXTRAS}]"]) != 0:
    sys.exit("pip install failed: see the messages above")
  stamp.write_text(want)
  return py


def main(argv: list[str]) -> int:
  if not argv or argv[0] not in ("demo", "test", "qsync"):
    print(__doc__)
    return 2
  command, rest = argv[0], argv[1:]
  py = ensure_env()
  env = dict(os.environ)
  if command == "test":
    if _run([py, "-m", "ruff", "check", "."]) != 0:
      return 1
    # Two workers (a 2-core CI machine).
    workers = ["-n", os.environ.get("QSYNC_TEST_WORKERS", "2")]
    code = _run([py, "-m", "pytest", "-q", *workers, *rest], env=env)
    return 1 if code == 5 else code  # 5 = no test ran: that is a failure too
  if command == "demo":
    return _run([py, "-m", "qsync_cli", "demo", *rest], env=env)
  return _run([py, "-m", "qsync_cli", *rest], env=env)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
