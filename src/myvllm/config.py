"""Config: the one place where every engine setting is named.

Every module reads its settings as attributes of one ``Config`` object (``config.block_size``),
never from a string-keyed dict. A typo in a dict key (``config["max_num_seqs"]``) fails only
when that line finally runs, and behind ``.get(key, default)`` it never fails: the default
stands in unseen and can switch off a whole code path. A typo in an attribute name fails at
once, and a typo in a *keyword* given to ``Config`` is caught here, with the closest valid name
in the message:

    >>> Config(max_num_seqs=8)
    ConfigError: Config has no field 'max_num_seqs'; did you mean 'max_num_sequences'? ...

Values are checked in ``__post_init__`` so a bad setting fails before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from myvllm.value_checks import is_int, is_real, one_of, refusal

DTYPES = ("auto", "float16", "bfloat16", "float32")
DEVICES = ("auto", "cuda", "cpu")
LOAD_FORMATS = ("auto", "dummy")
SPECULATIVE_METHODS = ("ngram", "draft")
KV_CACHE_DTYPES = ("auto", "fp8")
MODEL_ALLOWED = "a str (a hub id, a checkpoint folder or a .gguf file), or None"


class ConfigError(TypeError, ValueError):
    """An unknown Config field.

    It is a TypeError because that is what Python raises for an unexpected keyword argument
    (so ``except TypeError`` around ``Config(**kwargs)`` keeps working), and a ValueError
    because a bad key in a dict (``Config.from_dict``) is a bad value.
    """


@dataclass
class Config:
    model: str | None = None
    """Hub id, local checkpoint folder, or ``.gguf`` file; None picks the bundled default model.
    It decides the architecture and, unless load_format is "dummy", the weights."""

    max_num_sequences: int = 256
    """Most sequences alive (running) at once. Bounds every batch, and is the largest batch size
    a decode CUDA graph is captured for. One name, read by the scheduler and the runner alike."""

    max_num_batched_tokens: int = 32768
    """Most tokens one step computes: with chunked prefill, decode rows and prompt chunks
    together (a longer prompt runs over several steps); prefill-first, the prompt tokens of
    one prefill step. Bounds a step's activation memory, so the runner's warm-up uses the same
    number to measure peak memory before sizing the KV cache."""

    max_model_length: int | None = None
    """Longest sequence (prompt + completion). A request whose prompt + max_tokens is longer
    is refused, by LLM and the server alike. Also sizes the block tables of the decode CUDA
    graphs. None = the checkpoint's max_position_embeddings, lowered to what the KV cache can
    hold (a log line says so); a larger number is lowered to max_position_embeddings."""

    block_size: int = 16
    """Tokens per KV-cache block (the 'page' of PagedAttention). Small blocks waste less memory
    at the end of each sequence and share prefixes at a finer grain; large blocks mean shorter
    block tables. Only full blocks can be shared by prefix caching."""

    num_kvcache_blocks: int = -1
    """Blocks in the KV cache; -1 = as many as fit in gpu_memory_utilization after the model
    and a warm-up. The engine keeps your Config as given; llm.config holds the number chosen."""

    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU memory the engine may use in total (weights + activations + KV cache)
    when num_kvcache_blocks is -1."""

    tensor_parallel_size: int = 1
    """GPUs (processes) one model is split over. Must divide the number of attention heads."""

    data_parallel_size: int = 1
    """Replicas of the whole engine behind one server (`myvllm serve`): each its own engine
    core process on its own tensor_parallel_size GPUs (replica r on GPUs r*tp .. r*tp+tp-1; on
    a CPU all share it), and the front end sends each request to one of them, by prompt prefix
    so that prefix-cache hits stay on one replica, else to the least loaded. 1 = one engine
    core. LLM (offline) and `myvllm chat` run one engine: they refuse more."""

    enforce_eager: bool = False
    """True = never capture/replay CUDA graphs (slower decode, easier debugging). CPU runs are
    always eager."""

    dtype: str = "auto"
    """Weight/activation dtype: "auto" (bfloat16 on CUDA, float32 on CPU), "float16", "bfloat16"
    or "float32"."""

    device: str = "auto"
    """"auto" (CUDA when available, else CPU), "cuda" or "cpu"."""

    cpu_threads: int = 0
    """torch's threads for an engine on the CPU, in each of its processes (tensor-parallel
    ranks share them out). 0 = the engine's choice (worker/cpu_threads.py says how it was
    measured): one thread for a small model, every core for a larger one. No effect on a GPU."""

    kv_cache_dtype: str = "auto"
    """The KV cache's element type (vLLM's name): "auto" = the model's dtype; "fp8" = float8
    e4m3 (torch.float8_e4m3fn), one byte per element: twice the blocks in the same memory and
    half the bytes decode reads. K and V are divided by a per-layer scale (1.0, as vLLM without
    checkpoint scales) and rounded when stored, multiplied back when attention loads them."""

    load_format: str = "auto"
    """"auto": read the weights from the checkpoint (safetensors or GGUF). "dummy": build the
    model from its config alone, with small random weights and no checkpoint read (vLLM's
    name), to measure speed on a large shape; then model may be a folder holding only
    config.json (with no tokenizer, prompts must be token ids)."""

    eos: int | tuple[int, ...] | None = None
    """End-of-sequence token id(s). None = read them from the checkpoint's tokenizer/generation
    config; -1 = no eos (generate until max_tokens / max_model_length)."""

    enable_prefix_caching: bool = True
    """Reuse the K/V of full blocks whose tokens (and whole prefix) match an earlier or
    concurrent request. False = every prompt is computed from scratch."""

    enable_chunked_prefill: bool = True
    """Schedule by a token budget: every running sequence's decode token first, then chunks of
    prompts fill what is left of max_num_batched_tokens, so a long prompt runs over several
    steps beside the decoding ones instead of stalling them, and any prompt up to
    max_model_length runs. False = prefill-first: a step is either whole prompts or decodes."""

    max_prefill_tokens_while_decoding: int = 768
    """With chunked prefill, the most prompt tokens one step computes while streamed sequences
    (add_request, the server's streaming requests) decode in it. That step's time is the gap
    between two tokens of every decoding stream, so a prompt that arrives while others stream
    goes in small chunks; a prompt with no stream decoding beside it takes all of
    max_num_batched_tokens. The sequences of LLM.generate() and the server's requests with
    stream false are no streams: their outputs come at the end, where only the total time
    counts. 0 = no limit of its own. 768 was chosen from a serving sweep on an H200 (256
    streamed requests at once: more throughput and a shorter p99 time to first token than
    512, with the decode stall still within 4x; 1,024 went past it)."""

    disable_custom_all_reduce: bool = True
    """Tensor parallelism on GPUs (vLLM's name): False = the small all-reduces (a decode
    step's, up to a size measured against NCCL) run torch's symmetric-memory kernel, the
    larger ones NCCL, where the GPUs can map each other's memory (one host; else NCCL for all,
    and a log line says why); True = NCCL for every all-reduce. True by default until it has
    run on two GPUs: its kernels wait for their peers with no timeout, so a worker that dies
    mid-step might leave rank 0 waiting for good (docs/reliability.md). No effect on a CPU
    (gloo) or with one rank."""

    async_scheduling: bool | None = None
    """Plan step N+1 on the host while the device runs step N (vLLM's name). None = on where
    it is measured to pay, on GPUs (one or several); True also on a CPU (for tests).
    Under tensor parallelism rank 0 broadcasts each step's sampled tokens to the other ranks
    on the device, where the next step reads them. Greedy and seeded tokens are the same
    either way."""

    batch_invariant: bool = False
    """True = every kernel reduces in an order that does not depend on the batch: a request's
    tokens and logprobs are the same bits alone, in any batch, with a prefix-cache hit or in
    chunks (at a given tensor_parallel_size; kernels/batch_invariant.py). For reproducible
    runs and RL rollouts (vLLM's VLLM_BATCH_INVARIANT); costs throughput (docs/reliability.md
    has the numbers). Mixture-of-experts models are refused."""

    speculative_method: str | None = None
    """Speculative decoding (vLLM's name): None = off; "ngram" = prompt lookup, the next
    tokens proposed by finding the sequence's last few tokens earlier in it and copying what
    followed; "draft" = a second, small model with the target's vocabulary proposes them
    (speculative_model; one GPU only, its steps eager). Each decode row then computes its last
    token and the proposals in one forward pass, and rejection sampling keeps the tokens the
    target model would have drawn itself (spec_decode/). With async scheduling, a step whose
    rows verify proposals, or are about to look up the next ones, is read back before the next
    step is planned (the proposals need the sequence's tokens on the host); other steps
    overlap as usual."""

    num_speculative_tokens: int = 3
    """Tokens proposed per decode row and step (k): each step of a row computes k + 1
    positions and emits 1 to k + 1 tokens. Read only with speculative_method."""

    prompt_lookup_min: int = 2
    """n-gram speculation: the shortest suffix of the sequence that is looked up earlier in
    it (shorter matches are more often wrong)."""

    prompt_lookup_max: int = 4
    """n-gram speculation: the longest suffix looked up; the longest that matches wins."""

    speculative_model: str | None = None
    """speculative_method "draft": the draft model (a checkpoint or .gguf with the target's
    vocabulary; another vocabulary size is refused at start-up). It runs in the same engine
    with a KV cache of its own, a block for each of the target's."""

    grammar_compile_timeout_s: float = 5.0
    """Structured outputs: the most seconds a request may wait for its grammar, the wait for a
    compile thread included. Grammars compile in two threads of their own, off the step
    loop, while their requests wait outside the scheduler; a request whose grammar is not
    ready after this long is refused (a 400 through the server). A compile that has itself
    run this long is abandoned (it cannot be interrupted: it ends in its thread, its result
    dropped) and the same grammar asked for again is refused at once. A JSON schema of a few
    dozen fields compiles in well under a second."""

    grammar_step_budget_ms: float = 20.0
    """Structured outputs: the grammar work (CPU milliseconds) one step may always take,
    across its constrained rows: their matchers' bitmask rows and accepted tokens. The limit
    is the larger of this and grammar_step_budget_multiple times the step without it; a step
    over its limit ends its costliest rows with finish_reason "grammar_too_slow" until the
    others fit, so that no grammar holds every other row's step: an ambiguous grammar
    (`s ::= s s | "a" | ""`) costs more with each token (75 ms a token after 375 of them),
    where a JSON schema's matcher takes well under a millisecond."""

    grammar_step_budget_multiple: float = 2.0
    """Structured outputs: a step's grammar work may take this many times the engine's step
    without it (measured: its recent steps' shortest), or grammar_step_budget_ms if that is
    more; so a step with constrained rows takes at most 1 + this times one without.
    0 = grammar_step_budget_ms alone."""

    grammar_cache_bytes: int = 256 * 2**20
    """Structured outputs: the memory the compiled grammars kept for reuse may take (xgrammar's
    own count of each one's bytes); the least recently used go first. A grammar asked for
    again while it is kept is not compiled again. 0 = keep none."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Config:
        # The dataclass writes __init__; Python calls __new__ with the same arguments first,
        # so an unknown keyword gets the closest valid name here instead of Python's bare
        # "unexpected keyword argument" from __init__.
        _check_field_names(kwargs.keys())
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if self.model is not None:
            if not isinstance(self.model, (str, os.PathLike)):
                raise refusal("Config.model", self.model, MODEL_ALLOWED)
            self.model = os.fspath(self.model)
        _check_int("max_num_sequences", self.max_num_sequences, minimum=1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        if self.max_model_length is not None:
            _check_int("max_model_length", self.max_model_length, minimum=1)
        _check_int("block_size", self.block_size, minimum=1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        _check_int("data_parallel_size", self.data_parallel_size, minimum=1)
        _check_int("cpu_threads", self.cpu_threads, minimum=0)
        if not (is_int(self.num_kvcache_blocks)
                and (self.num_kvcache_blocks == -1 or self.num_kvcache_blocks >= 1)):
            raise refusal("Config.num_kvcache_blocks", self.num_kvcache_blocks,
                          "-1 (size from memory) or an int >= 1")
        g = self.gpu_memory_utilization
        if not (is_real(g) and math.isfinite(g) and 0.0 < g <= 1.0):
            raise refusal("Config.gpu_memory_utilization", g, "a number in (0, 1]")
        _check_bool("enforce_eager", self.enforce_eager)
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        _check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        _check_int("max_prefill_tokens_while_decoding", self.max_prefill_tokens_while_decoding,
                   minimum=0)
        _check_bool("batch_invariant", self.batch_invariant)
        _check_bool("disable_custom_all_reduce", self.disable_custom_all_reduce)
        if self.async_scheduling is not None:
            _check_bool("async_scheduling", self.async_scheduling)
        if self.load_format not in LOAD_FORMATS:
            raise refusal("Config.load_format", self.load_format, one_of(LOAD_FORMATS))
        if self.dtype not in DTYPES:
            raise refusal("Config.dtype", self.dtype, one_of(DTYPES))
        if self.device not in DEVICES:
            raise refusal("Config.device", self.device, one_of(DEVICES))
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise refusal("Config.kv_cache_dtype", self.kv_cache_dtype, one_of(KV_CACHE_DTYPES))
        if self.batch_invariant and self.kv_cache_dtype == "fp8":
            # A prompt's first prefill attends to its own K/V unrounded, a cache hit or a
            # later chunk to the fp8 copies: the same row would see different numbers.
            raise ValueError("Config.batch_invariant=True does not combine with "
                             "Config.kv_cache_dtype='fp8' (a prompt computed in one go reads "
                             "its own keys unrounded, a cached prefix reads them as fp8); "
                             "allowed with it: Config.kv_cache_dtype='auto'")
        t = self.grammar_compile_timeout_s
        if not (is_real(t) and math.isfinite(t) and t > 0):
            raise refusal("Config.grammar_compile_timeout_s", t, "a number of seconds > 0")
        _check_int("grammar_cache_bytes", self.grammar_cache_bytes, minimum=0)
        b = self.grammar_step_budget_ms
        if not (is_real(b) and math.isfinite(b) and b > 0):
            raise refusal("Config.grammar_step_budget_ms", b, "a number of milliseconds > 0")
        m = self.grammar_step_budget_multiple
        if not (is_real(m) and math.isfinite(m) and m >= 0):
            raise refusal("Config.grammar_step_budget_multiple", m, "a number >= 0")
        self.eos = _normalize_eos(self.eos)
        _check_speculative(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Config:
        """Build a Config from a mapping (e.g. parsed JSON); unknown keys raise ConfigError."""
        if not isinstance(d, Mapping):
            raise TypeError(f"Config.from_dict was given a {type(d).__name__}; allowed: a "
                            "mapping of field names to values")
        _check_field_names(d.keys())
        return cls(**d)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


# --------------------------------------------------------------------------- unknown keys
def _check_field_names(names: Iterable[object]) -> None:
    valid = Config.field_names()
    for name in names:
        if name in valid:
            continue
        if not isinstance(name, str):
            raise ConfigError(f"Config field name {name!r} is not a str; allowed: "
                              f"{', '.join(valid)}")
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(f"Config has no field '{name}'; {hint}allowed: {', '.join(valid)}")


# --------------------------------------------------------------------------- value checks
def _check_int(name: str, value: object, minimum: int) -> None:
    if not (is_int(value) and value >= minimum):
        raise refusal(f"Config.{name}", value, f"an int >= {minimum}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise refusal(f"Config.{name}", value, "True or False")


def _check_speculative(config: Config) -> None:
    method = config.speculative_method
    if method is not None and method not in SPECULATIVE_METHODS:
        raise refusal("Config.speculative_method", method,
                      f"None, {one_of(SPECULATIVE_METHODS)}")
    _check_int("num_speculative_tokens", config.num_speculative_tokens, minimum=1)
    _check_int("prompt_lookup_min", config.prompt_lookup_min, minimum=1)
    _check_int("prompt_lookup_max", config.prompt_lookup_max, minimum=1)
    if config.prompt_lookup_min > config.prompt_lookup_max:
        raise ValueError(f"Config.prompt_lookup_min={config.prompt_lookup_min} is more than "
                         f"Config.prompt_lookup_max={config.prompt_lookup_max}; allowed: "
                         "Config.prompt_lookup_min <= Config.prompt_lookup_max")
    model = config.speculative_model
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise refusal("Config.speculative_model", model, MODEL_ALLOWED)
    if method == "draft":
        if model is None:
            raise ValueError("Config.speculative_method='draft' needs Config.speculative_model, "
                             "the draft model (given None); allowed: a checkpoint folder or "
                             ".gguf file with the target's vocabulary")
        if config.tensor_parallel_size > 1:
            # The draft runs unsharded beside rank 0's runner, and its layers would shard
            # themselves over the target's process group.
            raise ValueError("Config.speculative_method='draft' runs on one GPU: it does not "
                             "combine with Config.tensor_parallel_size="
                             f"{config.tensor_parallel_size}; allowed: "
                             "Config.tensor_parallel_size=1, or Config.speculative_method='ngram'")
    elif model is not None:
        raise ValueError(f"Config.speculative_model={model!r} is only read with "
                         f"Config.speculative_method='draft', given {method!r}; allowed: "
                         "Config.speculative_method='draft', or Config.speculative_model=None")


def _normalize_eos(eos: object) -> int | tuple[int, ...] | None:
    if eos is None:
        return None
    if is_int(eos):
        if eos == -1 or eos >= 0:
            return eos
    elif isinstance(eos, (tuple, list)) and eos and all(is_int(t) and t >= 0 for t in eos):
        return tuple(eos)  # a JSON list becomes the tuple the rest of the code expects
    raise refusal("Config.eos", eos, "None (from the checkpoint), -1 (no eos), a token id "
                  ">= 0, or a non-empty tuple of token ids >= 0")


def stop_token_ids(eos: int | tuple[int, ...] | None) -> frozenset[int]:
    """The token ids a sequence stops on, from a normalised Config.eos (-1 or None: none)."""
    if eos is None or eos == -1:
        return frozenset()
    return frozenset((eos,)) if isinstance(eos, int) else frozenset(eos)


def resolved_max_model_length(config: Config, part: str) -> int:
    """config.max_model_length, for a part of the engine that needs it (the Scheduler, the
    InputBuilder): the engine sets it from the checkpoint when it is None, before it builds
    its parts."""
    if config.max_model_length is None:
        raise refusal(f"{part}: config.max_model_length", None, "an integer >= 1, which the "
                      f"engine sets from the checkpoint when it is None, before it builds {part}")
    return config.max_model_length


def sized_num_kvcache_blocks(config: Config, part: str) -> int:
    """config.num_kvcache_blocks, for a part of the engine built after the KV cache is sized
    (the Scheduler): -1 asks the ModelRunner to size it from memory, which it does first."""
    if config.num_kvcache_blocks < 1:
        raise refusal(f"{part}: config.num_kvcache_blocks", config.num_kvcache_blocks,
                      "an integer >= 1, which the ModelRunner sets when it sizes the KV cache "
                      f"(-1: from memory), before {part} is built")
    return config.num_kvcache_blocks
