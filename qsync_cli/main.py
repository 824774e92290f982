"""The ``qsync`` command line: one subcommand per pipeline stage.

Each stage is a module that defines ``HELP``, ``add_arguments(parser)`` and ``run(args)``;
``run(args)`` returns an exit code. The pipeline's stages are listed in ``SUBCOMMANDS``; an
installed package adds commands of its own as entry points of group ``qsync_jax.commands``
(``COMMAND_GROUP``) naming such a module, e.g. this project's examples::

  [project.entry-points."qsync_jax.commands"]
  demo = "qsync_examples:demo"

Before a command runs, its output paths are checked (``qsync_jax.train.outputs``, then what a write
would fail on only late, ``qsync_cli.common.check_write_targets``): the pipeline's stages list theirs
in ``OUTPUT_PATHS``, an installed command in its module's ``OUTPUTS`` (``{option dest: "file" | "dir" |
"run"}``).

Bad input raises ``QsyncError`` subclasses, which the CLI prints as one clear line (no
traceback) and exits with status 2; input used, but perhaps not as meant, a ``QsyncWarning``,
which it prints as one line ``qsync COMMAND: warning: ...`` and goes on. Ctrl-C ends a command with one line (``Interrupted``'s
message: where it stopped and how to resume) and status 130. SIGTERM — what Slurm, Kubernetes
and preemptible VMs send before they kill a job — takes the same path (``train`` checkpoints,
``profile`` keeps its ``.partial`` file) and ends with status 143 (128 + SIGTERM); so does SIGHUP
(a dropped SSH session), ending with status 129.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
import warnings
from importlib.metadata import entry_points

import qsync_jax
from qsync_cli.common import check_write_targets
from qsync_jax.errors import Interrupted, QsyncError, QsyncWarning
from qsync_jax.train.outputs import check_outputs

# name -> module that defines ``HELP``, ``add_arguments(parser)`` and ``run(args)``.
SUBCOMMANDS: dict[str, str] = {
  "indicator": "qsync_cli.indicator",
  "profile": "qsync_cli.profile",
  "predict": "qsync_cli.predict",
  "plan": "qsync_cli.plan",
  "train": "qsync_cli.train",
  "export": "qsync_cli.export",
}
COMMAND_GROUP = "qsync_jax.commands"

# Exit statuses of an interrupted command: the shell's 128 + signal number.
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143
EXIT_HUNG_UP = 128 + signal.SIGHUP  # 129
_STOPPED_BY = {
  signal.SIGTERM: ("terminated (SIGTERM)", EXIT_TERMINATED),
  signal.SIGHUP: ("hung up (SIGHUP)", EXIT_HUNG_UP),
}

# name -> {option dest: output kind (qsync_jax.train.outputs.KINDS)}; `export` checks its own --out
# (a new file or directory, never overwritten).
OUTPUT_PATHS: dict[str, dict[str, str]] = {
  "indicator": {"out": "file"},
  "profile": {"out": "file"},
  "predict": {"trace": "file", "png": "file", "json": "file"},
  "plan": {"out": "file"},
  "train": {"out": "run"},
}
# Outputs a command checks itself that `check_write_targets` checks too (links that lead nowhere).
LATE_WRITE_TARGETS: dict[str, dict[str, str]] = {"export": {"out": "new"}}


def _installed_commands() -> dict:
  """``{name: module}`` of the commands that installed packages declare (``COMMAND_GROUP``).
  One that cannot be loaded, or that reuses a pipeline stage's name, is left out with a
  warning on stderr; the other commands still work."""
  commands = {}
  for ep in entry_points(group=COMMAND_GROUP):
    if ep.name in SUBCOMMANDS or ep.name in commands:
      print(f"qsync: warning: command {ep.name!r} ({ep.value}) is already defined; ignored", file=sys.stderr)
      continue
    try:
      commands[ep.name] = ep.load()
    except ImportError as e:
      print(f"qsync: warning: command {ep.name!r} ({ep.value}) cannot be loaded: {e}", file=sys.stderr)
  return commands


class TerminateAsInterrupt:
  """Within ``with``: SIGTERM and SIGHUP are handled as Ctrl-C. The handler calls whatever handles
  SIGINT at that moment — the trainer's, which stops between two steps and checkpoints, or
  Python's, which raises ``KeyboardInterrupt`` in the main thread — and sets ``received`` (the
  signal). Where SIGINT is ignored or left to the system, it raises ``KeyboardInterrupt`` itself.
  The previous handlers come back on exit. Does nothing outside the main thread (only it can set
  handlers)."""

  def __init__(self):
    self.received, self._previous, self._armed = None, {}, False

  def _handle(self, signum, frame):
    self.received = signal.Signals(signum)
    on_sigint = signal.getsignal(signal.SIGINT)
    if callable(on_sigint):
      on_sigint(signal.SIGINT, frame)
    else:
      raise KeyboardInterrupt

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = {sig: signal.signal(sig, self._handle) for sig in _STOPPED_BY}
      self._armed = True
    return self

  def __exit__(self, *exc):
    if self._armed:
      for sig, previous in self._previous.items():
        signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
      self._armed = False


class WarningLines(warnings.catch_warnings):
  """Within ``with``: each distinct ``QsyncWarning`` is printed as one line ``qsync COMMAND:
  warning: MESSAGE`` on stderr, whatever the warnings filters say (other warnings go through the filters)."""

  def __init__(self, command: str):
    super().__init__()
    self.command = command

  def __enter__(self):
    super().__enter__()
    warnings.simplefilter("default", QsyncWarning)
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
      if issubclass(category, QsyncWarning):
        print(f"qsync {self.command}: warning: {message}", file=sys.stderr, flush=True)
      else:
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    return self


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="qsync",
    description="Quantization-minimized synchronous training of Flax models across hybrid devices.",
  )
  parser.add_argument("--version", action="version", version=f"qsync-jax {qsync_jax.__version__}")
  sub = parser.add_subparsers(dest="command", metavar="COMMAND")
  modules = {name: importlib.import_module(module) for name, module in SUBCOMMANDS.items()}
  for name, module in {**modules, **_installed_commands()}.items():
    p = sub.add_parser(name, help=module.HELP, description=module.HELP)
    module.add_arguments(p)
    p.set_defaults(_run=module.run, _outputs=OUTPUT_PATHS.get(name, getattr(module, "OUTPUTS", {})))
  return parser


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] not in SUBCOMMANDS and argv[0][:1] != "-" and not entry_points(group=COMMAND_GROUP):
    print(
      f"qsync: error: unknown command {argv[0]!r}, and no installed package adds commands (entry points "
      f"of group {COMMAND_GROUP!r}; the examples' `demo` is one). Fix: run `pip install -e '.[examples]'` "
      f"in the qsync-jax checkout (`python3 dev.py` does it), or use one of {sorted(SUBCOMMANDS)}.",
      file=sys.stderr,
    )
    return 2
  parser = build_parser()
  args = parser.parse_args(argv)
  if not getattr(args, "_run", None):
    parser.print_help()
    return 0
  terminate = TerminateAsInterrupt()
  try:
    with terminate, WarningLines(args.command):
      check_outputs(args, args._outputs)
      check_write_targets(args, {**args._outputs, **LATE_WRITE_TARGETS.get(args.command, {})})
      return int(args._run(args) or 0)
  except QsyncError as e:
    print(f"qsync {args.command}: error: {e}", file=sys.stderr)
    return 2
  except (Interrupted, KeyboardInterrupt) as e:
    cause, code = _STOPPED_BY.get(terminate.received, ("", EXIT_INTERRUPTED))
    _print_err(f"qsync {args.command}: {cause + ': ' if cause else ''}{str(e) or 'interrupted'}")
    return code


def _print_err(line: str) -> None:
  """``line`` to stderr, if it can still be written (after SIGHUP the terminal may be gone)."""
  try:
    print(line, file=sys.stderr)
  except OSError:
    pass


def run_as_program() -> None:
  """The program's entry (``qsync``, ``python -m qsync_cli``): exits with ``main()``'s status.

  An interrupted command (status 130 or 143) ends the process at once, its output flushed,
  without the interpreter's teardown: the interrupt may have abandoned a JAX compilation that
  still runs on XLA's threads, and JAX's exit-time teardown of its runtime under that compilation
  crashes the process (SIGSEGV) instead of exiting with the status. What the command keeps — the
  trainer's checkpoint, the profiler's ``.partial`` file — is written and closed before ``main``
  returns."""
  code = main()
  if code in (EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_HUNG_UP):
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except OSError:  # a terminal gone with SIGHUP
        pass
    os._exit(code)
  sys.exit(code)


if __name__ == "__main__":
  run_as_program()
