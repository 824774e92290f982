"""``pyproject.toml``: metadata setuptools accepts without deprecation warnings, and the tested
jax range."""

from __future__ import annotations

import pathlib
import re

try:
  import tomllib
except ModuleNotFoundError:  # Python 3.10: pip vendors the same parser
  from pip._vendor import tomli as tomllib

PYPROJECT = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_license_is_an_spdx_string_and_setuptools_supports_it():
  """A ``license = {text = ...}`` table is deprecated by setuptools; the SPDX string form (PEP 639)
  needs setuptools 77 or newer to build."""
  config = tomllib.loads(PYPROJECT.read_text())
  assert config["project"]["license"] == "Apache-2.0"
  (setuptools,) = [r for r in config["build-system"]["requires"] if r.startswith("setuptools")]
  match = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", setuptools)
  assert match and int(match.group(1)) >= 77, setuptools


def test_jax_is_capped_at_the_tested_versions_and_says_so():
  text = PYPROJECT.read_text()
  assert "jax>=0.10,<0.12" in tomllib.loads(text)["project"]["dependencies"]
  lines = text.splitlines()
  comment = lines[lines.index('  "jax>=0.10,<0.12",') - 1]
  assert comment.strip().startswith("#") and "tested" in comment and "0.10" in comment and "0.11" in comment
