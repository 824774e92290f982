"""The fenced blocks of README.md and docs/*.md, as the tests that run them read them.

Each block is a ``Block``: the fence's language (``bash``, ``python``, ``json``, … or ``""``),
its text and line, and its ``kind``:

* ``python``: a ``python`` block, run;
* ``shell``: a ``bash`` / ``sh`` / ``shell`` / ``console`` block, or an untagged block whose first
  line (after comments and ``VAR=value`` assignments) starts with a command (``COMMANDS``), run;
* ``data``: a ``json`` / ``yaml`` block;
* ``text``: anything else (a program's output, a directory listing).

Two HTML comments on the lines right before a fence (invisible when rendered) say more:

* ``<!-- not run in CI: REASON -->`` keeps a python or shell block out of CI, and is the only
  way to: ``skip`` holds the reason (``""`` when the comment gives none, which a test refuses);
* ``<!-- file: NAME -->`` on a data block: the runner writes it to ``NAME`` in the doc's
  directory before the doc's commands run (a cluster spec the commands read).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))

SHELL = {"bash", "sh", "shell", "console"}
DATA = {"json", "yaml", "yml"}
COMMANDS = {"qsync", "python", "python3", "pip", "pytest", "bash", "for", "cd", "export", "git"}

FENCE = re.compile(r"^```(\S*)\s*$")
SKIP = re.compile(r"^<!--\s*not run in CI\s*(?::\s*(.*?))?\s*-->$")
FILE = re.compile(r"^<!--\s*file:\s*(\S+)\s*-->$")
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=\S*")


@dataclasses.dataclass(frozen=True)
class Block:
  doc: str  # path relative to the checkout, e.g. "docs/multi_host.md"
  line: int  # the opening fence's line (1-based)
  lang: str
  text: str
  skip: str | None  # the reason of a `not run in CI` marker; None: no marker
  file: str | None  # the name of a `file:` marker

  @property
  def kind(self) -> str:
    if self.lang == "python":
      return "python"
    if self.lang in SHELL or (not self.lang and looks_like_a_command(self.text)):
      return "shell"
    return "data" if self.lang in DATA else "text"

  @property
  def where(self) -> str:
    return f"{self.doc}:{self.line}"


def looks_like_a_command(text: str) -> bool:
  """The first line that is not a comment starts, after ``VAR=value`` assignments, with one of
  ``COMMANDS``."""
  for line in text.splitlines():
    words = line.split()
    if not words or words[0].startswith("#"):
      continue
    while words and ASSIGNMENT.fullmatch(words[0]):
      words = words[1:]
    return bool(words) and words[0] in COMMANDS
  return False


def parse(text: str, doc: str) -> list[Block]:
  """The fenced blocks of markdown ``text`` with the markers right before each (consecutive
  comment lines directly above the opening fence)."""
  lines = text.splitlines()
  blocks, i = [], 0
  while i < len(lines):
    opening = FENCE.match(lines[i])
    if not opening:
      i += 1
      continue
    end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
    assert end is not None, f"{doc}:{i + 1}: a fence that is never closed"
    skip = file = None
    above = i - 1
    while above >= 0 and lines[above].startswith("<!--"):
      comment = lines[above].strip()
      if m := SKIP.match(comment):
        skip = m.group(1) or ""
      elif m := FILE.match(comment):
        file = m.group(1)
      above -= 1
    body = "\n".join(lines[i + 1 : end]) + "\n"
    blocks.append(Block(doc, i + 1, opening.group(1), body, skip, file))
    i = end + 1
  return blocks


def doc_blocks(doc: str) -> list[Block]:
  return parse((ROOT / doc).read_text(), doc)


def all_blocks() -> list[Block]:
  return [b for doc in DOCS for b in doc_blocks(doc)]
