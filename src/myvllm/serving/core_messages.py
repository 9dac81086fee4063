"""What crosses the socket between the front end (AsyncLLM) and the engine core process.

    front end  --- AddRequest | AbortRequests | AbortCompletion | Shutdown -->  core process
                                                                        (input socket)
    front end  <-- CoreOutputs | CoreDead | Heartbeat -------  core process    (output socket)

Token ids only (and their logprobs, for a request that asks): the front end tokenizes,
applies the chat template, detokenizes and matches stop strings; the core never sees text.
One CoreOutputs message per engine step carries the new tokens of every request that got
some, so the traffic grows with the steps, not with the tokens (256 streams decoding: one
message of ~3 KB per step, not 256 messages).

Encoding: MessagePack through msgspec. Each message is a typed Struct, encoded as a short
array (array_like: no field names on the wire) with a tag first that says which kind it is;
decoding checks every field's type, so a malformed message is an error, never a guess.
"""

from __future__ import annotations

import msgspec

from myvllm.sample.extras import LogprobsLists
from myvllm.sampling_parameters import SamplingParams


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: int  # the front end's id for it; every output names it
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    streamed: bool  # someone reads its tokens as they come (Sequence.streamed)


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[int]  # unknown or finished ids are ignored


class AbortCompletion(msgspec.Struct, tag="abort_one", array_like=True):
    """Abort one completion of a request of SamplingParams.n > 1 (a stop string ended it);
    the others go on."""

    request_id: int
    index: int


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Abort everything, stop the workers, exit 0."""


CoreInput = AddRequest | AbortRequests | AbortCompletion | Shutdown


class CoreOutput(msgspec.Struct, array_like=True):
    """What one step did for one request."""

    request_id: int
    new_token_ids: list[int]
    # None while it runs; "stop", "length", "abort" or "grammar_too_slow"
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens whose K/V came from the prefix cache
    # Only for a request that asked (SamplingParams.logprobs / prompt_logprobs), else None
    # (one byte each on the wire): as RequestOutput's, but prompt_logprobs only with the
    # first completion's (index 0) first output, once for all n completions.
    logprobs: LogprobsLists | None = None
    prompt_logprobs: LogprobsLists | None = None
    index: int = 0  # which completion of the request (SamplingParams.n > 1)


class Refusal(msgspec.Struct, array_like=True):
    """A request the core refused before queuing it (bad input: the client's error)."""

    request_id: int
    error_type: str  # "ValueError" or "TypeError"
    message: str


class SpecDecodeCounts(msgspec.Struct, array_like=True):
    """Speculative decoding since the core started (spec_decode/stats.py)."""

    num_drafts: int  # verification rows
    num_draft_tokens: int  # tokens proposed
    num_accepted_tokens: int  # of those, accepted
    accepted_per_position: list[int]  # accepted at proposal position 0, 1, ...


class SchedulerStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of the blocks held by requests
    spec_decode: SpecDecodeCounts | None = None  # with speculative decoding only


class CoreOutputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[CoreOutput]
    refused: list[Refusal]
    stats: SchedulerStats


class CoreDead(msgspec.Struct, tag="dead", array_like=True):
    """The engine loop failed (the core process exits after sending this)."""

    message: str


class Heartbeat(msgspec.Struct, tag="beat", array_like=True):
    """The core process is alive (sent from a thread of its own every second, whatever the
    busy loop does): its silence tells the front end the process hangs."""

    step_s: float  # how long the step in progress has run; 0.0 between steps


CoreMessage = CoreOutputs | CoreDead | Heartbeat
