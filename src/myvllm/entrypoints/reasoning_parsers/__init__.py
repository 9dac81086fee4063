"""Reasoning parsers: the model's thinking split from its answer, by vLLM's names
(`myvllm serve --reasoning-parser NAME`):

    qwen3   Qwen3's <think>...</think>: the thinking -> message.reasoning_content (streamed:
            delta.reasoning_content), the rest -> content
"""

from myvllm.entrypoints.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParser, ReasoningParserManager, ReasoningStream, SplitOutput)
from myvllm.entrypoints.reasoning_parsers.qwen3_reasoning_parser import Qwen3ReasoningParser

__all__ = ["Qwen3ReasoningParser", "ReasoningParser", "ReasoningParserManager",
           "ReasoningStream", "SplitOutput"]
