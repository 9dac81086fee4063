"""The exercise probes of HowToApproachvLLM.md still print the answers the guide gives.

The guide shows each probe as a command (`uv run python examples/exercises.py NAME`);
tests/docs/test_docs.py leaves those commands to this file. Here we take the exact argument lists
from the guide's bash blocks, check that they cover every probe, and run each one in-process
(same code as the command, without a new interpreter per probe), checking its `answer:` lines.

The probes quote code (the line that sizes the KV cache, where the -1 slot is written and
honored); the last test checks that those quotes are still in the source.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
from test_docs import COVERED_BY_EXERCISE_TEST, extract_commands, python_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / COVERED_BY_EXERCISE_TEST

# For each probe: substrings its `answer:` lines must contain.
EXPECTED: dict[str, list[str]] = {
    "paged-slots": [
        "token 5 -> slot 9, token 9 -> slot 37",
        "paged attention through block_table [7, 2, 9] equals dense attention: True",
        "the same keys stored at block_size 1, 4 and 16 give the same output: True",
    ],
    "can-append": [
        "block_size 8, num_tokens 24, no free block -> can_append = True",
        "num_tokens 25 -> can_append = False",
        "block_size 1 -> can_append = False, the modulo rule says True",
    ],
    "identical-prompts": [
        "300 tokens -> 256 cached",
        "512 tokens -> 256 cached, not 512",
    ],
    "freed-blocks": [
        "keeping tokens on free -> Y hits 12 tokens; clearing them (the original) -> 0",
        "here Y then hits 8",
        "tests/core/test_block_manager.py::test_prefix_cache_survives_the_sequence_that_filled_it",
    ],
    "graph-padding": [
        "with slot -1 the padding row writes nothing: E keeps K 503 at slot 14 and A keeps 11",
        "overwrites E's K at slot 14 with 0",
        "overwrites A's first K (11 -> 0)",
    ],
    "block-size": [
        "36 sequences of 114 tokens fit with 256, 73 with 16",
        "gives 0 cached tokens at 256 and 32 at 16",
    ],
    "preemption": [
        "the decode step runs ['A']; preempted in order ['C', 'B']",
        "waiting is now ['B', 'C']",
        "3 of 3 sequences are still tracked",
        "step 3 is a decode of ['A']",
    ],
    "budget": [
        "C's prompt takes 5 steps of 4 tokens (6 minus the 2 decode rows)",
        "C samples its first token in step 5",
        "A and B decode in every one of those 5 steps; prefill-first computes C in 1 step",
    ],
    "stop-string": [
        "the client receives '5€ Obstacle. '; stopped=True after 27 of 29 tokens",
        "'O', 'Ob', 'Obs' are held back",
    ],
    "step-loop": [
        "the counts were [10, -2, -2]",
        "add_request + step gives generate()'s tokens: True",
    ],
}


def _load_probes():
    spec = importlib.util.spec_from_file_location("myvllm_exercises", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def guide_invocations() -> list[list[str]]:
    """The argument lists of every `python examples/exercises.py ...` command in the guide."""
    runs = []
    for command in extract_commands("HowToApproachvLLM.md"):
        words = command.words
        if python_script(words) == COVERED_BY_EXERCISE_TEST:
            runs.append(words[words.index(COVERED_BY_EXERCISE_TEST) + 1:])
    return runs


def test_guide_runs_every_probe() -> None:
    probes = _load_probes().PROBES
    named = [args[0] for args in guide_invocations() if args]
    assert sorted(named) == sorted(probes), (
        f"the guide's exercise commands name {named}; examples/exercises.py has {list(probes)}")
    assert set(EXPECTED) == set(probes)


@pytest.mark.parametrize("args", guide_invocations(), ids=lambda a: " ".join(a))
def test_probe_prints_the_answer(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    _load_probes().main(args)
    out = capsys.readouterr().out
    answers = "\n".join(line for line in out.splitlines() if line.startswith("answer:"))
    assert answers, f"no answer lines:\n{out}"
    for expected in EXPECTED[args[0]]:
        assert expected in answers, f"expected {expected!r} in the answers:\n{answers}"


def test_probe_command_line_runs_as_a_script() -> None:
    """One real subprocess run, the way the guide's command runs it."""
    import subprocess

    result = subprocess.run([sys.executable, str(SCRIPT), "can-append"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "can_append = True" in result.stdout


def test_quoted_code_is_still_there() -> None:
    engine = REPO / "src/myvllm/engine"
    assert "num_blocks = budget // layout.block_bytes" in (engine / "kv_cache.py").read_text()
    inputs = (engine / "input_builder.py").read_text()
    assert re.search(r"\[-1\] \* padding", inputs), "prepare_decode pads slots with -1"
    assert "views.slot_mapping.fill_(-1)" in (engine / "graph_runner.py").read_text(), \
        "GraphRunner.capture's padding slots are -1"
    assert "slot) >= 0" in (REPO / "src/myvllm/kernels/store_kvcache_kernel.py").read_text()
    assert "keep = slot_mapping >= 0" in (REPO / "src/myvllm/kernels/reference.py").read_text()
    manager = (REPO / "src/myvllm/engine/block_manager.py").read_text()
    assert "def _release_block" in manager and "def _allocate_fresh_block" in manager
