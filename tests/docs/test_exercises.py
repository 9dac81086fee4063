"""The exercise probes of HowToApproachvLLM.md grade the learner: right answers pass, wrong
ones are refused with the reason, and with no answer the probe says how to give one.

The guide shows each probe as a command (`uv run python examples/exercises.py NAME`);
tests/docs/test_docs.py leaves those commands to this file. Here we check that the guide's
commands cover every probe, run each probe once in-process (same code as the command, without
a new interpreter per probe) and grade RIGHT's answers, then each answer made wrong, against
what it computed; the command line itself runs as a script once, with no terminal.

The probes quote code (the line that sizes the KV cache, where the -1 slot is written and
honored); the last test checks that those quotes are still in the source.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
from test_docs import COVERED_BY_EXERCISE_TEST, GUIDE, _fences, extract_commands, python_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / COVERED_BY_EXERCISE_TEST
ANSWERS = REPO / "docs" / "answers.md"  # the answers, with their reasons, out of the guide

# The right answer to every question, as a learner would write it in examples/answers.toml.
RIGHT: dict[str, dict[str, object]] = {
    "paged-slots": {"slot_5": 9, "slot_9": 37, "paged_equals_dense": "yes",
                    "any_block_size": True},
    "can-append": {"at_24": "yes", "at_25": "no", "modulo_rule_size_1": "yes",
                   "ours_size_1": "no"},
    "identical-prompts": {"cached_300": 256, "cached_512": 256, "same_in_both_orders": "yes"},
    "freed-blocks": {"hits_kept": 12, "hits_cleared": 0, "stops_matching": "handed-out",
                     "hits_after_eviction": 8, "kernel": "flash_attention_varlen"},
    "graph-padding": {"stale": "overwritten", "slot_0_victim": "A",
                      "written_by": "prepare_decode", "honored_by": "store_kvcache"},
    "block-size": {"blocks_factor": 16, "memory": "same", "decided_by": "count_blocks",
                   "seqs_256": 36, "seqs_16": 73, "cached_256": 0, "cached_16": 32},
    "preemption": {"runs": ["A"], "preempted": "C, B", "waiting": ["B", "C"],
                   "all_tracked": "yes", "next_kind": "decode", "next_runs": "A"},
    "budget": {"chunk_steps": 5, "chunk_tokens": 4, "first_token_step": 5,
               "ab_decode_meanwhile": "yes", "prefill_first_steps": 1,
               "register_all_at_admission": "unwritten"},
    "step-loop": {"calls": 3, "first_count": 10, "decode_count": -2, "same_as_generate": "yes"},
    "speculation": {"proposal": "on the mat", "accepted": 1, "emitted": "on my",
                    "blocks_verifying": 4, "computed_after": 11, "blocks_after": 3,
                    "accept_rate": "0.3", "d_after_rejection": 0, "skipped_after_3": 8},
    "stop-string": {"euro_silent": 2, "obstacle_silent": 3, "client_text": "5€ Obstacle. ",
                    "stopped_after": 27},
}


@cache
def probes() -> ModuleType:
    spec = importlib.util.spec_from_file_location("myvllm_exercises", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def truths(name: str) -> dict[str, object]:
    """What the probe computed (each probe runs once per session)."""
    return probes().PROBES[name]()


def toml(answers: dict[str, dict[str, object]]) -> str:
    def value(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return str(v) if isinstance(v, int) else '"' + str(v) + '"'

    return "\n".join(f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in table.items())
                     for name, table in answers.items())


def made_wrong(value: object, options: tuple[str, ...]) -> object:
    """An answer that differs from the right one (already normalized)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, list):
        return value[::-1] if len(value) > 1 else ["Z"]
    if options:
        return next(o for o in options if o != value)
    return f"not {value}"


def guide_invocations() -> list[list[str]]:
    """The argument lists of every `python examples/exercises.py ...` command in the guide."""
    runs = []
    for command in extract_commands("HowToApproachvLLM.md"):
        words = command.words
        if python_script(words) == COVERED_BY_EXERCISE_TEST:
            runs.append(words[words.index(COVERED_BY_EXERCISE_TEST) + 1:])
    return runs


def test_guide_runs_every_probe_and_every_question_has_an_answer_here() -> None:
    module = probes()
    named = [args[0] for args in guide_invocations() if args]
    assert sorted(named) == sorted(module.PROBES), (
        f"the guide's exercise commands name {named}; examples/exercises.py has "
        f"{list(module.PROBES)}")
    assert set(RIGHT) == set(module.PROBES) == set(module.QUESTIONS)
    for name, questions in module.QUESTIONS.items():
        assert [q.key for q in questions] == list(RIGHT[name]), name


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {anchor(line.lstrip("#")) for line in path.read_text().splitlines()
            if line.startswith("#")}


def test_each_answer_is_linked_after_its_command_and_kept_out_of_the_guide() -> None:
    """The guide shows no answer (a <details> block is in plain sight in a terminal): every
    exercise command is followed by a link to its section of docs/answers.md, which names
    the same probe, and every section there is linked once and links back to the guide."""
    text = GUIDE.read_text()
    assert "<details>" not in text, "an answer in the guide: move it to docs/answers.md"
    lines = text.splitlines()
    sections = dict(re.findall(r"^## (.+)\n\n`uv run python examples/exercises.py ([\w-]+)`",
                               ANSWERS.read_text(), flags=re.M))
    by_anchor = {anchor(title): probe for title, probe in sections.items()}
    linked = []
    for _, start, body in _fences(GUIDE):
        words = " ".join(body).split()
        if COVERED_BY_EXERCISE_TEST not in words:
            continue
        probe = words[words.index(COVERED_BY_EXERCISE_TEST) + 1]
        end = start + len(body)  # 1-based line of the closing fence
        after = next(line for line in lines[end:] if line.strip())
        m = re.fullmatch(r"Answer first, then check it against \[docs/answers\.md, [^]]+\]"
                         r"\(docs/answers\.md#([\w-]+)\)\.", after)
        assert m, (f"HowToApproachvLLM.md:{end}: the exercise command for {probe} is not "
                   f"followed by the link to its answer (found {after!r})")
        assert by_anchor.get(m.group(1)) == probe, (
            f"HowToApproachvLLM.md:{end}: links #{m.group(1)}, which is not the section of "
            f"docs/answers.md for {probe}")
        linked.append(probe)
    assert sorted(linked) == sorted(sections.values()), (
        f"docs/answers.md answers {sorted(sections.values())}; the guide links {sorted(linked)}")
    guide_anchors = anchors(GUIDE)
    for back in re.findall(r"\(\.\./HowToApproachvLLM\.md#([\w-]+)\)", ANSWERS.read_text()):
        assert back in guide_anchors, f"docs/answers.md links back to #{back}: no such heading"


@pytest.mark.parametrize("name", [
    # step-loop runs an engine over a whole workload (~15 s): in the slow set, where CI runs it
    pytest.param(name, marks=pytest.mark.slow) if name == "step-loop" else name
    for name in RIGHT])
def test_right_answers_pass(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    computed = truths(name)  # loads examples/exercises.py, which puts examples/ on sys.path
    from grading import grade

    assert set(computed) == set(RIGHT[name]), f"{name} computed {sorted(computed)}"
    lines, all_right = grade(probes().QUESTIONS[name], RIGHT[name], computed)
    assert all_right, "\n".join(lines)
    assert all(line.startswith("right  ") for line in lines)


@pytest.mark.parametrize("name", list(RIGHT))
def test_wrong_answers_are_refused_with_the_reason(name: str) -> None:
    from grading import grade, normalize

    questions = probes().QUESTIONS[name]
    for q in questions:
        wrong = dict(RIGHT[name])
        wrong[q.key] = made_wrong(normalize(q, RIGHT[name][q.key]), q.options)
        lines, all_right = grade(questions, wrong, truths(name))
        assert not all_right, f"{name}: {q.key} = {wrong[q.key]!r} was accepted"
        (line,) = [line for line in lines if not line.startswith("right  ")]
        assert line.startswith(f"wrong  {q.key} = ") and "the probe says" in line, line
        assert line.endswith(q.why), line


def test_unreadable_missing_and_misnamed_answers_are_not_right() -> None:
    from grading import grade

    questions = probes().QUESTIONS["paged-slots"]
    answers = {"slot_5": "nine", "paged_equals_dense": "maybe", "any_block_size": "yes",
               "slot9": 37}
    lines, all_right = grade(questions, answers, truths("paged-slots"))
    assert not all_right
    assert "wrong  slot_5 = 'nine': expected a number" in lines[0]
    assert lines[1].startswith("unanswered  slot_9: the probe says 37")
    assert "expected yes or no" in lines[2]
    assert "['slot9'] match no question" in lines[-1]


def test_exact_text_counts_every_space(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """What a stream releases is the point of the stop-string exercise: its trailing space
    is part of the answer, in the answers file and at the prompt (typed in quotes)."""
    from grading import grade

    questions = probes().QUESTIONS["stop-string"]
    right = RIGHT["stop-string"]
    assert str(right["client_text"]).endswith(" ")
    for wrong_text in ("5€ Obstacle.", " 5€ Obstacle. ", "5€ Obstacle.  "):
        lines, all_right = grade(questions, right | {"client_text": wrong_text},
                                 truths("stop-string"))
        assert not all_right, f"{wrong_text!r} was accepted"
        (line,) = [line for line in lines if not line.startswith("right  ")]
        assert line.startswith(f"wrong  client_text = {wrong_text!r}: the probe says "
                               f"{right['client_text']!r} (only the spaces differ"), line
    typed = iter(["2", "3", '"5€ Obstacle. "', "27"])
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: next(typed))
    assert probes().main(["stop-string", "--answers", "/nonexistent/answers.toml"]) == 0
    assert "right  client_text = '5€ Obstacle. '" in capsys.readouterr().out


def test_the_command_grades_an_answers_file(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    answers = tmp_path / "answers.toml"
    answers.write_text(toml({"preemption": RIGHT["preemption"]}))
    assert probes().main(["preemption", "--answers", str(answers)]) == 0
    assert "preemption: all right" in capsys.readouterr().out
    answers.write_text(toml({"preemption": RIGHT["preemption"] | {"waiting": ["C", "B"]}}))
    assert probes().main(["preemption", "--answers", str(answers)]) == 1
    out = capsys.readouterr().out
    assert "wrong  waiting = [C, B]: the probe says [B, C]" in out


def test_answers_typed_at_a_prompt(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    typed = iter(["yes", "no", "yes", ""])  # the last question left unanswered
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: next(typed))
    assert probes().main(["can-append", "--answers", "/nonexistent/answers.toml"]) == 1
    out = capsys.readouterr().out
    assert "right  at_24 = yes" in out and "unanswered  ours_size_1" in out


def test_no_answers_and_no_terminal_says_how_to_answer(tmp_path: Path) -> None:
    """As in CI: stdin is no terminal and nothing answers. The command must not wait, must
    not run the probe (its output would give the answers away) and must say what to write."""
    missing = tmp_path / "answers.toml"
    result = subprocess.run([sys.executable, str(SCRIPT), "can-append", "--answers",
                             str(missing)], cwd=REPO, capture_output=True, text=True,
                            stdin=subprocess.DEVNULL, timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert "No answers given for can-append" in result.stdout
    assert "[can-append]" in result.stdout and "\nat_24 = " in result.stdout
    assert "BlockManager(num_blocks=3" not in result.stdout, "the probe ran"


def test_quoted_code_is_still_there() -> None:
    engine = REPO / "src/myvllm/worker"
    assert "num_blocks = budget // block_bytes" in (engine / "kv_cache.py").read_text()
    padded = (engine / "padded_steps.py").read_text()
    assert "slot_mapping + [-1] * pad" in padded, "decode padding rows get slot -1"
    assert 'for name in ("slot_mapping", "block_tables"):' in padded, \
        "capture_decode_inputs fills the padding slots with -1"
    assert "slot) >= 0" in (REPO / "src/myvllm/kernels/store_kvcache_kernel.py").read_text()
    assert "keep = slot_mapping >= 0" in (REPO / "src/myvllm/kernels/reference.py").read_text()
    manager = (REPO / "src/myvllm/engine/block_manager.py").read_text()
    assert "def release_block" in manager and "def _allocate_fresh_block" in manager
