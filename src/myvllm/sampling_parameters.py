"""SamplingParams: how one request turns logits into tokens, and when it stops."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from myvllm.value_checks import is_int, is_real, refusal

logger = logging.getLogger("myvllm")

# Below this a positive temperature is raised to it (vLLM's rule): logits / 1e-40 overflow
# float32 to inf, and the softmax of inf - inf is NaN, which samples token 0 whatever the
# logits say. At 0.01 sampling is as good as greedy already.
MIN_TEMPERATURE = 1e-2
# Above this (float32's largest number) a temperature would be inf in the device's float32
# tensors, so it is lowered to it; sampling is uniform long before.
MAX_TEMPERATURE = 3.4028234663852886e38
MAX_INT64 = 2**63 - 1  # top_k is an int64 tensor on the device
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit seed
# The most top logprobs a request may ask for per token (vLLM's default max_logprobs, and
# OpenAI's limit): each is a column of a top-k over the vocabulary, copied to the host.
MAX_LOGPROBS = 20
# The most completions one request may ask for (OpenAI's limit for n): each is a sequence of
# its own in the engine, with its own blocks once it decodes.
MAX_N = 128
# The size of one structured-output spec (StructuredOutputsParams), refused beyond before any
# compile: a grammar's compile time and memory grow with it (measured with a 49k-token
# vocabulary: 1,000 EBNF rules 0.6 s and 8 MB; 4,000 choices 10.7 MB; with a 256-token one,
# 3,000 rules 7 s and 15,000 rules 27 s). Config.grammar_compile_timeout_s bounds the rest.
MAX_GRAMMAR_CHARS = 100_000  # the spec as text: a schema's JSON, a regex, a grammar, choices
MAX_GRAMMAR_RULES = 1_000  # an EBNF grammar's rules ("::="), a JSON schema's subschemas
MAX_SCHEMA_DEPTH = 64  # a JSON schema's nesting of objects and arrays
MAX_CHOICES = 1_024  # the strings of one choice


@dataclass
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's name and fields): exactly one of
    json, regex, choice, grammar, json_object. The engine compiles it into a grammar
    (xgrammar) and lets the sampler pick only tokens that keep the output inside it
    (structured_output/manager.py). The output ends with eos once the grammar is complete;
    max_tokens, max_model_length or a stop string can still cut it short."""

    json: str | dict[str, Any] | None = None
    """A JSON schema (as a dict or its JSON text): the output is one JSON value it accepts."""

    regex: str | None = None
    """The output matches this regular expression, whole."""

    choice: list[str] | None = None
    """The output is exactly one of these strings."""

    grammar: str | None = None
    """An EBNF grammar (xgrammar's dialect, GBNF-like, with a `root` rule)."""

    json_object: bool | None = None
    """True: any JSON object (OpenAI's response_format {"type": "json_object"})."""

    disable_any_whitespace: bool = False
    """For json and json_object: no free whitespace in the JSON (one fixed separator style,
    ", " and ": "). Otherwise up to 16 whitespace characters may stand between two of its
    tokens (enough for pretty-printing, a bound on a small model's runs of newlines)."""

    def __post_init__(self) -> None:
        kinds = ("json", "regex", "choice", "grammar", "json_object")
        given = [name for name in kinds if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams was given {', '.join(given) or 'none'}; "
                             "allowed: exactly one of json, regex, choice, grammar, json_object")
        if self.json is not None:
            if isinstance(self.json, str):
                # Measured on the text first: json.loads recurses, and a string nested a
                # thousand deep would raise RecursionError.
                _check_depth(json_text_depth(self.json))
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"StructuredOutputsParams.json is not valid JSON ({e}); "
                                     "allowed: a JSON schema") from None
            else:
                schema = self.json
                _check_depth(json_value_depth(schema))
                try:
                    json.dumps(schema)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"StructuredOutputsParams.json is not JSON ({e}); "
                                     "allowed: a JSON schema") from None
            if not isinstance(schema, (dict, bool)):
                raise refusal("StructuredOutputsParams.json", self.json,
                              "a JSON schema, an object (or true/false)")
            _check_count("json", "subschemas (objects)", count_objects(schema),
                         MAX_GRAMMAR_RULES, "MAX_GRAMMAR_RULES")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise refusal(f"StructuredOutputsParams.{name}", value, "a non-empty str")
        if self.choice is not None and not (
                isinstance(self.choice, list) and self.choice
                and all(isinstance(c, str) and c for c in self.choice)):
            raise refusal("StructuredOutputsParams.choice", self.choice,
                          "a non-empty list of non-empty strings")
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise refusal(f"StructuredOutputsParams.{name}", value, "True or False")
        if self.grammar is not None:
            _check_count("grammar", 'rules ("::=")', self.grammar.count("::="),
                         MAX_GRAMMAR_RULES, "MAX_GRAMMAR_RULES")
        if self.choice is not None:
            _check_count("choice", "strings", len(self.choice), MAX_CHOICES, "MAX_CHOICES")
        kind, spec, _ = self.key()
        _check_count(kind, "characters", len(spec), MAX_GRAMMAR_CHARS, "MAX_GRAMMAR_CHARS")

    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar: (kind, spec as text, whitespace setting)."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "disable_any_whitespace" and value not in (None, False):
                if f.name == "json" and isinstance(value, str):
                    value = json.loads(value)  # a schema's text and its dict: one key
                # Keys in their order: a schema's properties are generated in that order.
                spec = value if isinstance(value, str) else json.dumps(value)
                return f.name, spec, self.disable_any_whitespace
        raise AssertionError("__post_init__ checked that one kind is given")


def _check_count(kind: str, what: str, count: int, limit: int, name: str) -> None:
    if count > limit:
        raise ValueError(f"StructuredOutputsParams.{kind} has {count:,} {what}; allowed: at "
                         f"most {limit:,} ({name})")


def _check_depth(depth: int) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"StructuredOutputsParams.json is nested {depth:,} deep (objects "
                         f"and arrays); allowed: at most {MAX_SCHEMA_DEPTH} (MAX_SCHEMA_DEPTH)")


def json_text_depth(text: str) -> int:
    """The deepest nesting of [ and { in a JSON text (outside its strings), without parsing
    it: no recursion, whatever the depth."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def json_value_depth(value: Any) -> int:
    """The deepest nesting of dicts and lists in a JSON value, walked without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def count_objects(value: Any) -> int:
    """The dicts in a JSON value (a schema's subschemas, and the objects of its data)."""
    count = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            count += 1
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


@dataclass
class SamplingParams:
    temperature: float = 1.0
    """Divides the logits before softmax. 0 means greedy (argmax), the deterministic mode every
    correctness test uses; larger values flatten the distribution. A positive value below
    0.01 is raised to 0.01, one above float32's largest number (3.4e38) lowered to it."""

    top_k: int = -1
    """Sample only among the k most likely tokens; -1 = no limit."""

    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p;
    1.0 = no limit."""

    max_tokens: int = 64
    """Most completion tokens to generate. The prompt and max_tokens must fit in the
    engine's max_model_length: a request asking for more is refused when it is added (the
    server's 400 says the same), never cut short by the context unannounced."""

    ignore_eos: bool = False
    """Keep generating past the eos token (benchmarks use it to get fixed output lengths)."""

    seed: int | None = None
    """Per-request random seed, so a sampled (temperature > 0) request is reproducible no matter
    which other requests share its batches. None = the engine's global random state."""

    logprobs: int | None = None
    """Return each completion token's logprob and the `logprobs` most likely tokens' (0 to
    20: 0 is the sampled token's alone). They are the log-softmax of the model's raw logits,
    before temperature, top-k and top-p (vLLM's default). None = off: no cost."""

    prompt_logprobs: int | None = None
    """The same for each prompt token (the first has none: nothing predicts it). Such a
    request does not read the prefix cache, as in vLLM: a cached token has no logits, so its
    whole prompt is computed. None = off."""

    # The sampling controls below are vLLM's. A request that keeps them all at their defaults
    # costs nothing for them (sample/sampling_controls.py builds their tensors only for the
    # rows that ask); the order they act in is layers/logits_processors.py's.

    presence_penalty: float = 0.0
    """Subtracted from the logit of every token that already appears in the completion (OpenAI's
    definition), in [-2, 2]: > 0 favours new tokens, < 0 repetition."""

    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it appears in the completion so far, in
    [-2, 2]."""

    repetition_penalty: float = 1.0
    """transformers' and vLLM's multiplicative penalty on every token of the prompt or the
    completion: a positive logit is divided by it, a negative one multiplied; > 1 discourages
    repetition, 1 = off. Any number > 0."""

    min_p: float = 0.0
    """Drop the tokens whose probability (after temperature) is below min_p times the most
    likely token's, in [0, 1]; 0 = off."""

    logit_bias: dict[int, float] | None = None
    """token id -> a number added to its logit before anything else (-100 or 100 in effect bans
    or forces it). None = off."""

    min_tokens: int = 0
    """Generate at least this many tokens before eos or a stop_token_ids token may end the
    request: until then they are masked out of sampling. At most max_tokens."""

    stop_token_ids: list[int] | None = None
    """Token ids that end the request (finish reason "stop") like eos, even with ignore_eos; the
    token is in token_ids but not in the text. None = none."""

    n: int = 1
    """Completions of the prompt to generate (vLLM's meaning), 1 to 128. The prompt is
    prefilled once and its completions share its full KV blocks; each samples on its own
    (with a seed, completion i draws from seed + i; see for_completion)."""

    def for_completion(self, index: int) -> SamplingParams:
        """The params of completion `index` of an n-completion request: n=1, and with a
        seed, seed + index (mod 2**64; vLLM's rule), so that completion 0 is what n=1 with
        the same seed gives and the others draw distinct, reproducible streams."""
        seed = None if self.seed is None else (self.seed + index) % (MAX_SEED + 1)
        return replace(self, n=1, seed=seed)

    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, a regex, a choice or a grammar (vLLM's field).
    It costs a grammar step on the host per token, a bitmask applied to the logits, and, with
    async scheduling, the overlap of the steps it takes part in. None = off."""

    def __post_init__(self) -> None:
        t = self.temperature
        if not (is_real(t) and math.isfinite(t) and t >= 0):
            raise refusal("SamplingParams.temperature", t, "a finite number >= 0 (0 = greedy)")
        if 0 < t < MIN_TEMPERATURE:
            logger.warning(f"temperature {t} is raised to {MIN_TEMPERATURE}: smaller ones "
                           "overflow the logits (use 0 for greedy)")
            self.temperature = MIN_TEMPERATURE
        if t > MAX_TEMPERATURE:
            logger.warning(f"temperature {t} is lowered to {MAX_TEMPERATURE:.7g}, the largest "
                           "float32 (sampling is uniform at either)")
            self.temperature = MAX_TEMPERATURE
        k = self.top_k
        if not (is_int(k) and (k == -1 or 1 <= k <= MAX_INT64)):
            raise refusal("SamplingParams.top_k", k, "-1 (no limit) or an int in [1, 2**63 - 1]")
        p = self.top_p
        if not (is_real(p) and 0.0 < p <= 1.0):
            raise refusal("SamplingParams.top_p", p, "a number in (0, 1]")
        check_max_tokens_value(self.max_tokens)
        if not isinstance(self.ignore_eos, bool):
            raise refusal("SamplingParams.ignore_eos", self.ignore_eos, "True or False")
        if self.seed is not None and not (is_int(self.seed) and 0 <= self.seed <= MAX_SEED):
            raise refusal("SamplingParams.seed", self.seed, "None or an int in [0, 2**64 - 1]")
        if not (is_int(self.n) and 1 <= self.n <= MAX_N):
            raise refusal("SamplingParams.n", self.n, f"an int in [1, {MAX_N}]")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not (is_int(k) and 0 <= k <= MAX_LOGPROBS):
                raise refusal(f"SamplingParams.{name}", k,
                              f"None (off) or an int in [0, {MAX_LOGPROBS}]")
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                raise ValueError(f"SamplingParams.structured_outputs is a {type(so).__name__}; "
                                 "allowed: None or a StructuredOutputsParams")
            if self.ignore_eos:
                raise ValueError("SamplingParams.ignore_eos=True does not combine with "
                                 "structured_outputs: once the output is complete, eos is "
                                 "the only token the grammar allows; allowed with it: "
                                 "SamplingParams.ignore_eos=False")
        self._check_sampling_controls()

    def _check_sampling_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (is_real(v) and -2.0 <= v <= 2.0):
                raise refusal(f"SamplingParams.{name}", v, "a number in [-2, 2]")
        r = self.repetition_penalty
        if not (is_real(r) and math.isfinite(r) and r > 0):
            raise refusal("SamplingParams.repetition_penalty", r,
                          "a finite number > 0 (1 = off)")
        if not (is_real(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise refusal("SamplingParams.min_p", self.min_p, "a number in [0, 1]")
        if not (is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens):
            raise refusal("SamplingParams.min_tokens", self.min_tokens,
                          f"an int in [0, max_tokens = {self.max_tokens}]")
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias)
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not (isinstance(ids, (list, tuple))
                    and all(is_int(t) and 0 <= t <= MAX_INT64 for t in ids)):
                raise refusal("SamplingParams.stop_token_ids", ids,
                              "None or a list of token ids (ints >= 0)")
            self.stop_token_ids = list(ids)  # a copy: the caller may reuse its list


def check_max_tokens_value(max_tokens: object) -> None:
    """max_tokens an int >= 1: one check and one message for SamplingParams and the server's
    400 (entrypoints/serving_completion.py), so the library and the server answer alike."""
    if not (is_int(max_tokens) and max_tokens >= 1):
        raise refusal("SamplingParams.max_tokens", max_tokens,
                      "an int >= 1 (the most completion tokens to generate)")


def _checked_logit_bias(bias: object) -> dict[int, float]:
    if not isinstance(bias, Mapping):
        raise ValueError(f"SamplingParams.logit_bias is a {type(bias).__name__}; allowed: "
                         "None or a dict of token id -> bias")
    for token, value in bias.items():
        if not (is_int(token) and 0 <= token <= MAX_INT64):
            raise ValueError(f"SamplingParams.logit_bias has the key {token!r}; allowed: "
                             "token ids (ints >= 0) as keys")
        if not (is_real(value) and math.isfinite(value)):
            raise ValueError(f"SamplingParams.logit_bias has {value!r} for token {token}; "
                             "allowed: finite numbers as values")
    return {token: float(value) for token, value in bias.items()}
