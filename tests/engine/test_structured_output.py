"""Structured outputs (SamplingParams.structured_outputs) on the CPU, with the tiny random
Qwen3 and its byte-level tokenizer (token i = byte i, eos = token 0).

The oracles: jsonschema validates every JSON output against its schema (random small object
schemas from a seeded generator), json.loads for json_object, re.fullmatch for a regex,
membership for a choice; the same engine with async scheduling off, or without chunked
prefill, gives the same greedy tokens. A random model follows no instruction, so whatever
it writes is the grammar's doing. Every schema here bounds its output (string lengths,
integer ranges, array sizes, no free whitespace), so each output ends on eos within
max_tokens: the test checks that it did.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import pytest
from helpers_models import build_tiny_checkpoint, random_prompts, tiny_checkpoint
from helpers_schemas import (EOS, assert_declared_order, finished_on_eos,
                             random_object_schema)
from helpers_overlap import record_overlap

from myvllm import LLM, SamplingParams
from myvllm.sampling_parameters import StructuredOutputsParams
from myvllm.structured_output.manager import manager_for

MAX_TOKENS = 200
ENGINE_KW = dict(block_size=4, max_model_length=256, max_num_sequences=16)


def engine(path: Any = None, **overrides: Any) -> LLM:
    return LLM(str(path or tiny_checkpoint("qwen3")), **{**ENGINE_KW, **overrides})


def check_schema_outputs(llm: LLM, num_schemas: int, seed: int) -> None:
    rng = random.Random(seed)
    schemas = [random_object_schema(rng) for _ in range(num_schemas)]
    params = [SamplingParams(temperature=1.0, seed=seed * 1000 + i, max_tokens=240,
                             structured_outputs=StructuredOutputsParams(
                                 json=schema, disable_any_whitespace=True))
              for i, schema in enumerate(schemas)]
    prompts = random_prompts([rng.randint(1, 12) for _ in schemas], seed=seed)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for schema, out in zip(schemas, outs):
        assert finished_on_eos(out), (schema, out["text"])
        value = json.loads(out["text"])
        jsonschema.validate(value, schema)
        assert_declared_order(value, schema)


def test_generated_schemas_give_outputs_that_validate() -> None:
    check_schema_outputs(engine(), num_schemas=8, seed=0)


@pytest.mark.slow
def test_hundreds_of_generated_schemas_give_outputs_that_validate() -> None:
    llm = engine(max_num_sequences=64)
    for seed in range(1, 7):  # 300 schemas, 50 a batch
        check_schema_outputs(llm, num_schemas=50, seed=seed)


# ---------------------------------------------------------------------------- other kinds
def test_choice_and_regex() -> None:
    llm = engine()
    choices = ["yes", "no", "maybe not", 'say "hi"\n', "\u00e9\U0001f600"]
    regex = r"[a-c]{2,5}-\d{2}(\.[xyz])?"
    params = ([SamplingParams(temperature=t, seed=i, max_tokens=MAX_TOKENS,
                              structured_outputs=StructuredOutputsParams(choice=choices))
               for i, t in enumerate([0.0, 1.0, 1.0, 2.0])]
              + [SamplingParams(temperature=t, seed=i, max_tokens=MAX_TOKENS,
                                structured_outputs=StructuredOutputsParams(regex=regex))
                 for i, t in enumerate([0.0, 1.0, 1.0, 2.0])])
    outs = llm.generate(random_prompts([3, 7, 1, 5] * 2, seed=1), params, use_tqdm=False)
    for out in outs[:4]:
        assert finished_on_eos(out) and out["text"] in choices, out
    for out in outs[4:]:
        assert finished_on_eos(out) and re.fullmatch(regex, out["text"]), out


@pytest.mark.slow
def test_json_object_gives_objects() -> None:
    """Any JSON object: its values are free, so a random model may not close it within
    max_tokens; those that end on eos parse as an object."""
    llm = engine()
    objects = llm.generate(random_prompts([4] * 6, seed=2), [
        SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS,
                       structured_outputs=StructuredOutputsParams(
                           json_object=True, disable_any_whitespace=True))
        for i in range(6)], use_tqdm=False)
    ended = [out for out in objects if finished_on_eos(out)]
    assert ended, [out["text"] for out in objects]
    for out in ended:
        assert isinstance(json.loads(out["text"]), dict), out["text"]


def test_an_ebnf_grammar_and_unconstrained_rows_beside_it() -> None:
    llm = engine()
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    prompts = random_prompts([5, 6, 9], seed=3)
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = llm.generate(prompts[1:2], plain, use_tqdm=False)
    outs = llm.generate(prompts, [
        SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
                       structured_outputs=StructuredOutputsParams(grammar=grammar)),
        plain,
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                       structured_outputs=StructuredOutputsParams(grammar=grammar))],
        use_tqdm=False)
    for out in (outs[0], outs[2]):
        assert finished_on_eos(out) and re.fullmatch(r"\((\d|x)(,(\d|x))*\)", out["text"])
    # The bitmask of the other rows does not touch an unconstrained one.
    assert outs[1]["token_ids"] == alone[0]["token_ids"]


# ---------------------------------------------------------------------------- scheduling
def mixed_requests(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    schemas = [random_object_schema(rng) for _ in range(4)]
    constraints = [StructuredOutputsParams(json=s, disable_any_whitespace=True)
                   for s in schemas]
    constraints += [StructuredOutputsParams(choice=["alpha", "beta", "gamma"]),
                    StructuredOutputsParams(regex=r"[0-9]{3,8}"), None, None]
    params = [SamplingParams(temperature=0.0, max_tokens=100 if c else 30,
                             structured_outputs=c) for c in constraints]
    return random_prompts([rng.randint(1, 40) for _ in params], seed=seed), params


@pytest.mark.parametrize("overrides", [
    {}, pytest.param({"num_kvcache_blocks": 40}, marks=pytest.mark.slow)],
    ids=["roomy", "preempting"])
def test_async_scheduling_gives_the_sync_tokens(overrides: dict[str, Any]) -> None:
    """Greedy: the same tokens with and without overlap, constrained rows beside plain ones,
    and with a KV pool so small that sequences are preempted and recomputed."""
    prompts, params = mixed_requests(seed=4)
    sync = engine(async_scheduling=False, **overrides).generate(prompts, params,
                                                                use_tqdm=False)
    overlapped = engine(async_scheduling=True, **overrides).generate(prompts, params,
                                                                     use_tqdm=False)
    assert [o["token_ids"] for o in overlapped] == [o["token_ids"] for o in sync]
    for out, p in zip(sync, params):
        so = p.structured_outputs
        if so is not None and so.json is not None and finished_on_eos(out):
            jsonschema.validate(json.loads(out["text"]), so.json)


def test_chunked_prefill_gives_the_unchunked_tokens() -> None:
    """Long prompts cut into chunks of 16 tokens: the mask only applies at the step that
    samples, and the tokens equal those of whole-prompt prefills."""
    prompts, params = mixed_requests(seed=5)
    prompts = random_prompts([50, 37, 90, 21, 64, 45, 80, 33], seed=5)
    chunked = engine(enable_chunked_prefill=True, max_num_batched_tokens=16
                     ).generate(prompts, params, use_tqdm=False)
    whole = engine(enable_chunked_prefill=False, max_num_batched_tokens=256
                   ).generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in chunked] == [o["token_ids"] for o in whole]


def test_the_async_step_waits_only_after_a_constrained_row() -> None:
    """With a constrained row in flight, the next step is planned only after its tokens
    were read (run, post, run, ...); plain requests keep the overlap (run, run)."""
    llm = engine(async_scheduling=True)
    calls = record_overlap(llm)
    llm.generate([[5, 6, 7]], SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(regex="[a-z]{6}")), use_tqdm=False)
    assert "run" in calls and all(a != b for a, b in zip(calls, calls[1:])), calls
    calls.clear()
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                 use_tqdm=False)
    assert any(a == b == "run" for a, b in zip(calls, calls[1:])), calls


# ---------------------------------------------------------------------------- vocabulary
def test_padded_logits_never_pick_an_id_past_the_tokenizer(tmp_path: Any) -> None:
    """A model with 300 logits and a 256-token tokenizer: ids 256..299 are no text, and a
    constrained row never gets one, even where the model favours them (at temperature 5
    the draw is nearly uniform over the 300)."""
    path = build_tiny_checkpoint("qwen3", tmp_path / "padded", vocab_size=300)
    llm = engine(path)
    unconstrained = llm.generate(random_prompts([4], seed=6), SamplingParams(
        temperature=5.0, seed=1, max_tokens=60, ignore_eos=True), use_tqdm=False)
    assert max(unconstrained[0]["token_ids"]) >= 256  # the padding is there to be picked
    outs = llm.generate(random_prompts([4] * 4, seed=6), [SamplingParams(
        temperature=5.0, seed=i, max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(regex=r"[a-z ]{1,40}")) for i in range(4)],
        use_tqdm=False)
    for out in outs:
        assert finished_on_eos(out) and max(out["token_ids"]) < 256, out["token_ids"]
        assert re.fullmatch(r"[a-z ]{1,40}", out["text"])


def test_the_grammar_follows_the_sampled_tokens_exactly() -> None:
    """Each step allows exactly what a fresh matcher fed the tokens so far allows: the
    engine's mask for the last step of a finished output is the stop token alone."""
    import xgrammar as xgr

    llm = engine()
    so = StructuredOutputsParams(json={"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]},
        disable_any_whitespace=True)
    out = llm.generate([[3, 4]], SamplingParams(temperature=1.0, seed=7, max_tokens=50,
                                                structured_outputs=so), use_tqdm=False)[0]
    matcher = manager_for(llm.engine_core).matcher_for(so)
    bitmask = xgr.allocate_token_bitmask(1, 256)
    for token in out["token_ids"]:
        matcher.fill_next_token_bitmask(bitmask)
        assert (int(bitmask[0, token // 32]) >> (token % 32)) & 1, token
        assert matcher.accept_token(token)
    assert matcher.is_terminated() and out["token_ids"][-1] == EOS
    assert re.fullmatch(r'\{"n": [0-9]\}', out["text"]), out["text"]


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1, 2]"}, r"json='\[1, 2\]': allowed: a JSON schema"),
    ({"json": 5}, "json=5: allowed: a JSON schema"),
    ({"regex": ""}, "non-empty str"),
    ({"grammar": 5}, "non-empty str"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", ""]}, "non-empty list"),
    ({"choice": "ab"}, "non-empty list"),
    ({"json_object": 1}, "True or False"),
    ({"json_object": True, "disable_any_whitespace": "yes"}, "True or False"),
])
def test_bad_structured_outputs_params_raise(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_bad_constraints_are_refused_before_any_work() -> None:
    with pytest.raises(ValueError,
                       match="ignore_eos=True does not combine with structured_outputs"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a"))
    with pytest.raises(ValueError, match="structured_outputs is a dict; allowed: None or"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]
    llm = engine()
    for so, message in [
            (StructuredOutputsParams(regex="(unclosed"), "StructuredOutputsParams.regex='(unclosed'"
                                                         ": allowed: one that compiles (this "
                                                         "regex cannot be compiled: Regex"),
            (StructuredOutputsParams(json={"type": "nonsense"}), 'Unsupported type "nonsense"'),
            (StructuredOutputsParams(grammar='item ::= "a"'), 'root rule with name "root"')]:
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.add_request([1, 2], SamplingParams(structured_outputs=so))
    assert not llm.engine_core.requests


def test_a_checkpoint_without_a_tokenizer_refuses_a_constraint(tmp_path: Any) -> None:
    path = build_tiny_checkpoint("qwen3", tmp_path / "bare")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.json", "merges.txt"):
        (path / name).unlink(missing_ok=True)
    llm = engine(path)
    with pytest.raises(ValueError, match=r"SamplingParams.structured_outputs for .*bare, which "
                                         r"has no tokenizer: allowed: None \(structured_outputs "
                                         "needs the model's tokenizer"):
        llm.add_request([1, 2], SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="a+")))


def test_an_engine_without_eos_refuses_a_constraint() -> None:
    """A grammar ends the output with eos: with eos=-1 nothing could end it."""
    llm = engine(eos=-1)
    with pytest.raises(ValueError, match=r"SamplingParams.structured_outputs with eos=-1 .*: "
                                         r"allowed: None \(structured_outputs needs an eos"):
        llm.add_request([1, 2], SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="a+")))
    assert not llm.engine_core.requests


def test_grammars_are_compiled_once_per_spec() -> None:
    llm = engine()
    manager = manager_for(llm.engine_core)
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
    first = manager.compiled_grammar(StructuredOutputsParams(json=schema))
    # The same schema as text: the same grammar.
    same = manager.compiled_grammar(StructuredOutputsParams(
        json='{"type":"object",  "properties": {"a": {"type": "boolean"}}}'))
    assert same is first
    other = manager.compiled_grammar(StructuredOutputsParams(json=schema,
                                                             disable_any_whitespace=True))
    assert other is not first


def test_specs_past_the_size_limits_are_refused_before_any_compile() -> None:
    """Each names its limit and the spec's own figure; a schema nested deeper than Python's
    recursion limit is measured without recursing (it used to raise RecursionError)."""
    deep = {"type": "string"}
    for _ in range(2000):
        deep = {"type": "array", "items": deep}
    for make, message in [
            (lambda: StructuredOutputsParams(json="[" * 5000 + "]" * 5000),
             "json is nested 5,000 deep (objects and arrays); allowed: at most 64"),
            (lambda: StructuredOutputsParams(json=deep), "json is nested 2,001 deep"),
            (lambda: StructuredOutputsParams(grammar="root ::= a\n" + "a ::= \"x\"\n" * 1000),
             'grammar has 1,001 rules ("::="); allowed: at most 1,000 (MAX_GRAMMAR_RULES)'),
            (lambda: StructuredOutputsParams(choice=["x"] * 1025),
             "choice has 1,025 strings; allowed: at most 1,024 (MAX_CHOICES)"),
            (lambda: StructuredOutputsParams(regex="a" * 100_001),
             "regex has 100,001 characters; allowed: at most 100,000 (MAX_GRAMMAR_CHARS)"),
            (lambda: StructuredOutputsParams(json={"properties": {
                f"p{i}": {"type": "string"} for i in range(1000)}}),
             "json has 1,002 subschemas (objects); allowed: at most 1,000")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            make()
    # Strings holding brackets do not count as nesting.
    StructuredOutputsParams(json=json.dumps({"enum": ["[" * 100, "{\\\"" * 100]}))


def test_a_matcher_over_its_step_budget_ends_its_request() -> None:
    """An ambiguous grammar costs its matcher more with every token; eos is banned by
    min_tokens, so only the step budget (0.5 ms of CPU time a step here, the floor alone)
    can end it: a row over the limit alone is ended whatever the others do."""
    llm = engine(grammar_step_budget_ms=0.5, grammar_step_budget_multiple=0.0)
    llm.add_request([97], SamplingParams(
        temperature=0.0, max_tokens=240, min_tokens=240,
        structured_outputs=StructuredOutputsParams(
            grammar='root ::= s\ns ::= s s | "a" | "b" | ""')))
    tokens: list[int] = []
    while llm.has_unfinished_requests():
        for out in llm.step_outputs()[0]:
            tokens += out.new_token_ids
            reason = out.finish_reason
    assert reason == "grammar_too_slow"
    assert 0 < len(tokens) < 240 and set(tokens) <= {ord("a"), ord("b")}
