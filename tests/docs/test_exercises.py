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
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
from test_docs import COVERED_BY_EXERCISE_TEST, GUIDE, _fences, extract_commands, python_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / COVERED_BY_EXERCISE_TEST

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


def test_each_answer_is_folded_away_after_its_command() -> None:
    """In the guide an answer never comes before its exercise's command: every command is
    followed by a <details> block, and every <details> block follows a command."""
    lines = GUIDE.read_text().splitlines()
    blocks = _fences(GUIDE)  # (language, first content line, 1-based; body)
    ends = {start + len(body): COVERED_BY_EXERCISE_TEST in "\n".join(body)
            for _, start, body in blocks}  # 1-based line of each closing fence
    for end, is_exercise in ends.items():
        if is_exercise:
            after = next(line for line in lines[end:] if line.strip())
            assert after.startswith("<details>"), (
                f"HowToApproachvLLM.md:{end}: an exercise command without its folded answer "
                f"right after it (found {after!r})")
    for number, line in enumerate(lines, 1):
        if line.startswith("<details>"):
            fence = max(end for end in ends if end < number)
            assert ends[fence] and not any(lines[i].strip() for i in range(fence, number - 1)), (
                f"HowToApproachvLLM.md:{number}: an answer that does not follow an exercise "
                "command")


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
