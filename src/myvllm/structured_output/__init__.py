"""Structured outputs (the guide's Features, "Constrained decoding"): a grammar per request, a
matcher per sequence, a token bitmask per step (xgrammar). manager.py's
StructuredOutputManager is made by the EngineCore at the first request that asks for a
grammar; until then it is None and no request pays for it.
"""
