"""The grammar work of one step is bounded across its rows (structured_output/step_budget.py).

The rule on made-up figures (no clock: the budget is handed the times), then an engine on the
CPU whose slow matchers spin for a set CPU time in each bitmask (the budget measures the
thread's CPU time, so a spin's cost does not depend on how busy the machine is): a step whose
rows are each within the floor but together over it ends the costliest, and the others, the
plain request beside them included, end with their usual tokens.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import pytest
from helpers_models import tiny_checkpoint

from myvllm import LLM, SamplingParams
from myvllm.sampling_parameters import StructuredOutputsParams
from myvllm.structured_output import matchers
from myvllm.structured_output.step_budget import NUM_STEPS_MEASURED, GrammarStepBudget

REGEX = "[ab]{3,5}"


@dataclass
class Row:
    step_s: float
    over_budget: bool = False


def test_the_costliest_rows_are_ended_until_the_others_fit() -> None:
    budget = GrammarStepBudget(floor_s=0.010, multiple=0.0)
    rows = [Row(0.004), Row(0.001), Row(0.009), Row(0.001), Row(0.004)]
    ended = budget.end_costliest(rows)  # 19 ms against 10: the 9 ms row alone goes
    assert ended == [rows[2]] and [row.over_budget for row in rows] == [
        False, False, True, False, False]
    assert budget.end_costliest([Row(0.003)] * 3) == []  # 9 ms: within
    lone = Row(0.011)  # one row over the limit is ended whatever the others do
    assert budget.end_costliest([Row(0.0), lone]) == [lone]


def test_the_limit_is_a_multiple_of_the_shortest_recent_step_without_grammar_work() -> None:
    budget = GrammarStepBudget(floor_s=0.001, multiple=2.0)
    assert budget.limit_s() == 0.001  # nothing measured yet: the floor
    budget.begin_step(10.000)
    budget.charge(0.003)  # grammar work between the two bitmasks does not count
    budget.begin_step(10.011)  # 11 ms apart, 3 of them grammar: a step of 8 ms
    assert budget.limit_s() == pytest.approx(0.016)
    budget.begin_step(10.111)  # a gap (idle, or steps without a constrained row): longer
    assert budget.limit_s() == pytest.approx(0.016)
    for i in range(NUM_STEPS_MEASURED):  # the 8 ms step leaves the window
        budget.begin_step(11.0 + 0.020 * i)
    assert budget.limit_s() == pytest.approx(0.040)
    assert GrammarStepBudget(floor_s=0.050, multiple=2.0).limit_s() == 0.050


class SpinningMatcher:
    """A GrammarMatcher whose every bitmask first spins for cost_s of the thread's CPU time."""

    def __init__(self, matcher: Any, cost_s: float) -> None:
        self.matcher = matcher
        self.cost_s = cost_s

    def fill_next_token_bitmask(self, bitmask: Any, row: int = 0) -> Any:
        end = time.thread_time() + self.cost_s
        while time.thread_time() < end:
            pass
        return self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))


def test_a_step_over_its_budget_ends_its_costliest_rows_and_the_rest_carry_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight rows of 10 ms each and two quick ones, a floor of 25 ms a step (multiple 0: the
    floor alone): no row is over it alone, the step is (80 ms), so six of the slow rows end
    after their first token and the other two slow ones, within it together, go on."""
    llm = LLM(str(tiny_checkpoint("qwen3")), block_size=4, max_model_length=64,
              max_num_sequences=16, grammar_step_budget_ms=25.0,
              grammar_step_budget_multiple=0.0)
    constrained = SamplingParams(temperature=0.0, max_tokens=10,
                                 structured_outputs=StructuredOutputsParams(regex=REGEX))
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    [alone] = llm.generate([[5, 6, 7]], plain, use_tqdm=False)
    [quick_alone] = llm.generate([[9, 8]], constrained, use_tqdm=False)
    new_matcher = matchers.new_matcher
    with monkeypatch.context() as patch:
        patch.setattr(matchers, "new_matcher",
                      lambda grammar: SpinningMatcher(new_matcher(grammar), 0.010))
        slow = [llm.add_request([9, 8], constrained) for _ in range(8)]
    quick = [llm.add_request([9, 8], constrained) for _ in range(2)]
    plain_id = llm.add_request([5, 6, 7], plain)
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str | None] = {}
    while llm.has_unfinished_requests():
        for out in llm.step_outputs()[0]:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            reasons[out.request_id] = out.finish_reason
    ended = [i for i in slow if reasons[i] == "grammar_too_slow"]
    assert len(ended) == 6, reasons
    assert all(len(tokens[i]) == 1 and chr(tokens[i][0]) in "ab" for i in ended)
    for i in [*set(slow) - set(ended), *quick]:  # the same greedy output as alone
        assert reasons[i] == "stop" and tokens[i] == quick_alone["token_ids"], (i, tokens[i])
        assert re.fullmatch(REGEX, bytes(tokens[i][:-1]).decode())
    assert reasons[plain_id] == "length" and tokens[plain_id] == alone["token_ids"]
