"""Structured outputs: a grammar per request, a matcher per sequence, a bitmask per step.

SamplingParams.structured_outputs (a JSON schema, a regex, a choice, an EBNF grammar, or any
JSON object) is compiled by xgrammar against the model's vocabulary into a CompiledGrammar,
in a thread of its own (compile_threads.py), within Config.grammar_compile_timeout_s, and
kept within Config.grammar_cache_bytes (grammar_cache.py), so that a thousand requests with
one schema compile it once. Each Sequence gets a GrammarMatcher of its own: the state of its
output in that grammar.

    the core process    GrammarWaits.hold(seq): the request waits outside the scheduler
                        while its grammar compiles (held_requests.py), then is queued with
                        seq.extras.grammar_matcher set
    make_sequence       (LLM, offline) add_matcher(seq): the same compile, waited for
    LogitsFeatures      fill_token_bitmask(seqs): one row of bits per sequence, bit t of a
                        row = token t may come next (the matcher's fill_next_token_bitmask;
                        rows without a grammar, or whose chunk does not sample, allow all);
                        a step whose grammar work is over its budget ends its costliest
                        rows (step_budget.py)
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

import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from typing import Any, Protocol

import torch

from myvllm.config import Config
from myvllm.engine.sequence import Sequence
from myvllm.engine.startup import tokenizer_if_any
from myvllm.sampling_parameters import StructuredOutputsParams
from myvllm.structured_output.compile_threads import CompileThreads, GrammarCompile
from myvllm.structured_output.grammar_cache import GrammarCache, GrammarKey
from myvllm.structured_output.held_requests import GrammarWaits
from myvllm.structured_output.matchers import TimedMatcher, new_matcher, set_matcher
from myvllm.structured_output.step_budget import GrammarStepBudget
from myvllm.value_checks import refusal

# Free whitespace in JSON (json, json_object without disable_any_whitespace): at most this
# many characters between two of its tokens. Pretty-printed JSON needs a newline and its
# indent; a small model left free can fill max_tokens with newlines instead.
MAX_JSON_WHITESPACE = 16
# Threads that compile grammars: two, so that one abandoned compile (past its time limit, it
# runs on to its end) leaves the other free for the next grammar.
NUM_COMPILE_THREADS = 2
# Grammars that ran past the time limit, remembered (by a hash of their spec) so that the
# same one asked for again is refused at once instead of taking a thread again.
MAX_SLOW_GRAMMARS_KEPT = 1024
# How often a caller waiting for a compile (add_matcher) looks at the clock.
WAIT_POLL_S = 0.05


class StructuredOutputManager:
    """The xgrammar compiler of one engine, its compile threads and its cache of compiled
    grammars. Made at the first constrained request; the compiler itself (its tokenizer info
    costs a pass over the vocabulary) is made by the first compile, in a compile thread."""

    def __init__(self, model_path: str, vocab_size: int, stop_token_ids: list[int],
                 cache_bytes: int = 256 * 2**20, compile_timeout_s: float = 5.0,
                 step_budget_s: float = 0.02, step_budget_multiple: float = 2.0) -> None:
        """vocab_size: the logits' width (the LM head's rows), which may exceed the
        tokenizer's vocabulary; stop_token_ids: the engine's eos ids; cache_bytes,
        compile_timeout_s, step_budget_s and step_budget_multiple:
        Config.grammar_cache_bytes, grammar_compile_timeout_s, grammar_step_budget_ms (in
        seconds) and grammar_step_budget_multiple."""
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.compile_timeout_s = compile_timeout_s
        # What a step's grammar work may take, across its rows (step_budget.py).
        self.step_budget = GrammarStepBudget(step_budget_s, step_budget_multiple)
        self._compiler: Any = None
        # When the compiler was made (time.monotonic()): a request's wait counts from then.
        self.compiler_ready_at: float | None = None
        self._compiler_lock = threading.Lock()  # two compile threads, one compiler
        self.cache = GrammarCache(cache_bytes)
        # Compiles queued or running, by spec: a request for one of them waits for it.
        self._compiling: dict[GrammarKey, GrammarCompile] = {}
        self._too_slow: OrderedDict[bytes, None] = OrderedDict()
        self.compile_threads = CompileThreads(NUM_COMPILE_THREADS, self.compiler, self._compile)
        self.num_compiles = 0  # compiles started (a repeated spec kept in the cache: none)
        # The core process's requests waiting for their grammar.
        self.waits = GrammarWaits(self)

    def compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()
                self.compiler_ready_at = time.monotonic()
            return self._compiler

    def _make_compiler(self) -> Any:
        import xgrammar as xgr

        tokenizer = tokenizer_if_any(self.model_path)
        if tokenizer is None:
            raise ValueError(f"SamplingParams.structured_outputs for {self.model_path}, which "
                             "has no tokenizer: allowed: None (structured_outputs needs the "
                             "model's tokenizer)")
        if not self.stop_token_ids:
            raise ValueError("SamplingParams.structured_outputs with eos=-1 (this engine has no "
                             "eos token): allowed: None (structured_outputs needs an eos token "
                             "to end the output)")
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
        # Our own cache below is keyed by the request's spec; xgrammar's would key by the
        # grammar it builds from it.
        return xgr.GrammarCompiler(info, cache_enabled=False)

    # ------------------------------------------------------------------ compiles
    def request(self, params: StructuredOutputsParams) -> GrammarCompile:
        """params' compile, for one more request to wait for: done already when its grammar
        is kept, the one under way when the same spec is being compiled, else a new one
        queued for a compile thread. A spec that ran past the time limit before raises
        ValueError."""
        self._collect_abandoned(time.monotonic())
        key = params.key()
        grammar = self.cache.get(key)
        if grammar is not None:
            return GrammarCompile.done_with(key[0], grammar)
        if _digest(key) in self._too_slow:
            raise ValueError(
                f"StructuredOutputsParams.{key[0]} took more than grammar_compile_timeout_s="
                f"{self.compile_timeout_s:g} s to compile when it was asked for before; "
                f"allowed: one that compiles within {self.compile_timeout_s:g} s")
        job = self._compiling.get(key)
        if job is None:
            job = self._compiling[key] = self.compile_threads.submit(params)
            self.num_compiles += 1
        job.waiters += 1
        return job

    def outcome(self, params: StructuredOutputsParams, job: GrammarCompile, since: float,
                now: float) -> Any:
        """The compiled grammar once job is done (kept in the cache), or None while it
        compiles, for a request that asked at `since` (time.monotonic()). Raises ValueError
        if the spec cannot be compiled, if the compile has run past grammar_compile_timeout_s
        (then it is abandoned and its spec remembered as too slow), or if the request has
        waited that long, the wait for a compile thread included (then its compile is
        abandoned unless another request waits for it). Once it returns a grammar or raises,
        the request no longer waits for job."""
        key = params.key()
        limit = self.compile_timeout_s
        running_s = job.running_for(now)
        if running_s > limit:
            job.waiters -= 1
            if self._compiling.get(key) is job:
                self._remember_too_slow(key)
            raise ValueError(
                f"StructuredOutputsParams.{key[0]} did not compile within "
                f"grammar_compile_timeout_s={limit:g} s (abandoned after {running_s:.1f} s); "
                f"allowed: one that compiles within {limit:g} s")
        if job.finished.is_set():
            job.waiters -= 1
            if self._compiling.get(key) is job:
                self._keep(key, job)
            if job.error is not None:
                raise job.error
            return job.grammar
        # The compiler's one pass over the vocabulary, at the first grammar, is nobody's wait.
        ready = self.compiler_ready_at
        waited_s = 0.0 if ready is None else now - max(since, ready)
        if waited_s > limit:
            self.release(params, job)
            queued_s = max(0.0, waited_s - running_s)
            raise ValueError(
                f"StructuredOutputsParams.{key[0]} was not ready within "
                f"grammar_compile_timeout_s={limit:g} s of its request ({queued_s:.1f} s "
                f"waiting for a compile thread, {waited_s - queued_s:.1f} s compiling); "
                f"allowed: one that compiles within {limit:g} s, the wait for a compile "
                "thread included")
        return None

    def release(self, params: StructuredOutputsParams, job: GrammarCompile) -> None:
        """One request no longer waits for job (refused, or aborted). The last to go
        withdraws the compile if it is still queued; a running one cannot be interrupted:
        it runs on in its thread, and a request for the same spec meanwhile waits for it
        (_collect_abandoned keeps or forgets its result)."""
        job.waiters -= 1
        if job.waiters == 0 and self.compile_threads.withdraw(job):
            self._compiling.pop(params.key(), None)

    def _collect_abandoned(self, now: float) -> None:
        """The compiles no request waits for: those finished go to the cache (or are
        dropped, if they failed), those past the time limit are forgotten and their specs
        remembered as too slow. Abandoned compiles still running are at most
        NUM_COMPILE_THREADS, so this looks at a handful."""
        for key, job in list(self._compiling.items()):
            if job.waiters:
                continue
            if job.finished.is_set():
                self._keep(key, job)
            elif job.running_for(now) > self.compile_timeout_s:
                self._remember_too_slow(key)

    def _keep(self, key: GrammarKey, job: GrammarCompile) -> None:
        """Forget key's finished compile, and keep its grammar if it compiled."""
        del self._compiling[key]
        if job.error is None:
            self.cache.put(key, job.grammar)

    def _remember_too_slow(self, key: GrammarKey) -> None:
        """Forget key's compile (it runs on to its end, its result dropped) and refuse the
        spec at once when it is asked for again."""
        del self._compiling[key]
        self._too_slow[_digest(key)] = None
        if len(self._too_slow) > MAX_SLOW_GRAMMARS_KEPT:
            self._too_slow.popitem(last=False)

    def compiled_grammar(self, params: StructuredOutputsParams) -> Any:
        """The CompiledGrammar of params, waited for (from the cache, or compiled now in a
        compile thread). A bad schema, regex or grammar, or one past the time limit, raises
        ValueError naming the field."""
        since = time.monotonic()
        job = self.request(params)
        while True:
            grammar = self.outcome(params, job, since, time.monotonic())
            if grammar is not None:
                return grammar
            job.finished.wait(WAIT_POLL_S)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        """Compile params now (in a compile thread)."""
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
            raise refusal(f"StructuredOutputsParams.{kind}", spec,
                          f"one that compiles (this {kind} cannot be compiled: {reason})"
                          ) from None

    # ------------------------------------------------------------------ matchers
    def matcher_for(self, params: StructuredOutputsParams) -> Any:
        """A fresh GrammarMatcher (at the start of the output) for one sequence."""
        return new_matcher(self.compiled_grammar(params))

    def add_matcher(self, seq: Sequence) -> None:
        """seq's matcher, if its SamplingParams ask for structured outputs, its grammar
        waited for (a bad schema raises here, before the request is queued)."""
        params = seq.sampling_params.structured_outputs
        if params is not None:
            set_matcher(seq, self.compiled_grammar(params), self.step_budget)


class GrammarEngine(Protocol):
    """What manager_for reads of an EngineCore (engine/core.py, which imports this module)."""

    structured_outputs: StructuredOutputManager | None
    model_path: str
    vocab_size: int
    config: Config
    scheduler: Any  # its eos_token_ids: the engine's stop ids


def manager_for(core: GrammarEngine) -> StructuredOutputManager:
    """The engine's grammar compiler and cache (core.structured_outputs), made at the first
    request that asks for structured outputs (its compiler reads the tokenizer), then shared
    by all of them."""
    if core.structured_outputs is None:
        core.structured_outputs = StructuredOutputManager(
            core.model_path, core.vocab_size, sorted(core.scheduler.eos_token_ids),
            core.config.grammar_cache_bytes, core.config.grammar_compile_timeout_s,
            core.config.grammar_step_budget_ms / 1e3, core.config.grammar_step_budget_multiple)
    return core.structured_outputs


def _digest(key: GrammarKey) -> bytes:
    return hashlib.sha256(json.dumps(key).encode()).digest()


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
    token); the other rows, and rows without a grammar, allow every token (all bits set).

    Row by row, each timed, so that the step budget knows which rows cost the most
    (xgrammar's BatchGrammarMatcher fills rows in threads of its own, quicker for a large
    batch, but tells only what the whole batch took)."""
    rows = [i for i, (seq, sample) in enumerate(zip(seqs, samples, strict=True))
            if sample and seq.extras is not None and seq.extras.grammar_matcher is not None]
    if not rows:
        return None
    bitmask = torch.full((len(seqs), bitmask_width(vocab_size)), -1, dtype=torch.int32)
    matchers: list[TimedMatcher] = []
    for row in rows:
        seq = seqs[row]
        if seq.num_pending_tokens:
            # Its matcher has not seen the token in flight: the mask would be for the wrong
            # position (EngineCore.step reads such a step back before planning the next).
            raise RuntimeError(f"sequence {seq.seq_id} has a grammar and a token in flight: "
                               "its bitmask cannot be built yet")
        assert seq.extras is not None  # rows: those with a grammar
        matchers.append(seq.extras.grammar_matcher)
    budget = matchers[0].budget  # one engine's matchers share its step budget
    budget.begin_step(time.perf_counter())
    for row, matcher in zip(rows, matchers, strict=True):
        matcher.fill_next_token_bitmask(bitmask, row)
    budget.end_costliest(matchers)  # those over it sample their last token now
    return bitmask
