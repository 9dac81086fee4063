"""myvllm: a teaching-grade LLM inference engine.

    from myvllm import LLM, SamplingParams, Config
    llm = LLM(Config(model="Qwen/Qwen3-0.6B"))
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
"""

from __future__ import annotations

import logging as _logging
from typing import TYPE_CHECKING

from myvllm.config import Config
from myvllm.sampling_parameters import SamplingParams

if TYPE_CHECKING:
    from myvllm.engine.llm_engine import LLMEngine

    LLM = LLMEngine


def __getattr__(name: str) -> type[LLMEngine]:
    """LLM / LLMEngine are imported on first use: they pull in torch (seconds to import), and
    the scripts import myvllm.demo or the scheduler to answer --help or trace without it."""
    if name in ("LLM", "LLMEngine"):
        from myvllm.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'myvllm' has no attribute {name!r}")


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
