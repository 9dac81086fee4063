"""Config: unknown keys are caught with a hint, bad values name their field."""

import dataclasses
import re

import pytest

from myvllm.config import Config, ConfigError


def test_defaults_match_the_contract() -> None:
    c = Config()
    assert (c.model, c.max_num_sequences, c.max_num_batched_tokens, c.max_model_length) == (
        None, 256, 32768, None)
    assert (c.block_size, c.num_kvcache_blocks, c.gpu_memory_utilization) == (16, -1, 0.9)
    assert (c.tensor_parallel_size, c.enforce_eager) == (1, False)
    assert (c.dtype, c.device) == ("auto", "auto")
    assert c.eos is None and c.enable_prefix_caching is True and c.enable_chunked_prefill is True


def test_unknown_keyword_names_key_and_closest_field() -> None:
    with pytest.raises(ConfigError, match=r"'max_num_seqs'.*did you mean 'max_num_sequences'"):
        Config(max_num_seqs=8)


def test_unknown_key_in_dict_names_key_and_closest_field() -> None:
    with pytest.raises(ConfigError, match=r"'max_num_batch_tokens'.*'max_num_batched_tokens'"):
        Config.from_dict({"model": None, "max_num_batch_tokens": 4096})


def test_config_error_is_type_and_value_error() -> None:
    # kwargs callers expect TypeError (Python's own), dict callers ValueError.
    with pytest.raises(TypeError):
        Config(blocksize=4)
    with pytest.raises(ValueError):
        Config.from_dict({"blocksize": 4})


def test_unknown_key_without_close_match_lists_fields() -> None:
    with pytest.raises(ConfigError, match="allowed: model, max_num_sequences") as e:
        Config(zzzzzz=1)
    assert "did you mean" not in str(e.value)


def test_from_dict_roundtrip_and_replace_are_checked() -> None:
    c = Config.from_dict({"block_size": 8, "eos": [2, 3]})
    assert c.block_size == 8 and c.eos == (2, 3)  # JSON list -> tuple
    assert Config.from_dict(dataclasses.asdict(c)) == c
    with pytest.raises(ConfigError, match="did you mean 'block_size'"):
        dataclasses.replace(c, block_sise=4)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_num_sequences", 0),
        ("max_num_sequences", 2.0),
        ("max_num_batched_tokens", -1),
        ("max_model_length", 0),
        ("block_size", 0),
        ("block_size", True),
        ("num_kvcache_blocks", 0),
        ("num_kvcache_blocks", -2),
        ("gpu_memory_utilization", 0.0),
        ("gpu_memory_utilization", 1.5),
        ("tensor_parallel_size", 0),
        ("enforce_eager", 1),
        ("dtype", "fp16"),
        ("device", "gpu"),
        ("eos", -2),
        ("eos", ()),
        ("eos", (1, -1)),
        ("eos", "2"),
        ("enable_prefix_caching", "yes"),
        ("batch_invariant", 1),
        ("model", 3),
    ],
)
def test_bad_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"Config\.{field}={re.escape(repr(value))}: allowed: "):
        Config(**{field: value})


def test_valid_edge_values() -> None:
    assert Config(eos=-1).eos == -1
    assert Config(eos=0).eos == 0
    assert Config(num_kvcache_blocks=1, gpu_memory_utilization=1.0, block_size=1).block_size == 1


def test_a_part_refuses_a_setting_the_engine_has_not_resolved_yet() -> None:
    """The Scheduler and the InputBuilder need max_model_length and the KV cache's block count
    resolved; given a Config that still holds None / -1 they say which part needs which
    setting, what is allowed and who sets it."""
    from myvllm.config import resolved_max_model_length, sized_num_kvcache_blocks

    with pytest.raises(ValueError, match=re.escape(
            "InputBuilder: config.max_model_length=None: allowed: an integer >= 1, which the "
            "engine sets from the checkpoint when it is None, before it builds InputBuilder")):
        resolved_max_model_length(Config(), "InputBuilder")
    with pytest.raises(ValueError, match=re.escape(
            "Scheduler: config.num_kvcache_blocks=-1: allowed: an integer >= 1, which the "
            "ModelRunner sets when it sizes the KV cache (-1: from memory), before Scheduler "
            "is built")):
        sized_num_kvcache_blocks(Config(), "Scheduler")
    sized = Config(max_model_length=32, num_kvcache_blocks=8)
    assert (resolved_max_model_length(sized, "InputBuilder"),
            sized_num_kvcache_blocks(sized, "Scheduler")) == (32, 8)
