"""myvllm: a teaching-grade LLM inference engine.

    from myvllm import LLM, SamplingParams, Config
    llm = LLM(Config(model="Qwen/Qwen3-0.6B"))
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
"""

import logging as _logging

from myvllm.config import Config
from myvllm.engine.llm_engine import LLMEngine
from myvllm.sampling_parameters import SamplingParams

LLM = LLMEngine

# A library logger with its own stderr handler (as vLLM does), so start-up notes such as
# "no GPU, decoding runs eagerly" are visible without configuring logging first.
_logger = _logging.getLogger("myvllm")
if not _logger.handlers:
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("[myvllm] %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(_logging.INFO)
    _logger.propagate = False

__all__ = ["LLM", "LLMEngine", "SamplingParams", "Config"]
