"""The library as vLLM's: generate() takes one prompt as well as a list, and LLM.chat runs
conversations through the tokenizer's chat template (tiny random Qwen3, the byte-level
tokenizer of helpers_models, given a chat template here: it has none of its own)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers_models import tiny_checkpoint
from myvllm import LLM, SamplingParams

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ENGINE_KW: dict[str, Any] = dict(num_kvcache_blocks=64, max_model_length=128, device="cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there"}]
OTHER = [{"role": "user", "content": "Count to three"}]


def answers(outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The outputs less num_cached_tokens (a repeated prompt finds its blocks cached)."""
    return [{k: v for k, v in out.items() if k != "num_cached_tokens"} for out in outputs]


def chat_checkpoint(dst: Path) -> Path:
    from transformers import AutoTokenizer

    shutil.copytree(tiny_checkpoint("qwen3"), dst)
    tokenizer = AutoTokenizer.from_pretrained(str(dst))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(dst))
    return dst


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    engine = LLM(str(chat_checkpoint(tmp_path_factory.mktemp("chat") / "qwen3")),
                 **ENGINE_KW)
    yield engine
    engine.exit()


def test_one_prompt_is_answered_as_a_list_of_one(llm: LLM) -> None:
    text = "The one prompt"
    alone = answers(llm.generate(text, GREEDY, use_tqdm=False))
    assert len(alone) == 1
    assert answers(llm.generate(text, GREEDY, use_tqdm=False)) == alone
    assert answers(llm.generate([text], GREEDY, use_tqdm=False)) == alone
    # One list of token ids is one prompt too (the byte tokenizer: token i = byte i).
    ids = list(text.encode())
    assert answers(llm.generate(ids, GREEDY, use_tqdm=False)) == alone
    assert len(llm.generate([ids, ids], GREEDY, use_tqdm=False)) == 2


def test_chat_of_one_conversation_is_generate_of_its_templated_prompt(llm: LLM) -> None:
    templated = ("<|system|>Be brief.\n<|user|>Hello there\n<|assistant|>")
    expected = llm.generate([list(templated.encode())], GREEDY, use_tqdm=False)
    out = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    assert answers(out) == answers(expected)
    assert set(out[0]) == set(expected[0]) and "text" in out[0] and "token_ids" in out[0]


def test_chat_of_a_list_of_conversations_answers_each_in_order(llm: LLM) -> None:
    each = [llm.chat(c, GREEDY, use_tqdm=False)[0] for c in (CONVERSATION, OTHER)]
    assert answers(llm.chat([CONVERSATION, OTHER], GREEDY, use_tqdm=False)) == answers(each)
    # One SamplingParams per conversation, as generate() takes them.
    longer = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    outs = llm.chat([CONVERSATION, OTHER], [GREEDY, longer], use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == [5, 7]


def test_chat_template_kwargs_reach_the_template(llm: LLM, monkeypatch: pytest.MonkeyPatch
                                                 ) -> None:
    monkeypatch.setattr(llm.tokenizer, "chat_template",
                        "{% if greeting %}{{ greeting }}{% endif %}"
                        "{{ messages[-1].content }}")
    expected = llm.generate("Hi! Count to three", GREEDY, use_tqdm=False)
    assert answers(llm.chat(OTHER, GREEDY, use_tqdm=False,
                            chat_template_kwargs={"greeting": "Hi! "})) == answers(expected)


@pytest.mark.parametrize("messages, pattern", [
    ("hello", r"messages must be a conversation.*got str"),
    ([], r"messages must be a conversation.*\(empty\)"),
    (None, r"messages must be a conversation.*got None"),
    ([CONVERSATION, "hello"], r"conversation 1 must be a non-empty list"),
    ([CONVERSATION, []], r"conversation 1 must be a non-empty list"),
])
def test_bad_messages_are_a_clear_type_error(llm: LLM, messages: Any, pattern: str) -> None:
    with pytest.raises(TypeError, match=pattern):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert llm.is_finished()


def test_a_model_without_chat_template_is_a_value_error(llm: LLM,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="has no chat template"):
        llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    monkeypatch.setattr(llm, "tokenizer", None)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    assert llm.is_finished()
