"""Errors raised for bad user input.

Every message names the offending input, the constraint it broke and the fix.
All of them subclass ``ValueError`` so callers that catch ``ValueError`` keep working.
"""


class QsyncError(ValueError):
  """Base class of qsync-jax input errors."""


class PolicyError(QsyncError):
  """A precision policy (or one of its rules) is malformed."""


class UnsupportedPrecisionError(QsyncError):
  """A policy asks a device type for a precision it cannot run."""


class ClusterSpecError(QsyncError):
  """A cluster spec is malformed."""


class PlanError(QsyncError):
  """A plan is malformed or cannot be executed (e.g. does not fit in memory)."""


class CheckpointError(QsyncError):
  """A checkpoint is corrupted or belongs to a different model or plan."""


class BatchError(QsyncError):
  """A task's batches do not match the cluster (their number of examples, their leaves' sizes)."""


class OutputPathError(QsyncError):
  """An output path cannot be written (a file where a directory is needed, a missing parent…)."""


class NonFiniteLossError(QsyncError):
  """Training diverged: a step's loss (or the parameters it left) is not finite."""


class QsyncWarning(UserWarning):
  """Input that is used, but not as the user may think (a rule that matches no op, precisions an
  indicator never scored, lines of a log that cannot be read). The CLI prints each as one line
  ``qsync COMMAND: warning: ...``; in Python, ``warnings.simplefilter("error", QsyncWarning)``
  turns them into errors."""


class Interrupted(Exception):
  """The user interrupted a command (Ctrl-C); the message says where it stopped and how to resume."""
