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
ENGINE_KW: dict[str, Any] = dict(num_kvcache_blocks=64, max_model_length=256, device="cpu")
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
    ("hello", r"messages='hello': allowed: a conversation \(a non-empty list"),
    ([], r"messages=\[\]: allowed: a conversation"),
    (None, r"messages=None: allowed: a conversation .* or a list of conversations"),
    ([CONVERSATION, "hello"], r"conversations\[1\]='hello': allowed: a non-empty list"),
    ([CONVERSATION, []], r"conversations\[1\]=\[\]: allowed: a non-empty list"),
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


# ------------------------------------------------------------ vLLM's other chat arguments
# The example ChatML template with Hermes' tools (README), too long for the tiny model's
# context of byte tokens: its prompts are rendered, not run. SHORT_TOOL_TEMPLATE's are run.
TOOL_TEMPLATE = (Path(__file__).parents[2] / "examples" / "tool_chat_template_chatml.jinja"
                 ).read_text()
SHORT_TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>"
    "{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments | tojson }}"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
ROUND_TRIP = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


def rendered(llm: LLM, messages: list[dict[str, Any]], **kw: Any) -> str:
    from myvllm.utils.chat_template import chat_prompt_ids

    return llm.tokenizer.decode(chat_prompt_ids(llm.tokenizer, messages, **kw))


def generated(llm: LLM, text: str) -> list[dict[str, Any]]:
    return answers(llm.generate(llm.tokenizer.encode(text, add_special_tokens=False), GREEDY,
                                use_tqdm=False))


def test_tools_and_a_chat_template_reach_the_prompt(llm: LLM) -> None:
    prompt = rendered(llm, OTHER, chat_template=TOOL_TEMPLATE, tools=TOOLS)
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    assert prompt.endswith("<|im_start|>user\nCount to three<|im_end|>\n"
                           "<|im_start|>assistant\n")
    out = llm.chat(OTHER, GREEDY, use_tqdm=False, chat_template=SHORT_TOOL_TEMPLATE,
                   tools=TOOLS)
    assert answers(out) == generated(llm, "<tools>get_weather;</tools><|user|>Count to three\n"
                                          "<|assistant|>")


def test_a_tool_round_trip_reads_the_arguments_as_a_dict(llm: LLM) -> None:
    prompt = rendered(llm, ROUND_TRIP, chat_template=TOOL_TEMPLATE, tools=TOOLS)
    # The call written back as the model would write it (arguments as JSON, not a string of
    # JSON), then the result as the user's <tool_response>.
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call>") in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    with_dict = [ROUND_TRIP[0], {**ROUND_TRIP[1], "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        ROUND_TRIP[2]]
    assert rendered(llm, with_dict, chat_template=TOOL_TEMPLATE, tools=TOOLS) == prompt
    assert CALL["function"]["arguments"] == '{"city": "Paris"}'  # the caller's dict unchanged
    out = llm.chat(ROUND_TRIP, GREEDY, use_tqdm=False, chat_template=SHORT_TOOL_TEMPLATE,
                   tools=TOOLS)
    assert answers(out) == generated(
        llm, '<tools>get_weather;</tools><|user|>Weather in Paris?\n<|assistant|>get_weather'
             '{"city": "Paris"}\n<|tool|>sunny, 21 C\n<|assistant|>')


def test_the_library_renders_what_the_server_renders(llm: LLM) -> None:
    from myvllm.entrypoints.openai_server import apply_chat_template
    from myvllm.entrypoints.protocol import ChatCompletionRequest
    from myvllm.utils.chat_template import chat_prompt_ids

    body = ChatCompletionRequest.model_validate(
        {"messages": ROUND_TRIP, "tools": TOOLS, "chat_template_kwargs": {"x": 1}})
    assert apply_chat_template(llm, body, TOOL_TEMPLATE) == chat_prompt_ids(
        llm.tokenizer, ROUND_TRIP, chat_template=TOOL_TEMPLATE, tools=TOOLS,
        template_kwargs={"x": 1})


def test_add_generation_prompt_false_leaves_the_assistant_turn_unopened(llm: LLM) -> None:
    out = llm.chat(CONVERSATION, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert answers(out) == generated(llm, "<|system|>Be brief.\n<|user|>Hello there\n")


@pytest.mark.parametrize("kw, error, pattern", [
    ({"tools": {"type": "function"}}, TypeError,
     r"tools=\{'type': 'function'\}: allowed: a list of"),
    ({"tools": [{"type": "function", "function": {}}]}, TypeError,
     r"tools\[0\]=\{.*\}: allowed: a function tool"),
    ({"tools": TOOLS, "chat_template_kwargs": {"tools": []}}, ValueError,
     r"chat_template_kwargs\['tools'\]=\[\]: allowed: none beside tools \(tools given twice"),
])
def test_bad_tools_are_refused_before_any_work(llm: LLM, kw: dict[str, Any], error: type,
                                               pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        llm.chat(OTHER, GREEDY, use_tqdm=False, chat_template=TOOL_TEMPLATE, **kw)
    assert llm.is_finished()


@pytest.mark.parametrize("arguments, pattern", [
    ("{oops", r"messages\[1\]\.tool_calls\[0\]\.function\.arguments='\{oops': allowed: a "
              r"JSON object, as text or as a dict \(this text is not JSON\)"),
    ("[1, 2]", r"arguments='\[1, 2\]': allowed: a JSON object.*\(this JSON is not an object\)"),
])
def test_tool_call_arguments_that_are_not_a_json_object_are_refused(
        llm: LLM, arguments: str, pattern: str) -> None:
    bad = [ROUND_TRIP[0], {**ROUND_TRIP[1], "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": arguments}}]}]
    with pytest.raises(ValueError, match=pattern):
        llm.chat(bad, GREEDY, use_tqdm=False, chat_template=TOOL_TEMPLATE, tools=TOOLS)
    assert llm.is_finished()
