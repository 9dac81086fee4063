"""Structured outputs on the GPU (skipped without CUDA): the paths a CPU never takes.

Run on a GPU machine with `PYTHONPATH=src python3 -m pytest tests/gpu/test_gpu_structured_output.py -q`.

- a decode step with a constrained row leaves the decode graph's sampling (needs_full_sampler):
  the LM head and the Sampler run eagerly, its temperature-only rows through the Triton
  sampling kernels on logits masked to -inf, beside plain rows that keep no mask, whose
  tokens are those of the plain rows alone (CUDA graphs);
- async scheduling (on by default on a GPU) waits for a constrained row's token before the
  next step, and gives the tokens of the same run with it off;
- the bundled model (SmolLM2-135M, bf16) writes JSON for generated schemas that validates.

The first two share two engines of the tiny random Qwen3, built once for the file (async
scheduling on and off, a fixed KV cache, no prefix caching).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest
import torch
from helpers_models import random_prompts, tiny_checkpoint
from helpers_schemas import finished_on_eos, random_object_schema

from myvllm import LLM, SamplingParams
from myvllm.sampling_parameters import StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[bool, LLM]]:
    """{async_scheduling: a tiny Qwen3 engine with CUDA graphs} for both settings. No prefix
    caching: each run computes its prompts whole, as on a fresh engine, whatever ran before."""
    kw = dict(max_model_length=256, max_num_sequences=64, num_kvcache_blocks=1024,
              enable_prefix_caching=False)
    built = {mode: LLM(str(tiny_checkpoint("qwen3")), async_scheduling=mode, **kw)
             for mode in (True, False)}
    yield built
    for llm in built.values():
        llm.exit()


def test_gpu_constrained_batch_gives_valid_json_beside_plain_rows(
        engines: dict[bool, LLM]) -> None:
    rng = random.Random(0)
    schemas = [random_object_schema(rng) for _ in range(48)]
    constrained = [SamplingParams(temperature=1.0, max_tokens=200,
                                  structured_outputs=StructuredOutputsParams(
                                      json=s, disable_any_whitespace=True)) for s in schemas]
    plain = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 16
    prompts = random_prompts([rng.randint(1, 30) for _ in range(64)], seed=1)
    # The plain rows alone: decode steps that replay the graphs, sampling in them.
    alone = engines[True].generate(prompts[48:], plain, use_tqdm=False)
    for async_scheduling in (True, False):
        outs = engines[async_scheduling].generate(prompts, constrained + plain, use_tqdm=False)
        for schema, out in zip(schemas, outs):
            assert finished_on_eos(out), (schema, out["text"])
            jsonschema.validate(json.loads(out["text"]), schema)
        # The plain rows shared eager steps with the constrained ones: the same tokens.
        assert [o["token_ids"] for o in outs[48:]] == [o["token_ids"] for o in alone]


def test_gpu_greedy_constrained_tokens_do_not_depend_on_async_scheduling(
        engines: dict[bool, LLM]) -> None:
    rng = random.Random(2)
    params = [SamplingParams(temperature=0.0, max_tokens=200,
                             structured_outputs=StructuredOutputsParams(
                                 json=random_object_schema(rng), disable_any_whitespace=True))
              for _ in range(16)]
    prompts = random_prompts([rng.randint(1, 30) for _ in params], seed=2)
    runs = [engines[a].generate(prompts, params, use_tqdm=False) for a in (False, True)]
    assert [o["token_ids"] for o in runs[0]] == [o["token_ids"] for o in runs[1]]


def test_gpu_bundled_model_writes_json_that_validates() -> None:
    rng = random.Random(3)
    schemas = [random_object_schema(rng) for _ in range(32)]
    llm = LLM(max_model_length=1024, num_kvcache_blocks=2048)  # the bundled SmolLM2 GGUF
    tokenizer = llm.tokenizer
    prompts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": "Reply with a JSON object that follows this schema: "
          + json.dumps(s)}], tokenize=False, add_generation_prompt=True) for s in schemas]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=400,
                             structured_outputs=StructuredOutputsParams(json=s))
              for i, s in enumerate(schemas)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    finished = 0
    for schema, out in zip(schemas, outs):
        if len(out["token_ids"]) < 400:
            finished += 1
            jsonschema.validate(json.loads(out["text"]), schema)
    assert finished >= len(schemas) * 3 // 4, finished
