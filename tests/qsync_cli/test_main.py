"""``qsync``'s commands: the pipeline's stages, and those installed packages add (entry points)."""

import os
from importlib.metadata import EntryPoint, EntryPoints

import pytest

from qsync_cli import main as cli


def _installed(monkeypatch, *targets: tuple[str, str]) -> None:
  """Makes the CLI see exactly these ``(name, "module")`` command entry points."""
  found = EntryPoints(EntryPoint(name, value, cli.COMMAND_GROUP) for name, value in targets)
  monkeypatch.setattr(cli, "entry_points", lambda group: found if group == cli.COMMAND_GROUP else ())


def _commands(parser) -> set[str]:
  (sub,) = [a for a in parser._actions if a.dest == "command"]
  return set(sub.choices)


def test_an_installed_command_runs_its_module(monkeypatch):
  from examples import demo

  _installed(monkeypatch, ("demo", "examples.demo"))
  parser = cli.build_parser()
  assert _commands(parser) == {*cli.SUBCOMMANDS, "demo"}
  args = parser.parse_args(["demo", "--steps", "3"])
  assert args._run is demo.run and args.steps == 3


def test_a_broken_or_clashing_command_is_left_out_with_a_warning(monkeypatch, capsys):
  _installed(monkeypatch, ("broken", "no_such_pkg.commands"), ("train", "examples.demo"))
  parser = cli.build_parser()
  assert _commands(parser) == set(cli.SUBCOMMANDS)
  assert parser.parse_args(["train", "--model", "m", "--steps", "1", "--out", "o"])._run.__module__ == (
    "qsync_cli.train"
  )
  err = capsys.readouterr().err
  assert "command 'broken' (no_such_pkg.commands) cannot be loaded" in err
  assert "command 'train' (examples.demo) is already defined; ignored" in err


def test_demo_without_installed_commands_names_the_install_fix(monkeypatch, capsys):
  """A checkout used through PYTHONPATH alone has no entry points: ``qsync demo`` says why."""
  _installed(monkeypatch)
  assert cli.main(["demo", "--out", "x"]) == 2
  err = capsys.readouterr().err
  assert "unknown command 'demo'" in err and "pip install -e '.[examples]'" in err


def test_the_pipeline_stages_need_no_entry_points(monkeypatch, capsys):
  _installed(monkeypatch)
  assert _commands(cli.build_parser()) == {"indicator", "profile", "predict", "plan", "train", "export"}
  with pytest.raises(SystemExit):
    cli.main(["--help"])
  assert "train" in capsys.readouterr().out


def _sigterm_command(monkeypatch, run) -> None:
  """Installs a command ``sigterm`` whose ``run(args)`` is ``run``."""
  import sys
  import types

  module = types.ModuleType("tests_sigterm_command")
  module.HELP, module.add_arguments, module.run = "sends itself SIGTERM", lambda parser: None, run
  monkeypatch.setitem(sys.modules, module.__name__, module)
  _installed(monkeypatch, ("sigterm", module.__name__))


def test_sigterm_takes_the_ctrl_c_path_and_exits_143(monkeypatch, capsys):
  """SIGTERM during a command: the SIGINT handler in place then runs — Python's raises
  KeyboardInterrupt, a command's own (the trainer's) stops its work — the command ends with one
  line and status 143, and the SIGTERM handler from before the command comes back."""
  import os
  import signal
  import time

  from qsync_jax.errors import Interrupted

  def sleeps(args):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # interrupted by the KeyboardInterrupt
    return 0

  def stops_between_steps(args):
    stop = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stop.append(signum))
    try:
      for step in range(50):
        if stop:
          raise Interrupted(f"interrupted at step {step}; checkpoint {step} is in run/")
        if step == 3:
          os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
    finally:
      signal.signal(signal.SIGINT, previous)
    return 0

  received = []
  before = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))  # not the fix's
  try:
    _sigterm_command(monkeypatch, sleeps)
    assert cli.main(["sigterm"]) == 143
    assert capsys.readouterr().err == "qsync sigterm: terminated (SIGTERM): interrupted\n"
    _sigterm_command(monkeypatch, stops_between_steps)
    assert cli.main(["sigterm"]) == 143
    err = capsys.readouterr().err
    assert err == "qsync sigterm: terminated (SIGTERM): interrupted at step 4; checkpoint 4 is in run/\n"
    assert received == [] and signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    os.kill(os.getpid(), signal.SIGTERM)  # outside a command: the handler from before
    assert received == [signal.SIGTERM]
  finally:
    signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize(
  "command, needle",
  [
    (["indicator", "--precisions", "int4"], "--precisions int4: the indicator scores only"),
    (["indicator", "--batch-size", "0"], "--batch-size 0 must be at least 1"),
    (["profile", "--device-type", "B200"], "--device-type 'B200' is not in the device catalog"),
    (["profile", "--precisions", "fp32,int4"], "['int4'] are not precisions"),
    (["plan", "--cluster", "MISSING", "--indicator", "i.json", "--profile", "p.json"], "cannot be read"),
    (["predict", "--cluster", "MISSING", "--plan", "p.json", "--profile", "p.json"], "cannot be read"),
    (["train", "--cluster", "MISSING", "--steps", "2"], "cannot be read"),
    (["train", "--cluster", "C4", "--steps", "2"], "Fix: pass --local-devices 4"),
    (["train", "--cluster", "C8", "--plan", "PLAN", "--steps", "2"], "names group(s) ['gpu']"),
    (["train", "--sync", "fp64", "--steps", "2"], "--sync 'fp64' is not a sync strategy"),
    (["train", "--lr", "nan", "--steps", "2"], "--lr nan is not a learning rate"),
    (["train", "--lr", "inf", "--steps", "2"], "--lr inf is not a learning rate"),
    (
      ["train", "--lr", "0", "--steps", "2"],
      "--lr 0.0 is not a learning rate: it must be a finite number above 0",
    ),
    (["train", "--lr=-1e-3", "--steps", "2"], "--lr -0.001 is not a learning rate"),
    (
      ["train", "--sync", "selsync", "--sync-option", "delta=abc", "--steps", "2"],
      "option delta='abc' is of type str, but delta takes a number. Fix: pass e.g. --sync-option delta=0.3",
    ),
    (
      ["train", "--sync", "qsdp", "--sync-option", "bucket_size=1.5", "--steps", "2"],
      "option bucket_size=1.5 is of type float, but bucket_size takes an integer",
    ),
    (["train", "--cluster", "DUP", "--steps", "2"], "gives key 'count' twice in one object"),
    (["plan", "--cluster", "C2", "--indicator", "I16", "--profile", "PROF"], ""),  # plans: see below
    (
      ["plan", "--cluster", "C2", "--indicator", "I16", "--profile", "PROF", "--int8-op", "int8"],
      "--int8-op int8 asks for 8-bit ops, but --indicator",
    ),
    (["plan", "--cluster", "C2", "--indicator", "INEG", "--profile", "PROF"], "every Ω is below 0"),
    (["plan", "--cluster", "C2", "--indicator", "IDUP", "--profile", "PROF"], "gives key 'int8' twice"),
    (
      ["predict", "--cluster", "C2", "--plan", "PLAN2", "--profile", "PNEG"],
      "op 'Dense_1:dense' has op_ms dlhs/fp32 = -1.03, not a finite number of at least 0",
    ),
  ],
)
def test_bad_arguments_and_inputs_are_named_before_the_model_loads(
  tmp_path, monkeypatch, capsys, command, needle
):
  """Every command checks its options, input files and cluster spec before it builds the model
  (seconds to minutes): here building it fails the test."""
  from qsync_jax.cluster import ClusterSpec
  from qsync_jax.train import task

  def load_task(*args, **kwargs):
    raise AssertionError("model loaded")

  monkeypatch.setattr(task, "load_task", load_task)
  ClusterSpec.uniform("cpu", 4, 2).save(str(tmp_path / "c4.json"))
  ClusterSpec.uniform("cpu", 8, 2).save(str(tmp_path / "c8.json"))
  (tmp_path / "plan.json").write_text('{"policies": {"gpu": "int8_fwd"}}')
  _bad_input_files(tmp_path)
  files = {
    "MISSING": "missing.json",
    "C4": "c4.json",
    "C8": "c8.json",
    "PLAN": "plan.json",
    **{name.upper().replace(".JSON", ""): name for name in os.listdir(tmp_path) if name.endswith(".json")},
  }
  command = [str(tmp_path / files[a]) if a in files else a for a in command]
  out = ["--out", str(tmp_path / ("run" if command[0] == "train" else "out.json"))]
  if command[0] == "predict":
    out = ["--json", str(tmp_path / "out.json")]
  if not needle:  # a plan that gets as far as the model: only the 16-bit indicator's warning before
    with pytest.raises(AssertionError, match="model loaded"):
      cli.main([*command, "--model", "tests.planners.tiny:mlp", *out])
    err = capsys.readouterr().err
    assert err.startswith(
      "qsync plan: warning: the indicator scores no op at int8 or fp8 (it scores bf16, fp16)"
    )
    assert (
      "group(s) ['infer']" in err
      and "Fix: to plan 8-bit ops, score them: `qsync indicator --precisions " in err
    )
    assert "int8 fp8 fp16 bf16 ...`" in err and err.count("\n") == 1, err
    return
  assert cli.main([*command, "--model", "tests.planners.tiny:mlp", *out]) == 2
  err = capsys.readouterr().err
  assert needle in err and "Fix:" in err and err.count("\n") == 1, err


def _bad_input_files(d) -> None:
  """Input files of the bad-input cases: a two-group cluster (C2, A100 training, a T4-like cpu
  group inferring) and its plan (PLAN2), a profile (PROF) and one with a negative op time (PNEG),
  indicators scored at 16 bits only (I16), every Ω below 0 (INEG) and a key given twice (IDUP),
  and a cluster with a key given twice (DUP)."""
  import json

  from tests.planners.fakes import fake_indicator, fake_profile

  groups = [
    {"name": "train", "device_type": "A100", "count": 4, "memory_gb": 40, "batch_per_device": 2},
    {"name": "infer", "device_type": "cpu", "count": 4, "memory_gb": 40, "batch_per_device": 2},
  ]
  (d / "c2.json").write_text(json.dumps({"groups": groups}))
  (d / "dup.json").write_text(
    '{"groups": [{"name": "a", "device_type": "cpu", "count": 4, "count": 8, '
    '"memory_gb": 16, "batch_per_device": 2}]}'
  )
  (d / "plan2.json").write_text('{"policies": {"infer": "int8_fwd"}}')
  prof = fake_profile([(1.0, 1.0, 1.0)] * 3, batch=2, model="mlp")
  prof.save(str(d / "prof.json"))
  broken = prof.to_json()
  broken["op_ms"]["Dense_1:dense"]["dlhs"]["fp32"] = -1.03
  (d / "pneg.json").write_text(json.dumps(broken))
  omega = fake_indicator(prof.op_names, [3.0, 1.0, 2.0])["omega"]
  sixteen = {op: {p: w for p, w in row.items() if p in ("fp32", "fp16", "bf16")} for op, row in omega.items()}
  (d / "i16.json").write_text(json.dumps({"omega": sixteen}))
  negative = {op: {p: -w - 1.0 if p != "fp32" else 0.0 for p, w in row.items()} for op, row in omega.items()}
  (d / "ineg.json").write_text(json.dumps({"omega": negative}))
  (d / "idup.json").write_text('{"omega": {"Dense_0:dense": {"int8": 1.0, "fp16": 0.1, "int8": 2.0}}}')


@pytest.mark.parametrize("status, teardown", [(143, False), (130, False), (0, True), (2, True)])
def test_an_interrupted_program_exits_without_the_runtime_teardown(status, teardown):
  """``qsync`` (``run_as_program``) ends an interrupted command's process without the exit-time
  teardown (``atexit``: JAX's tears its runtime down under a compilation the interrupt abandoned,
  and crashed the process with SIGSEGV instead of 130 / 143); other statuses exit normally."""
  import subprocess
  import sys

  code = (
    "import atexit\n"
    "import qsync_cli.main as cli\n"
    f"cli.main = lambda: (atexit.register(print, 'teardown ran'), {status})[1]\n"
    "cli.run_as_program()\n"
  )
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert done.returncode == status, done.stderr
  assert ("teardown ran" in done.stdout) == teardown


@pytest.mark.parametrize(
  "command, target, needle",
  [
    (["plan", "--cluster", "C", "--indicator", "I", "--profile", "P", "--out"], "DIR/", "names a directory"),
    (["plan", "--cluster", "C", "--indicator", "I", "--profile", "P", "--out"], "/dev/full", "not a regular"),
    (
      ["predict", "--cluster", "C", "--plan", "PLAN", "--profile", "P", "--png"],
      "/dev/full",
      "not a regular",
    ),
    (["predict", "--cluster", "C", "--plan", "PLAN", "--profile", "P", "--png"], "DIR/", "names a directory"),
    (["predict", "--cluster", "C", "--plan", "PLAN", "--profile", "P", "--trace"], "LOOP", "leads nowhere"),
    (["indicator", "--out"], "LOOP", "leads nowhere"),
    (["profile", "--out"], "DANGLING", "leads nowhere"),
    (["train", "--steps", "2", "--out"], "LOOP", "leads nowhere"),
    (["export", "--run", "RUN", "--out"], "LOOP", "leads nowhere"),
  ],
)
def test_output_paths_a_write_would_fail_on_late_are_refused_first(
  tmp_path, monkeypatch, capsys, command, target, needle
):
  """Output paths that passed the checks and then failed only when written, after the work (a
  traceback, or `wrote /dev/full` with nothing written): a symbolic link loop or a link to a
  missing target, a file path ending in '/', a device. Each is one named error before the model
  loads, and the link is left as it was."""
  from qsync_jax.train import task

  def load_task(*args, **kwargs):
    raise AssertionError("model loaded")

  monkeypatch.setattr(task, "load_task", load_task)
  (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
  (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
  (tmp_path / "dangling").symlink_to(tmp_path / "missing" / "target.json")
  names = {"LOOP": "loop_a", "DANGLING": "dangling", "DIR/": "newdir", "C": "c.json", "I": "i.json"}
  names.update(P="p.json", PLAN="plan.json", RUN="run")

  def path(arg: str) -> str:
    if arg not in names:
      return arg
    return str(tmp_path / names[arg]) + ("/" if arg.endswith("/") else "")

  argv = [path(a) for a in [*command, target]]
  if command[0] != "export":
    argv += ["--model", "tests.planners.tiny:mlp"]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert needle in err and "Fix:" in err and err.count("\n") == 1, err
  assert (tmp_path / "loop_a").is_symlink() and (tmp_path / "dangling").is_symlink()
  assert not (tmp_path / "newdir").exists()


def test_predict_writes_its_png_atomically(tmp_path, monkeypatch):
  """``qsync predict --png``: a write that fails (a full disk) leaves the old image whole and no
  temporary file, and is one named error; a complete image replaces the old one."""
  import errno
  import os

  from qsync_cli.predict import save_png_atomic
  from qsync_jax.errors import PlanError

  path = tmp_path / "step.png"
  path.write_bytes(b"old image")

  def full_disk(pred, out):
    with open(out, "wb") as f:
      f.write(b"half an im")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  with pytest.raises(PlanError, match=r"--png '.*step.png' cannot be written \(No space left on device\)"):
    save_png_atomic(full_disk, None, str(path))
  assert path.read_bytes() == b"old image" and os.listdir(tmp_path) == ["step.png"]

  def writes(pred, out):
    assert out.endswith(".png") and os.path.dirname(out) == str(tmp_path)  # beside it, as a .png
    with open(out, "wb") as f:
      f.write(b"new image")

  save_png_atomic(writes, None, str(path))
  assert path.read_bytes() == b"new image" and os.listdir(tmp_path) == ["step.png"]
