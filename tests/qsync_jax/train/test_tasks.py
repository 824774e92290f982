"""``qsync_jax.train.task``: tasks by registered name (entry points) or ``package.module:attr``."""

from importlib.metadata import EntryPoint, EntryPoints

import pytest

from qsync_jax.errors import QsyncError
from qsync_jax.train import task as tasks
from qsync_jax.train.task import Task
from tests.qsync_jax.train import tiny


def _installed(monkeypatch, *targets: tuple[str, str]) -> None:
  """Makes ``tasks`` see exactly these ``(name, "module:attr")`` entry points."""
  found = EntryPoints(EntryPoint(name, value, tasks.ENTRY_POINT_GROUP) for name, value in targets)
  monkeypatch.setattr(tasks, "entry_points", lambda group: found if group == tasks.ENTRY_POINT_GROUP else ())


def test_module_attr_calls_the_factory_with_the_overrides():
  task = tasks.load_task("tests.qsync_jax.train.tiny:make_task", hidden=3)
  assert isinstance(task, Task) and task.model.hidden == 3
  with pytest.raises(QsyncError, match=r"overrides \['depth'\]: got an unexpected keyword argument 'depth'"):
    tasks.load_task("tests.qsync_jax.train.tiny:make_task", depth=3)


def test_module_attr_may_name_a_task(monkeypatch):
  monkeypatch.setattr(tiny, "TASK", tiny.make_task(), raising=False)
  assert tasks.load_task("tests.qsync_jax.train.tiny:TASK") is tiny.TASK
  with pytest.raises(QsyncError, match=r"is a Task, so it takes no overrides \['hidden'\]"):
    tasks.load_task("tests.qsync_jax.train.tiny:TASK", hidden=3)


@pytest.mark.parametrize("spec", ["no_such_pkg.mod:make", "no_such_pkg:make"])
def test_module_not_on_the_path_says_so_and_how_to_fix_it(spec):
  with pytest.raises(QsyncError) as e:
    tasks.load_task(spec)
  message = str(e.value)
  assert "no module named 'no_such_pkg' on the Python path" in message
  assert "PYTHONPATH" in message and "install the package" in message
  assert "python -m qsync_cli" in message and "give package.module" not in message


def test_missing_submodule_is_named():
  with pytest.raises(QsyncError, match="no module named 'tests.no_such_module' on the Python path"):
    tasks.load_task("tests.no_such_module:make")


def test_a_module_whose_own_import_fails_is_not_called_missing(tmp_path, monkeypatch):
  (tmp_path / "user_tasks_with_missing_dependency.py").write_text("import no_such_dependency_xyz\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(QsyncError) as e:
    tasks.load_task("user_tasks_with_missing_dependency:make")
  message = str(e.value)
  assert "importing 'user_tasks_with_missing_dependency' failed" in message
  assert "no_such_dependency_xyz" in message and "on the Python path" not in message


@pytest.mark.parametrize(
  "spec, needle",
  [
    ("tests.qsync_jax.train.tiny:nope", "has no attribute 'nope'"),
    ("tests.qsync_jax.train.tiny:FEATURES", "is a int, neither a Task nor a function"),
    (
      "tests.qsync_jax.train.tiny:_mse",
      r"cannot be called with the overrides \[\]: missing a required argument",
    ),
    (":make", "is not package.module:attr"),
    ("tests.qsync_jax.train.tiny:", "is not package.module:attr"),
  ],
)
def test_bad_module_attr(spec, needle):
  with pytest.raises(QsyncError, match=needle):
    tasks.load_task(spec)


def test_a_factory_that_returns_no_task_is_named(monkeypatch):
  monkeypatch.setattr(tiny, "not_a_task", lambda: "model", raising=False)
  with pytest.raises(QsyncError, match="gave a str, not a qsync_jax.train.task.Task"):
    tasks.load_task("tests.qsync_jax.train.tiny:not_a_task")


def test_a_registered_name_loads_only_its_entry_point(monkeypatch):
  _installed(
    monkeypatch, ("tiny", "tests.qsync_jax.train.tiny:make_task"), ("broken", "no_such_pkg.mod:make")
  )
  assert tasks.task_names() == ["broken", "tiny"]
  task = tasks.load_task("tiny", hidden=5)
  assert isinstance(task, Task) and task.model.hidden == 5
  with pytest.raises(QsyncError, match="task 'broken' .*no_such_pkg.mod:make.* cannot be loaded"):
    tasks.get_task("broken")


def test_an_unknown_name_lists_the_registered_ones(monkeypatch):
  _installed(monkeypatch, ("tiny", "tests.qsync_jax.train.tiny:make_task"))
  with pytest.raises(QsyncError, match=r"unknown task 'vgg'. Fix: use one of \['tiny'\]"):
    tasks.load_task("vgg")


def test_no_registered_task_at_all_names_the_install_fix(monkeypatch):
  """A checkout used through PYTHONPATH alone has no entry points: say so, never 'unknown'."""
  _installed(monkeypatch)
  with pytest.raises(QsyncError) as e:
    tasks.load_task("vgg")
  message = str(e.value)
  assert "no task is registered in this Python environment" in message
  assert "pip install -e '.[examples]'" in message and "package.module:make_task" in message


def test_a_name_registered_twice_differently_is_refused(monkeypatch):
  _installed(
    monkeypatch, ("tiny", "tests.qsync_jax.train.tiny:make_task"), ("tiny", "tests.planners.tiny:mlp")
  )
  with pytest.raises(QsyncError, match="registered more than once"):
    tasks.get_task("tiny")


def test_an_entry_point_naming_a_missing_attribute_is_named(monkeypatch):
  _installed(monkeypatch, ("gone", "tests.qsync_jax.train.tiny:no_such_factory"))
  with pytest.raises(
    QsyncError, match="registered as 'tests.qsync_jax.train.tiny:no_such_factory', which does not exist"
  ):
    tasks.get_task("gone")
