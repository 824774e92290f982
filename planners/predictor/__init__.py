"""QSync's predictor: the op graph of a training step, its memory, the costs of devices not at
hand (``modeled_profile``), and the replay that predicts a plan's synchronous step time and
peak memory (``predict``), with its timeline (``save_chrome_trace``, ``save_png``)."""

from planners.predictor.limits import Limits, limits
from planners.predictor.memory_model import memory_bytes, program_memory_bytes
from planners.predictor.modeled import modeled_profile
from planners.predictor.replay import Prediction, base_profile, predict, resolve_profiles, sync_step_ms
from planners.predictor.timeline import chrome_trace, save_chrome_trace, save_png

__all__ = [
  "Limits",
  "Prediction",
  "base_profile",
  "chrome_trace",
  "limits",
  "memory_bytes",
  "modeled_profile",
  "program_memory_bytes",
  "predict",
  "resolve_profiles",
  "save_chrome_trace",
  "save_png",
  "sync_step_ms",
]
