"""Grading for examples/exercises.py: the questions, your answers, and right or wrong.

Each exercise has a few questions with short answers (a number, yes/no, a list of sequence
names, one of a few options). You answer them first, typed in at a prompt or written into a
TOML file (examples/answers.toml unless --answers names another):

    [paged-slots]
    slot_5 = 12
    paged_equals_dense = "yes"

Then the probe runs the real classes, and each answer is compared with what the probe
computed, not with a copy of the answer kept here: if the code changes, so does the answer.
"""

from __future__ import annotations

import re
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# "text" is compared without its leading and trailing spaces; "exact text" as written, for
# an answer whose spaces are the point (what a stream releases, space by space).
Kind = Literal["number", "yes/no", "names", "choice", "text", "exact text"]
FORMATS: dict[str, str] = {
    "number": "a number, e.g. 12",
    "yes/no": 'yes or no, e.g. "yes"',
    "names": 'sequence names in order, e.g. ["A", "B"] (typed: A, B)',
    "text": 'text, e.g. "abc"',
    "exact text": 'text in quotes, every space counts, e.g. "ab c "',
}


@dataclass(frozen=True)
class Question:
    key: str  # the answer's name in the TOML file
    text: str
    kind: Kind
    why: str  # shown with the verdict, right or wrong
    options: tuple[str, ...] = ()

    @property
    def format(self) -> str:
        if self.kind == "choice":
            return "one of " + " | ".join(self.options)
        return FORMATS[self.kind]


def normalize(question: Question, value: object) -> object:
    """The answer as the probe's value would be written; ValueError if it cannot be read."""
    if question.kind == "number":
        try:
            if isinstance(value, bool):
                raise ValueError
            return int(str(value).strip())
        except ValueError:
            raise ValueError("expected a number") from None
    if question.kind == "yes/no":
        if isinstance(value, bool):
            return value
        word = str(value).strip().lower()
        if word in ("yes", "y", "true"):
            return True
        if word in ("no", "n", "false"):
            return False
        raise ValueError("expected yes or no")
    if question.kind == "names":
        items = value if isinstance(value, list) else re.findall(r"\w+", str(value))
        names = [str(item).strip().upper() for item in items]
        if len(names) == 1 and len(names[0]) > 1:  # "CB" typed for C, B: names are one letter
            names = list(names[0])
        return names
    if question.kind == "choice":
        word = str(value).strip().lower()
        for option in question.options:
            if word == option.lower():
                return option
        raise ValueError(f"expected one of {', '.join(question.options)}")
    if question.kind == "exact text":
        return str(value)
    return str(value).strip()


def unquoted(typed: str) -> str:
    """A line typed at the prompt for an exact-text question: the text inside its quotes
    (so that a trailing space can be typed), or the line as typed when it has none."""
    inner = typed.strip()
    if len(inner) >= 2 and inner[0] == inner[-1] and inner[0] in "'\"":
        return inner[1:-1]
    return typed


def answers_from_file(path: Path, exercise: str) -> dict[str, object] | None:
    """The [exercise] table of a TOML answers file; None when the file or the table is absent."""
    if not path.is_file():
        return None
    try:
        tables = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SystemExit(f"{path} is not valid TOML ({e}): every answer needs a value")
    table = tables.get(exercise)
    return dict(table) if isinstance(table, dict) else None


def answers_typed_in(questions: list[Question]) -> dict[str, object]:
    """Ask each question at a prompt; an empty line leaves it unanswered."""
    answers: dict[str, object] = {}
    print("Answer each question before the probe shows what happens (empty: skip it).")
    for q in questions:
        print(f"\n{q.text} ({q.format})")
        try:
            typed = input(f"{q.key}> ")
        except EOFError:
            break
        if typed.strip():
            answers[q.key] = unquoted(typed) if q.kind == "exact text" else typed.strip()
    return answers


def collect(exercise: str, questions: list[Question], path: Path) -> dict[str, object] | None:
    """Answers from the file, else typed in a terminal; None when neither can give any
    (no file entry and no terminal, as in CI: never wait on a stdin nobody writes to)."""
    answers = answers_from_file(path, exercise)
    if answers is None and sys.stdin.isatty():
        answers = answers_typed_in(questions)
    return answers or None


def how_to_answer(exercise: str, questions: list[Question], path: Path) -> str:
    lines = [f"No answers given for {exercise}. Run it in a terminal and type them in, or write "
             f"them into {path} (or a file named with --answers), filling in each value:", "",
             f"[{exercise}]"]
    for q in questions:
        lines += [f"# {q.text} ({q.format})", f"{q.key} = "]
    lines += ["", "Run it with --show to see the probe without being graded."]
    return "\n".join(lines)


def shown(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return repr(value) if isinstance(value, str) else str(value)


def grade(questions: list[Question], answers: Mapping[str, object],
          truths: Mapping[str, object]) -> tuple[list[str], bool]:
    """One verdict line per question, and whether every answer was right."""
    lines, all_right = [], True
    for q in questions:
        truth = truths[q.key]
        if q.key not in answers:
            lines.append(f"unanswered  {q.key}: the probe says {shown(truth)}. {q.why}")
            all_right = False
            continue
        try:
            given = normalize(q, answers[q.key])
        except ValueError as e:
            lines.append(f"wrong  {q.key} = {answers[q.key]!r}: {e}. The probe says "
                         f"{shown(truth)}. {q.why}")
            all_right = False
            continue
        if given == (str(truth).strip() if q.kind == "text" else truth):
            lines.append(f"right  {q.key} = {shown(given)}. {q.why}")
        else:
            spaces = (" (only the spaces differ, and here they count)"
                      if q.kind == "exact text" and str(given).strip() == str(truth).strip()
                      else "")
            lines.append(f"wrong  {q.key} = {shown(given)}: the probe says {shown(truth)}"
                         f"{spaces}. {q.why}")
            all_right = False
    unknown = sorted(set(answers) - {q.key for q in questions})
    if unknown:
        lines.append(f"unknown  answers {unknown} match no question: check their names")
        all_right = False
    return lines, all_right
