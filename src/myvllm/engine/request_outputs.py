"""One step's RequestOutputs (EngineCore.step): per sequence that got tokens, its new tokens,
its logprobs if it asked (sample/logprobs.py), and for n > 1 whether its whole request has
finished (sample/forks.py)."""

from __future__ import annotations

from myvllm.engine.batch import RequestOutput
from myvllm.serving.core_messages import LogprobsLists
from myvllm.sample.logprobs import take_prompt_logprobs
from myvllm.engine.sequence import Sequence


def request_outputs(seqs: list[Sequence], num_known: list[int],
                    logprobs: list[LogprobsLists | None], requests: dict[int, list[Sequence]]
                    ) -> list[RequestOutput]:
    """seqs: the step's sequences that got tokens, after postprocess; num_known: how many
    tokens each had before; logprobs: each one's, if it asked; requests: the engine's
    unfinished requests (each one's sequences), from which one that finishes here is removed.
    """
    outputs = []
    for seq, known, seq_logprobs in zip(seqs, num_known, logprobs, strict=True):
        new_token_ids = seq.token_ids[known:]
        if not new_token_ids:  # a surplus token of a sequence that had finished
            continue
        outputs.append(RequestOutput(
            request_id=seq.request_id, new_token_ids=new_token_ids,
            token_ids=seq.completion_token_ids, finished=seq.is_finished,
            finish_reason=seq.finish_reason, num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_prompt_tokens or 0,
            logprobs=seq_logprobs,
            prompt_logprobs=take_prompt_logprobs(seq, requests.get(seq.request_id, [])),
            index=seq.index))
    # A request ends with the last output of its last completion to finish.
    for out in reversed(outputs):
        completions = requests.get(out.request_id)
        if (out.finished and completions is not None
                and all(s.is_finished for s in completions)):
            del requests[out.request_id]
            out.request_finished = True
    return outputs
