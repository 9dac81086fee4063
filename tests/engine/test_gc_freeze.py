"""generate() and the serving loop keep the garbage collector's full collections off the engine.

frozen_heap() freezes what exists on entry (gc.freeze), also when something froze earlier, and
unfreezes on the exit of the outermost block, also after an error. generate() runs its steps
inside it: a spy on step() sees the heap frozen, and nothing stays frozen after it returns or
raises.
"""

from __future__ import annotations

import gc

import pytest
from helpers_models import tiny_checkpoint

from myvllm import LLM, SamplingParams
from myvllm.utils import gc_freeze
from myvllm.utils.gc_freeze import frozen_heap

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(autouse=True)
def nothing_frozen(monkeypatch: pytest.MonkeyPatch):
    """Each test starts with no block open and nothing frozen. A served app of an earlier
    test module may still run in this process inside its own frozen_heap (the server keeps
    its start-up heap frozen for its life): its block is set aside for the test and put back
    after it, frozen again, so the order of the test modules changes nothing."""
    outer_blocks = gc_freeze._depth
    monkeypatch.setattr(gc_freeze, "_depth", 0)
    gc.unfreeze()
    yield
    gc.unfreeze()
    monkeypatch.undo()
    assert gc_freeze._depth == outer_blocks
    if outer_blocks:
        gc.freeze()


def test_frozen_heap_freezes_what_exists_and_restores_it() -> None:
    class Node:
        pass

    before = Node()
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        assert not any(o is before for o in gc.get_objects())  # out of the collector's reach
        after = Node()
        assert any(o is after for o in gc.get_objects())  # new objects are collected as usual
    assert gc.get_freeze_count() == 0
    assert any(o is before for o in gc.get_objects())


def test_frozen_heap_restores_after_an_error() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with frozen_heap():
            raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def test_frozen_heap_freezes_also_after_an_earlier_freeze() -> None:
    """A library or the caller froze early (seen on the H200 machine: 375 objects at start-up):
    what was created since must still be frozen, or the engine is walked after all."""
    gc.freeze()

    class Node:
        pass

    later = Node()
    with frozen_heap():
        assert not any(o is later for o in gc.get_objects())
    assert gc.get_freeze_count() == 0  # one frozen generation: the exit unfreezes it all


def test_nested_frozen_heaps_unfreeze_at_the_outermost_exit() -> None:
    class Node:
        pass

    with frozen_heap():
        between = Node()
        with frozen_heap():
            assert not any(o is between for o in gc.get_objects())
        assert gc.get_freeze_count() > 0  # the outer block is still open
        assert not any(o is between for o in gc.get_objects())
    assert gc.get_freeze_count() == 0


def test_generate_steps_with_the_heap_frozen() -> None:
    llm = LLM(str(tiny_checkpoint("llama")), block_size=4, max_model_length=32,
              max_num_batched_tokens=64)
    seen: list[int] = []
    step = llm.step

    def spy():
        seen.append(gc.get_freeze_count())
        return step()

    llm.step = spy  # type: ignore[method-assign]
    out = llm.generate([[11, 12, 13], [21, 22]], GREEDY, use_tqdm=False)
    assert [len(o["token_ids"]) for o in out] == [4, 4]
    assert seen and all(count > 0 for count in seen)
    assert gc.get_freeze_count() == 0

    def failing_step():
        raise RuntimeError("step failed")

    llm.step = failing_step  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="step failed"):
        llm.generate([[11, 12, 13]], GREEDY, use_tqdm=False)
    assert gc.get_freeze_count() == 0
