"""Multi-process runs: ``jax.distributed`` start-up and a step watchdog.

The same trainer runs as N processes (one per host, or several per host on the CPU); each
calls ``initialize`` first, then builds the trainer over ``jax.devices()`` (all processes'
devices). Collectives go through the existing engines: NCCL on GPUs, gloo on the CPU.

A dead peer must not hang the others. JAX's coordination service notices a missing heartbeat
(``heartbeat_timeout_s``) and gloo fails a collective whose peer closed its socket, but a
peer that stops answering can still leave a collective waiting. ``Watchdog`` bounds that: if
no step finishes within ``timeout_s`` it prints one clear line to stderr and ends the
process with ``EXIT_PEER_LOST`` (in a one-process run, its line says the step itself hangs).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import jax

from qsync_jax.devices import device_type_of
from qsync_jax.errors import ClusterSpecError

EXIT_PEER_LOST = 3


def check_device_types(cluster, devices, simulate: bool = False) -> None:
  """Raises ``ClusterSpecError`` when one of this process's GPUs among ``devices`` (the job's, in
  ``jax.devices()`` order, which assigns them to the cluster's groups) is not of its group's
  ``device_type``. CPU devices simulate any type and are not checked; ``simulate=True`` lets GPUs
  stand in for other types too."""
  if simulate:
    return
  groups = [cluster.groups[i] for i in cluster.device_group_indices()]
  for index, (device, group) in enumerate(zip(devices, groups)):
    if device.platform != "gpu" or device.process_index != jax.process_index():
      continue
    found = device_type_of(device)
    if found != group.device_type:
      raise ClusterSpecError(
        f"device {index} of the job ({device.device_kind!r}, process {device.process_index}) falls in group "
        f"{group.name!r}, whose device_type is {group.device_type!r}; groups take the devices in "
        "jax.devices() order (by process, then local index). Fix: order the cluster spec's groups (and the "
        "processes' --process-id) as the hosts' GPUs, or pass --simulate-device-types to run the groups on "
        "these GPUs anyway."
      )


def initialize(
  coordinator: str,
  num_processes: int,
  process_id: int,
  *,
  local_device_count: int | None = None,
  init_timeout_s: int = 60,
  heartbeat_timeout_s: int = 30,
) -> None:
  """Joins a ``num_processes``-process job coordinated at ``coordinator`` (``host:port``).

  On the CPU, ``local_device_count`` simulated devices per process and gloo collectives.
  Must run before anything touches a device.
  """
  platforms = os.environ.get("JAX_PLATFORMS", "") or str(jax.config.jax_platforms or "")
  if platforms in ("", "cpu") or local_device_count:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if local_device_count:
    jax.config.update("jax_num_cpu_devices", int(local_device_count))
  jax.distributed.initialize(
    coordinator_address=coordinator,
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=init_timeout_s,
    heartbeat_timeout_seconds=heartbeat_timeout_s,
  )


class Watchdog:
  """Ends the process if ``beat()`` is not called for ``timeout_s`` seconds (after ``start()``)."""

  def __init__(self, timeout_s: float, what: str = "a training step"):
    self.timeout_s, self.what = float(timeout_s), what
    self._last = time.monotonic()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="qsync-watchdog", daemon=True)

  def start(self) -> Watchdog:
    self._last = time.monotonic()
    self._thread.start()
    return self

  def beat(self) -> None:
    self._last = time.monotonic()

  def stop(self) -> None:
    self._stop.set()

  def _watch(self) -> None:
    while not self._stop.wait(min(1.0, self.timeout_s / 4)):
      idle = time.monotonic() - self._last
      if idle > self.timeout_s:
        print(self.message(idle), file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_LOST)

  def message(self, idle: float) -> str:
    """What the watchdog says after ``idle`` seconds without a beat: in a multi-process job, that
    a peer probably died; in one process, that the step itself hangs or the limit is too short."""
    head = f"qsync: error: {self.what} made no progress for {idle:.0f} s (limit {self.timeout_s:.0f} s)"
    if jax.process_count() == 1:
      return (
        f"{head} in this one-process run: the step hangs, or takes longer than the limit. Fix: raise "
        "--step-timeout (step_timeout_s), or leave it unset (no watchdog in a one-process run), then "
        "restart with --resume."
      )
    return (
      f"{head}: a peer process has probably died or hangs (process {jax.process_index()} of "
      f"{jax.process_count()}). Fix: check the other processes' logs, then restart all of them with --resume."
    )
