"""Progress lines for benchmarks run under a time limit (a lent GPU): each printed and flushed as
it happens, stamped with the seconds since the start and the XLA compilations so far (their
count and seconds, from JAX's ``/jax/core/compile/backend_compile_duration`` events), so a run
cut short still shows where its time went.

  progress = Progress()
  progress.say("compiling")      # [   0.0 s | 0 compiles, 0.0 s] compiling
"""

from __future__ import annotations

import time

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_COMPILES = {"count": 0, "seconds": 0.0}


def _on_event(event: str, duration: float, **_) -> None:
  if event == BACKEND_COMPILE_EVENT:
    _COMPILES["count"] += 1
    _COMPILES["seconds"] += duration


jax.monitoring.register_event_duration_secs_listener(_on_event)


class Progress:
  """``say(msg)``: prints ``msg`` stamped with the seconds since this object was made and the
  compilations since then; ``compiles()``: ``(count, seconds)`` of those compilations."""

  def __init__(self):
    self.start = time.perf_counter()
    self.start_compiles = dict(_COMPILES)

  def compiles(self) -> tuple[int, float]:
    return (
      _COMPILES["count"] - self.start_compiles["count"],
      _COMPILES["seconds"] - self.start_compiles["seconds"],
    )

  def say(self, msg: str) -> None:
    count, seconds = self.compiles()
    elapsed = time.perf_counter() - self.start
    print(f"[{elapsed:7.1f} s | {count} compiles, {seconds:.1f} s] {msg}", flush=True)
