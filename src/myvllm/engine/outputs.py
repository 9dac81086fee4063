"""What steps hand back: the core's RequestOutputs, and the dicts LLMEngine.step() and
generate() build from them (and generate()'s progress bar); a request that asked for logprobs
or n > 1 completions has its dict gathered by sample/finished_outputs.py.

request_outputs (EngineCore.step): per sequence that got tokens in a step, its new tokens,
its logprobs if it asked (sample/logprobs.py), and for n > 1 whether its whole request has
finished (sample/forks.py).

A finished request's dict has seq_id, token_ids (completion only), finish_reason,
num_cached_tokens, logprobs (one {token id: logprob} per completion token, the token's own and
its top alternatives) and prompt_logprobs (None for the first prompt token, then one such dict
each), both None unless the request's SamplingParams asked for them. A request of n > 1
completions is output once all have finished, with those of completion 0 and "outputs": per
completion, in order, its index, token_ids, finish_reason and logprobs (vLLM's
RequestOutput.outputs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from myvllm.engine.batch import RequestOutput
from myvllm.engine.sequence import Sequence
from myvllm.sample.logprobs import take_prompt_logprobs
from myvllm.sample.extras import LogprobsLists
from myvllm.sample.sampling_controls import text_token_ids


def request_outputs(seqs: list[Sequence], num_known: list[int],
                    logprobs: list[LogprobsLists | None] | None,
                    requests: dict[int, list[Sequence]]) -> list[RequestOutput]:
    """seqs: the step's sequences that got tokens, after postprocess; num_known: how many
    tokens each had before; logprobs: each one's, if it asked (None: no row asked, or the
    step's logprobs came with no row); requests: the engine's
    unfinished requests (each one's sequences), from which one that finishes here is removed.
    """
    outputs = []
    for i, (seq, known) in enumerate(zip(seqs, num_known, strict=True)):
        new_token_ids = seq.token_ids[known:]
        if not new_token_ids:  # a surplus token of a sequence that had finished
            continue
        outputs.append(RequestOutput(
            request_id=seq.request_id, new_token_ids=new_token_ids,
            token_ids=seq.completion_token_ids, finished=seq.is_finished,
            finish_reason=seq.finish_reason, num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_prompt_tokens or 0,
            logprobs=None if logprobs is None else logprobs[i],
            prompt_logprobs=(None if seq.extras is None  # asked for no prompt logprobs
                             else take_prompt_logprobs(seq, requests.get(seq.request_id, []))),
            index=seq.index))
    # A request ends with the last output of its last completion to finish.
    for out in reversed(outputs):
        completions = requests.get(out.request_id)
        if (out.finished and completions is not None
                and all(s.is_finished for s in completions)):
            del requests[out.request_id]
            out.request_finished = True
    return outputs


def finished_dict(out: RequestOutput) -> dict[str, Any]:
    """The dict of a request that finished in out, of one completion, asking for no logprobs
    (sample/finished_outputs.py gathers the others')."""
    return {"seq_id": out.request_id, "token_ids": out.token_ids,
            "finish_reason": out.finish_reason, "num_cached_tokens": out.num_cached_tokens,
            "logprobs": None, "prompt_logprobs": None}


class GenerateProgress:
    """generate()'s progress bar: prompts finished, and the last prefill and decode step's
    tokens per second (a step's sign tells them apart)."""

    def __init__(self, num_prompts: int, enabled: bool) -> None:
        self.bar = tqdm(total=num_prompts, desc="Generating", dynamic_ncols=True,
                        disable=not enabled)
        self.prefill_tps = self.decode_tps = 0.0

    def step(self, num_finished: int, num_tokens: int, elapsed: float) -> None:
        if num_tokens > 0:
            self.prefill_tps = num_tokens / elapsed
        else:
            self.decode_tps = -num_tokens / elapsed
        self.bar.set_postfix(prefill=f"{self.prefill_tps:.0f}tok/s",
                             decode=f"{self.decode_tps:.0f}tok/s")
        self.bar.update(num_finished)

    def close(self) -> None:
        self.bar.close()


def generate_result(out: dict[str, Any], stop_token_ids: list[int] | None,
                    decode: Callable[[list[int]], str | None]) -> dict[str, Any]:
    """One prompt's dict of generate(); n > 1 adds "outputs": per completion, its index,
    text, token_ids, finish_reason and logprobs ("text" and "token_ids" above them are
    completion 0's)."""
    def text(token_ids: list[int], finish_reason: str | None) -> str | None:
        # A request's own stop token ends its tokens, not its text (sample/sampling_controls.py).
        return decode(token_ids if stop_token_ids is None
                      else text_token_ids(token_ids, finish_reason, stop_token_ids))

    result = {
        "text": text(out["token_ids"], out["finish_reason"]),
        "token_ids": out["token_ids"],
        "num_cached_tokens": out["num_cached_tokens"],
        "logprobs": out["logprobs"],
        "prompt_logprobs": out["prompt_logprobs"],
    }
    if "outputs" in out:
        result["outputs"] = [
            {"index": c["index"], "text": text(c["token_ids"], c["finish_reason"]),
             "token_ids": c["token_ids"], "finish_reason": c["finish_reason"],
             "logprobs": c["logprobs"]}
            for c in out["outputs"]]
    return result

