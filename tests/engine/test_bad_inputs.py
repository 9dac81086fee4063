"""Every bad input gets a specific exception naming the problem, early.

Three groups, by when the mistake can be seen:

    settings     Config(...), Config.from_dict, LLM(path, **kw), SamplingParams(...)
                 -> raise while the object is built; no model is loaded
    checkpoint   LLM(path) with a missing / unknown / broken / mis-shaped checkpoint
                 -> raise before the KV cache is sized (and before any worker process is
                    started, where the config alone shows the problem)
    requests     llm.generate(...) on a live engine
                 -> raise before anything is queued or any forward runs; afterwards the
                    engine is untouched (queues empty, every block free) and the next valid
                    generate() gives the tokens it gave before
"""

from __future__ import annotations

import json
import multiprocessing
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers_models import tiny_checkpoint
from safetensors.torch import load_file, save_file

import myvllm.engine.core_parts as core_parts
from myvllm import LLM, Config, SamplingParams
from myvllm.config import ConfigError
from myvllm.engine.model_runner import ModelRunner
from myvllm.engine.request_checks import check_generate_args
from myvllm.engine.startup import check_tensor_parallel
from myvllm.utils.distributed import TORCHRUN_RANK_VARS
from myvllm.utils.checkpoint import CheckpointError
from helpers_blocks import used_block_ids

VOCAB = 256  # helpers_models.TINY_DIMS
ENGINE_KW: dict[str, Any] = dict(block_size=4, num_kvcache_blocks=16, max_model_length=32,
                                 max_num_batched_tokens=64)
GOOD_PROMPTS: list[Any] = [[5, 6, 7, 8, 9, 10], "hi there"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


# ================================================================== settings
UNKNOWN_KEYS = [
    ({"max_num_seqs": 4}, "max_num_seqs", "max_num_sequences"),
    ({"blocksize": 8}, "blocksize", "block_size"),
    ({"kv_cache_blocks": 8}, "kv_cache_blocks", "num_kvcache_blocks"),
    ({"tp_size": 2}, "tp_size", None),  # nothing close: the message lists the valid fields
]


@pytest.mark.parametrize(("kwargs", "key", "closest"), UNKNOWN_KEYS)
def test_unknown_config_key_everywhere(kwargs: dict[str, Any], key: str,
                                       closest: str | None) -> None:
    path = str(tiny_checkpoint("llama"))
    pattern = f"'{key}'.*" + (f"did you mean '{closest}'" if closest else "allowed: model, ")
    builders: list[Callable[[], Any]] = [
        lambda: Config(**kwargs),
        lambda: Config.from_dict({"model": path, **kwargs}),
        lambda: LLM(path, **kwargs),
        lambda: LLM(Config(model=path), **kwargs),
    ]
    for build in builders:
        with pytest.raises(ConfigError, match=pattern):
            build()
    # ConfigError is both: `except TypeError` (bad keyword) and `except ValueError` work.
    assert issubclass(ConfigError, TypeError) and issubclass(ConfigError, ValueError)


BAD_CONFIG_VALUES = [
    ("block_size", 0), ("block_size", 2.0), ("max_num_sequences", 0),
    ("max_num_batched_tokens", -1), ("max_model_length", 0), ("tensor_parallel_size", 0),
    ("num_kvcache_blocks", 0), ("gpu_memory_utilization", 1.5), ("dtype", "fp8"),
    ("device", "tpu"), ("eos", -2), ("enforce_eager", "yes"), ("enable_prefix_caching", 1),
]


@pytest.mark.parametrize(("field", "value"), BAD_CONFIG_VALUES)
def test_bad_config_value(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"Config\.{field}"):
        Config(**{field: value})
    with pytest.raises(ValueError, match=rf"Config\.{field}"):
        LLM(str(tiny_checkpoint("llama")), **{field: value})


BAD_SAMPLING = [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", "0"), ("top_k", 0), ("top_k", -2), ("top_k", 2.0), ("top_p", 0.0),
    ("top_p", 1.01), ("top_p", float("nan")), ("max_tokens", 0), ("max_tokens", 3.0),
    ("ignore_eos", 1), ("seed", -1), ("seed", 1.5),
]


@pytest.mark.parametrize(("field", "value"), BAD_SAMPLING)
def test_bad_sampling_value(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**{field: value})


# ================================================================== checkpoint
@pytest.fixture
def runner_spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts ModelRunners the engine builds and KV caches it sizes."""
    counts = {"runners": 0, "kv_caches": 0}

    class SpyRunner(ModelRunner):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            counts["runners"] += 1
            super().__init__(*args, **kwargs)

        def initialize_cache(self) -> int:
            counts["kv_caches"] += 1
            return super().initialize_cache()

    monkeypatch.setattr(core_parts, "ModelRunner", SpyRunner)
    return counts


def _copy(tmp_path: Path, kind: str = "llama") -> Path:
    dst = tmp_path / kind
    shutil.copytree(tiny_checkpoint(kind), dst)
    return dst


def _edit_config(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _missing_path(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    return str(tmp_path / "no-such-model"), {}


def _no_config(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    path = _copy(tmp_path)
    (path / "config.json").unlink()
    return str(path), {}


def _unknown_architecture(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    path = _copy(tmp_path)
    _edit_config(path, architectures=["FancyForCausalLM"])
    return str(path), {}


def _unknown_model_type(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    path = _copy(tmp_path)
    _edit_config(path, architectures=["FancyForCausalLM"], model_type="fancy_model")
    return str(path), {}


def _tp_not_dividing_heads(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    return str(tiny_checkpoint("llama")), {"tensor_parallel_size": 3}  # 4 heads


def _tp_not_dividing_kv_heads(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    return str(tiny_checkpoint("llama")), {"tensor_parallel_size": 4}  # 2 KV heads


def _missing_tensor(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    path = _copy(tmp_path)
    _edit_tensors(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    return str(path), {}


def _mis_shaped_tensor(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    path = _copy(tmp_path)
    _edit_tensors(path, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight",
                                                torch.zeros(100, 64)))
    return str(path), {}


def _corrupt_safetensors(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    path = _copy(tmp_path)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    return str(path), {}


def _truncated_safetensors(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    path = _copy(tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    return str(path), {}


def _corrupt_gguf(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    return str(path), {}


def _pickle_only(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    path = _copy(tmp_path)
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"never unpickled")
    return str(path), {}


# (make the checkpoint, exception, message pattern, the stage that may have run)
#   "none":   rejected from config.json / the path alone: no ModelRunner was built
#   "loader": rejected while loading weights: no KV cache was sized
CHECKPOINT_CASES = [
    (_missing_path, FileNotFoundError, r"no-such-model.*does not exist", "none"),
    (_no_config, FileNotFoundError, r"no config\.json", "none"),
    (_unknown_architecture, ValueError, r"FancyForCausalLM.*supported.*LlamaForCausalLM", "none"),
    (_unknown_model_type, CheckpointError, r"fancy_model", "none"),
    (_tp_not_dividing_heads, ValueError,
     r"tensor_parallel_size=3 must divide.*num_attention_heads=4", "none"),
    (_tp_not_dividing_kv_heads, ValueError,
     r"tensor_parallel_size=4 must divide.*num_key_value_heads=2", "none"),
    (_missing_tensor, CheckpointError, r"missing.*model\.layers\.1\.self_attn\.k_proj\.weight",
     "loader"),
    (_mis_shaped_tensor, CheckpointError, r"model\.layers\.0\.mlp\.up_proj\.weight.*100, 64",
     "loader"),
    (_corrupt_safetensors, CheckpointError, r"model\.safetensors", "loader"),
    (_truncated_safetensors, CheckpointError, r"model\.safetensors", "loader"),
    (_corrupt_gguf, CheckpointError, r"broken\.gguf", "none"),
    (_pickle_only, CheckpointError, r"pytorch_model\.bin.*safetensors", "loader"),
]


@pytest.mark.parametrize(("make", "exc", "pattern", "stage"), CHECKPOINT_CASES,
                         ids=[case[0].__name__.strip("_") for case in CHECKPOINT_CASES])
def test_bad_checkpoint(make: Callable[[Path], tuple[str, dict[str, Any]]], exc: type,
                        pattern: str, stage: str, tmp_path: Path,
                        runner_spy: dict[str, int]) -> None:
    path, kwargs = make(tmp_path)
    with pytest.raises(exc, match=pattern):
        LLM(path, **kwargs)
    assert runner_spy["kv_caches"] == 0, "the error came after the KV cache was sized"
    if stage == "none":
        assert runner_spy["runners"] == 0, "the error came after the model was built"
    assert multiprocessing.active_children() == []


# ================================================================== requests
@pytest.fixture(scope="module")
def live() -> Iterator[tuple[LLM, list[list[int]]]]:
    """A running engine (with a warm prefix cache) and its outputs for GOOD_PROMPTS."""
    llm = LLM(str(tiny_checkpoint("llama")), **ENGINE_KW)
    baseline = [o["token_ids"] for o in llm.generate(GOOD_PROMPTS, GREEDY, use_tqdm=False)]
    yield llm, baseline
    llm.exit()


def assert_untouched(llm: LLM) -> None:
    scheduler = llm.scheduler
    bm = scheduler.block_manager
    assert not scheduler.waiting and not scheduler.running
    assert not used_block_ids(bm) and len(bm.free_block_ids) == len(bm.blocks)
    assert all(block.ref_count == 0 for block in bm.blocks)
    assert not llm.engine_core.requests  # no per-request state left behind


# ENGINE_KW: 16 blocks of 4 = 64 tokens of KV, max_model_length 32, vocab 256.
# (prompts, sampling_params, exception, message pattern)
REQUEST_CASES: dict[str, tuple[Any, Any, type, str]] = {
    "prompt_longer_than_max_model_length":
        ([[1] * 33], GREEDY, ValueError,
         r"prompt_tokens=33: allowed: at most 31 with max_model_length=32"),
    "string_prompt_longer_than_max_model_length":
        (["x" * 40], GREEDY, ValueError, r"prompt_tokens=40: allowed: at most 31"),
    "empty_string_prompt": ([""], GREEDY, ValueError, r"prompt_tokens=0: allowed: at least 1"),
    "empty_token_list": ([[]], GREEDY, ValueError, r"empty prompt"),
    "negative_token_id": ([[3, -1, 4]], GREEDY, ValueError,
                          r"token_ids\[1\]=-1: allowed: a token id of the vocabulary"),
    "token_id_equal_to_vocab": ([[3, VOCAB]], GREEDY, ValueError,
                                rf"token_ids\[1\]={VOCAB}: allowed: .*\[0, {VOCAB}\)"),
    "token_id_far_out_of_vocab": ([[10**9]], GREEDY, ValueError, r"token_ids\[0\]=1000000000"),
    "float_token_id": ([[1, 2.0]], GREEDY, TypeError,
                       r"token_ids\[1\]=2\.0: allowed: an int token id"),
    "bool_token_id": ([[True, 2]], GREEDY, TypeError, r"token_ids\[0\]=True: allowed: an int"),
    "nested_token_list": ([[[1, 2]]], GREEDY, TypeError, r"token_ids\[0\]=\[1, 2\]: allowed:"),
    "bytes_prompt": ([b"abc"], GREEDY, TypeError,
                     r"prompt=b'abc': allowed: a str or a list of int token ids"),
    "none_prompt": ([None], GREEDY, TypeError, r"prompt=None: allowed: a str or a list"),
    "one_prompt_out_of_vocab": ([3, VOCAB], GREEDY, ValueError, rf"token_ids\[1\]={VOCAB}:"),
    "prompts_not_a_list": (None, GREEDY, TypeError, r"prompts=None: allowed: a list of prompts"),
    "prompts_as_generator": ((p for p in GOOD_PROMPTS), GREEDY, TypeError,
                             r"prompts=<generator .*: allowed: a list of prompts"),
    "too_few_sampling_params": (GOOD_PROMPTS, [GREEDY], ValueError,
                                r"len\(sampling_params\)=1: allowed: 2, one per prompt"),
    "too_many_sampling_params": (GOOD_PROMPTS, [GREEDY] * 3, ValueError,
                                 r"len\(sampling_params\)=3: allowed: 2"),
    "sampling_params_as_dict": (GOOD_PROMPTS[:1], {"temperature": 0.0}, TypeError,
                                r"sampling_params=\{'temperature': 0\.0\}: allowed: None"),
    "sampling_params_list_with_none": (GOOD_PROMPTS, [GREEDY, None], TypeError,
                                       r"sampling_params=None: allowed: a SamplingParams"),
    # A sequence that can never fit the KV cache: test_never_fits_the_kv_cache (its own
    # engine: here max_model_length=32 fits the 64 tokens of cache).
}


def test_a_refused_value_is_shown_short() -> None:
    """A refusal shows the value given, cut short where it is long: the whole prompt passed
    where the list of prompts was expected would make a message of megabytes."""
    with pytest.raises(TypeError, match=r"prompts='xxxx.*\.\.\. \(a str\): allowed: a list of "
                                        "prompts") as refused:
        check_generate_args("x" * 100_000, None)
    assert len(str(refused.value)) < 400


@pytest.mark.parametrize("case", list(REQUEST_CASES))
def test_bad_request_leaves_the_engine_usable(case: str, live: tuple[LLM, list[list[int]]],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    llm, baseline = live
    prompts, params, exc, pattern = REQUEST_CASES[case]
    forwards: list[bool] = []
    original_run = llm.model_runner.run

    def counting_run(seqs: Any, is_prefill: bool) -> Any:
        forwards.append(is_prefill)
        return original_run(seqs, is_prefill)

    monkeypatch.setattr(llm.model_runner, "run", counting_run)
    with pytest.raises(exc, match=pattern):
        llm.generate(prompts, params, use_tqdm=False)
    assert forwards == [], "the bad request reached the model"
    assert_untouched(llm)

    # The same bad prompt in the middle of good ones: none of the batch is queued.
    if isinstance(prompts, list) and len(prompts) == 1 and params is GREEDY:
        with pytest.raises(exc, match=pattern):
            llm.generate([GOOD_PROMPTS[0], prompts[0], GOOD_PROMPTS[1]], GREEDY,
                         use_tqdm=False)
        assert forwards == []
        assert_untouched(llm)
        with pytest.raises(exc, match=pattern):
            llm.add_request(prompts[0], GREEDY)
        assert_untouched(llm)

    # Still usable: the next valid generate gives the tokens it gave before the error.
    outs = llm.generate(GOOD_PROMPTS, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == baseline
    assert forwards, "the valid generate ran no forward pass?"
    assert_untouched(llm)


def test_never_fits_the_kv_cache() -> None:
    # 4 blocks of 4 = 16 tokens of KV for everything, and for any single sequence.
    llm = LLM(str(tiny_checkpoint("llama")), block_size=4, num_kvcache_blocks=4,
              max_model_length=64, max_num_batched_tokens=64)
    prompt = list(range(1, 11))
    fits = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)  # 10 + 7 - 1 = 16
    expected = llm.generate([prompt], fits, use_tqdm=False)[0]["token_ids"]
    too_big = [
        (list(range(1, 18)), SamplingParams(temperature=0.0, max_tokens=1)),  # prompt of 17
        (prompt, SamplingParams(temperature=0.0, max_tokens=8)),  # grows to 10 + 8 - 1 = 17
    ]
    for bad_prompt, bad_params in too_big:
        with pytest.raises(ValueError, match=r"17 tokens = 5 blocks of 4: allowed: at most the 4 "
                                             r"blocks of the whole KV cache"):
            llm.generate([prompt, bad_prompt], [fits, bad_params], use_tqdm=False)
        assert_untouched(llm)
    assert llm.generate([prompt], fits, use_tqdm=False)[0]["token_ids"] == expected


def test_longer_than_a_prefill_can_hold() -> None:
    """Prefill-first: after a preemption a sequence is prefilled whole, so it must fit one
    prefill batch. (With chunked prefill any length runs: tests/engine/test_chunked_prefill.py.)"""
    llm = LLM(str(tiny_checkpoint("llama")), block_size=4, num_kvcache_blocks=32,
              max_model_length=64, max_num_batched_tokens=16, enable_chunked_prefill=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with pytest.raises(ValueError, match=r"17 tokens: allowed: at most max_num_batched_tokens=16"):
        llm.generate([list(range(1, 11))], params, use_tqdm=False)  # 10 + 8 - 1 = 17
    assert_untouched(llm)
    assert len(llm.generate([list(range(1, 10))], params, use_tqdm=False)[0]["token_ids"]) == 8


def test_more_tensor_parallel_ranks_than_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused before any worker starts, naming the GPU it would need and the ones there are."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name in TORCHRUN_RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    hf_config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs cuda:1 on this host: "
                                         r"allowed: cuda:0 to cuda:0 \(CUDA devices visible: 1"):
        check_tensor_parallel(Config(device="cuda", tensor_parallel_size=2), hf_config)


def test_string_prompt_without_a_tokenizer(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    llm = LLM(str(path), **ENGINE_KW)
    with pytest.raises(ValueError, match=re.escape(str(path)) + r" has no tokenizer"):
        llm.generate(["hello"], GREEDY, use_tqdm=False)
    assert_untouched(llm)
    out = llm.generate([[104, 105]], GREEDY, use_tqdm=False)[0]
    assert out["text"] is None and len(out["token_ids"]) == GREEDY.max_tokens
