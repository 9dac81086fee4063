"""Structured outputs: a grammar per request, a matcher per sequence, a bitmask per step.

SamplingParams.structured_outputs (a JSON schema, a regex, a choice, an EBNF grammar, or any
JSON object) is compiled by xgrammar against the model's vocabulary into a CompiledGrammar,
cached by its spec, so that a thousand requests with one schema compile it once. Each
Sequence gets a GrammarMatcher of its own: the state of its output in that grammar.

    make_sequence       StructuredOutputManager.add_matcher(seq) -> seq.extras.grammar_matcher
    LogitsFeatures      fill_token_bitmask(seqs): one row of bits per sequence, bit t of a
                        row = token t may come next (the matcher's fill_next_token_bitmask;
                        rows without a grammar, or whose chunk does not sample, allow all)
    Sampler             apply_token_bitmask: the disallowed logits become -inf, then the
                        usual greedy / temperature / top-k / top-p sampling
    postprocess         Sequence.append_token: matcher.accept_token(the sampled token)

Once the grammar is complete the matcher allows only the stop tokens (the engine's eos ids),
so the sequence ends there. The bitmask is as wide as the logits (the LM head's rows): ids
past the tokenizer's own vocabulary (padding) are never allowed.

The bitmask of a step depends on the tokens before it, so a constrained row cannot be
planned before its previous token is on the host: with async scheduling, a step that held
a constrained row is read back before the next step is planned (EngineCore.step).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

import torch

from myvllm.engine.sequence import Sequence
from myvllm.engine.startup import tokenizer_if_any
from myvllm.sampling_parameters import StructuredOutputsParams

# Free whitespace in JSON (json, json_object without disable_any_whitespace): at most this
# many characters between two of its tokens. Pretty-printed JSON needs a newline and its
# indent; a small model left free can fill max_tokens with newlines instead.
MAX_JSON_WHITESPACE = 16
# Compiled grammars kept (least recently used dropped first); one JSON schema's is a few
# hundred KB at most.
MAX_CACHED_GRAMMARS = 256


class StructuredOutputManager:
    """The xgrammar compiler of one engine, made at the first constrained request (its
    tokenizer info costs a pass over the vocabulary)."""

    def __init__(self, model_path: str, vocab_size: int, stop_token_ids: list[int]) -> None:
        """vocab_size: the logits' width (the LM head's rows), which may exceed the
        tokenizer's vocabulary; stop_token_ids: the engine's eos ids."""
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._compiler: Any = None
        self._grammars: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()

    def compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            tokenizer = tokenizer_if_any(self.model_path)
            if tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer, and "
                                 f"{self.model_path} has none")
            if not self.stop_token_ids:
                raise ValueError("structured_outputs needs an eos token to end the output, "
                                 "and this engine has none (eos=-1)")
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            # Our own cache below is keyed by the request's spec; xgrammar's would key by
            # the grammar it builds from it.
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return self._compiler

    def compiled_grammar(self, params: StructuredOutputsParams) -> Any:
        """The CompiledGrammar of params, from the cache or compiled now. A bad schema,
        regex or grammar raises ValueError naming the field."""
        key = params.key()
        grammar = self._grammars.get(key)
        if grammar is None:
            grammar = self._compile(params)
            self._grammars[key] = grammar
            if len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        return grammar

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiler = self.compiler()
        whitespace: dict[str, Any] = (
            {"any_whitespace": False} if params.disable_any_whitespace
            else {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE})
        kind, spec, _ = params.key()
        try:
            if kind == "json":
                schema = bounded_strings_as_patterns(json.loads(spec))
                return compiler.compile_json_schema(json.dumps(schema), **whitespace)
            if kind == "json_object":
                # Any object: the schema {"type": "object"} (its values are any JSON).
                return compiler.compile_json_schema('{"type": "object"}', **whitespace)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(spec)))
            return compiler.compile_grammar(spec)
        except RuntimeError as e:  # xgrammar's error for a spec it cannot compile
            # Its text starts with "[time] source.cc:line: ", which tells a client nothing.
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e)).strip()
            raise ValueError(f"StructuredOutputsParams.{kind} cannot be compiled: {reason}"
                             ) from None

    def matcher_for(self, params: StructuredOutputsParams) -> Any:
        """A fresh GrammarMatcher (at the start of the output) for one sequence."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiled_grammar(params))

    def add_matcher(self, seq: Sequence) -> None:
        """seq's matcher, if its SamplingParams ask for structured outputs (a bad schema
        raises here, before the request is queued)."""
        params = seq.sampling_params.structured_outputs
        if params is not None:
            assert seq.extras is not None, "a grammar is a feature: its Sequence has extras"
            seq.extras.grammar_matcher = self.matcher_for(params)


# Keys whose values are JSON data, not subschemas.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})


def bounded_strings_as_patterns(schema: Any) -> Any:
    """The schema with each {"type": "string", "minLength": a, "maxLength": b} (no pattern,
    no format) written as {"type": "string", "pattern": "^.{a,b}$"}: the same strings.

    Why: xgrammar (0.2.9, its issue 800) compiles a length-bounded string to a character
    class that lets raw control characters (U+0001-U+001F but CR and LF) through, which JSON
    forbids, so json.loads refuses the output; its pattern path does not. Neither path
    writes escapes (\", \n, ...) inside such a string."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _DATA_KEYS else bounded_strings_as_patterns(value)
           for key, value in schema.items()}
    bounds = ("minLength" in out or "maxLength" in out)
    if (out.get("type") == "string" and bounds and "pattern" not in out
            and "format" not in out):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^.{{{low},{high}}}$"
    return out


def choice_grammar(choices: list[str]) -> str:
    """root ::= "a" | "b" ...: EBNF string literals take JSON's escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row: one bit per token id."""
    return (vocab_size + 31) // 32


def fill_token_bitmask(seqs: list[Sequence], samples: list[bool],
                       vocab_size: int) -> torch.Tensor | None:
    """The step's token bitmask on the host, [len(seqs), words] int32, or None when no row
    that samples has a grammar. samples[i]: row i's token is kept (its chunk reaches its last
    token); the other rows, and rows without a grammar, allow every token (all bits set)."""
    rows = [i for i, (seq, sample) in enumerate(zip(seqs, samples, strict=True))
            if sample and seq.extras is not None and seq.extras.grammar_matcher is not None]
    if not rows:
        return None
    bitmask = torch.full((len(seqs), bitmask_width(vocab_size)), -1, dtype=torch.int32)
    for row in rows:
        seq = seqs[row]
        if seq.num_pending_tokens:
            # Its matcher has not seen the token in flight: the mask would be for the wrong
            # position (EngineCore.step reads such a step back before planning the next).
            raise RuntimeError(f"sequence {seq.seq_id} has a grammar and a token in flight: "
                               "its bitmask cannot be built yet")
        assert seq.extras is not None  # rows: those with a grammar
        seq.extras.grammar_matcher.fill_next_token_bitmask(bitmask, row)
    return bitmask
