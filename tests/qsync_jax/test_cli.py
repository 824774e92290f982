"""``qsync``'s commands: the pipeline's stages, and those installed packages add (entry points)."""

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
