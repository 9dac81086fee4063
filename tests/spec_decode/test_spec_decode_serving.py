"""Speculative decoding behind the server's client (AsyncLLM: the engine core in a child
process, as under `myvllm serve`): streamed tokens equal the in-process engine's, a stop
string cuts the text where it would without speculation, and /metrics counts the proposals
(prompt lookup's and a draft model's).

Slow: it starts an engine core process and an in-process engine (tens of seconds here).
"""

from __future__ import annotations

import asyncio

import pytest
from helpers_models import tiny_checkpoint

from myvllm import LLM, Config, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8, 9, 10, 11] * 5
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_async_llm_streams_verified_tokens_and_counts_them(method: str) -> None:
    from myvllm.serving.async_llm import AsyncLLM
    from myvllm.entrypoints.metrics import PrometheusStatLogger

    path = str(tiny_checkpoint("qwen3"))
    settings = dict(model=path, max_model_length=128, num_kvcache_blocks=64)
    expected = LLM(**settings).generate([PROMPT], PARAMS, use_tqdm=False)[0]["token_ids"]
    stat_logger = PrometheusStatLogger("tiny")
    # "draft": the target as its own draft model, in the core process beside it.
    spec = dict(speculative_method=method,
                speculative_model=path if method == "draft" else None)
    llm = AsyncLLM(Config(**settings, **spec), stat_logger=stat_logger)

    async def stream(prompt: str | list[int], stop: tuple[str, ...] = ()) -> tuple[list[int], str]:
        token_ids, text = [], ""
        async for out in llm.generate(prompt, PARAMS, stop=stop):
            token_ids += out.token_ids
            text += out.text or ""
        return token_ids, text

    async def run_all() -> None:
        token_ids, text = await stream(PROMPT)
        assert token_ids == expected
        # A stop string inside a verification step's tokens: the text ends before it.
        stop = text[3:5]
        _, cut = await stream(PROMPT, stop=(stop,))
        assert cut == text[:text.index(stop)]

    try:
        asyncio.run(run_all())  # one loop: AsyncLLM is bound to the loop it first ran in
        rendered = stat_logger.render().decode()
    finally:
        llm.shutdown()
    samples = {line.split("{")[0]: float(line.split()[-1]) for line in rendered.splitlines()
               if line.startswith("myvllm:spec_decode")}
    assert samples["myvllm:spec_decode_num_drafts_total"] > 0
    assert (0 < samples["myvllm:spec_decode_num_accepted_tokens_total"]
            <= samples["myvllm:spec_decode_num_draft_tokens_total"])
    assert "myvllm:spec_decode_num_accepted_tokens_per_pos_total" in samples
