"""The data-parallel router's policy (serving/dp_router.py), with no engine: prompts sharing a
prefix go to one replica, unrelated ones spread by load, one hot prefix does not pile every
request onto one replica; and the settings that cannot work are clear errors."""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import Any

import pytest

from myvllm.config import Config
from myvllm.serving.dp_async_llm import DPAsyncLLM, replica_devices
from myvllm.serving.dp_router import MAX_ROUTED_BLOCKS, PrefixRouter
from myvllm.entrypoints import cli

BLOCK = 4


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(length)]


def test_a_block_hash_stands_for_its_whole_prefix() -> None:
    router = PrefixRouter(2, BLOCK)
    ids = list(range(11))  # two full blocks and a partial one
    hashes = router.block_hashes(ids)
    assert len(hashes) == 2 and hashes[0] != hashes[1]
    assert router.block_hashes(ids[:8] + [99]) == hashes  # the partial block does not count
    assert router.block_hashes([0, 1, 2, 3, 40, 5, 6, 7])[0] == hashes[0]
    assert router.block_hashes([0, 1, 2, 3, 40, 5, 6, 7])[1] != hashes[1]
    # The same second block after another first block is another prefix.
    assert router.block_hashes([9, 1, 2, 3, 4, 5, 6, 7])[1] != hashes[1]
    assert router.block_hashes([]) == [] and router.block_hashes([1, 2, 3]) == []
    assert len(router.block_hashes(list(range(BLOCK * (MAX_ROUTED_BLOCKS + 5))))) == \
        MAX_ROUTED_BLOCKS


def test_a_shared_prefix_stays_on_its_replica_while_unrelated_prompts_spread() -> None:
    rng = random.Random(0)
    router = PrefixRouter(2, BLOCK)
    system = prompt(rng, 3 * BLOCK)
    first = router.route(system + prompt(rng, 5))
    router.started(first)
    # Unrelated prompts go to the least loaded: the other replica first, then in turn.
    other = router.route(prompt(rng, 2 * BLOCK))
    assert other != first
    router.started(other)
    # Each prompt of the system prompt follows it, though both replicas are equally loaded.
    for _ in range(4):
        assert router.route(system + prompt(rng, 7)) == first
    # ... and so does one more loaded, within the slack (BALANCE_ABS sequences).
    router.started(first, 3)
    assert router.route(system + prompt(rng, 7)) == first
    assert router.num_routed[first] == 6 and router.num_routed[other] == 1


def test_longest_prefix_wins() -> None:
    rng = random.Random(1)
    router = PrefixRouter(2, BLOCK)
    system = prompt(rng, 2 * BLOCK)
    first_user = system + prompt(rng, 2 * BLOCK)
    router._remember(router.block_hashes(first_user), 0)
    second_user = system + prompt(rng, 2 * BLOCK)
    router._remember(router.block_hashes(second_user), 1)  # the system prompt's last: 1
    assert router.route(first_user + prompt(rng, 3)) == 0  # its 4 blocks beat the 2 on 1
    assert router.route(second_user + prompt(rng, 3)) == 1
    assert router.route(system + prompt(rng, 2 * BLOCK)) == 1  # a third user: the last one


def test_a_prompt_shorter_than_a_block_goes_to_the_least_loaded() -> None:
    router = PrefixRouter(3, BLOCK)
    router.load = [2, 0, 1]
    assert router.route([5, 6, 7]) == 1
    router.load = [0, 3, 1]
    assert router.route([5, 6, 7]) == 0  # nothing remembered for it


def test_one_hot_prefix_spills_over_to_an_idle_replica() -> None:
    """Every request shares one system prompt: it follows its replica up to the slack, then
    the other replica takes a share, and from then on both hold it."""
    rng = random.Random(2)
    router = PrefixRouter(2, BLOCK, balance_abs=3, balance_rel=0.5)
    system = prompt(rng, 2 * BLOCK)
    seen = []
    for _ in range(40):  # a burst: none finishes
        replica = router.route(system + prompt(rng, BLOCK))
        router.started(replica)
        seen.append(replica)
    assert seen[:4] == [0, 0, 0, 0]  # within the slack of 3: the prefix wins
    assert seen[4] == 1  # 4 > 0 + 3: the idle replica takes it
    assert abs(router.load[0] - router.load[1]) <= max(3, 0.5 * min(router.load)) + 1
    assert min(router.load) >= 15


def test_sequences_of_n_count_as_load_and_finish() -> None:
    router = PrefixRouter(2, BLOCK, policy="least_loaded")
    router.started(router.route([1] * 9), 4)  # n=4 on replica 0
    assert router.route([2] * 9) == 1
    router.started(1, 1)
    assert router.route([3] * 9) == 1  # 1 < 4
    router.finished(0, 4)
    assert router.route([4] * 9) == 0
    with pytest.raises(AssertionError, match="more sequences than it started"):
        router.finished(0, 1)


def test_round_robin_ignores_prefix_and_load() -> None:
    router = PrefixRouter(3, BLOCK, policy="round_robin")
    router.load = [9, 0, 0]
    assert [router.route([7] * 12) for _ in range(5)] == [0, 1, 2, 0, 1]
    assert router.num_routed == [2, 2, 1]


def test_the_map_of_prefixes_is_bounded_lru() -> None:
    rng = random.Random(3)
    router = PrefixRouter(2, BLOCK, max_tracked_blocks=5)
    old = prompt(rng, 2 * BLOCK)
    router._remember(router.block_hashes(old), 1)
    for _ in range(3):  # 6 newer blocks push both of old's out
        router.route(prompt(rng, 2 * BLOCK))
    assert len(router._replica_of_block) == 5
    assert all(h not in router._replica_of_block for h in router.block_hashes(old))
    assert router.route(old) == router.least_loaded()


@pytest.mark.parametrize("kwargs, message", [
    ({"num_replicas": 0}, "PrefixRouter.num_replicas=0: allowed: an int >= 1"),
    ({"block_size": 0}, "PrefixRouter.block_size=0: allowed: an int >= 1"),
    ({"policy": "random"}, "data-parallel routing='random': allowed: 'prefix', 'least_loaded', "
                           "'round_robin'"),
    ({"max_tracked_blocks": 0}, "PrefixRouter.max_tracked_blocks=0: allowed: an int >= 1"),
])
def test_bad_router_settings(kwargs: dict[str, Any], message: str) -> None:
    settings: dict[str, Any] = {"num_replicas": 2, "block_size": BLOCK, **kwargs}
    with pytest.raises(ValueError, match=message):
        PrefixRouter(**settings)


# ---------------------------------------------------------------------------- settings
@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_data_parallel_size_must_be_a_positive_int(value: object) -> None:
    with pytest.raises(ValueError, match="data_parallel_size=.*: allowed: an int >= 1"):
        Config(data_parallel_size=value)  # type: ignore[arg-type]


def test_the_flag_and_its_errors(capsys: pytest.CaptureFixture[str]) -> None:
    args = cli.build_parser().parse_args(["serve", "m", "--data-parallel-size", "2",
                                          "--data-parallel-routing", "round_robin"])
    assert cli.engine_config(args).data_parallel_size == 2
    assert args.data_parallel_routing == "round_robin"
    assert cli.main(["serve", "m", "--data-parallel-size", "0"]) == 2
    assert "--data-parallel-size 0: allowed: an int >= 1" in capsys.readouterr().err
    assert cli.main(["chat", "m", "--data-parallel-size", "2"]) == 2
    assert "is for `myvllm serve`" in capsys.readouterr().err


def test_one_engine_clients_refuse_replicas() -> None:
    from myvllm import LLM
    from myvllm.serving.async_llm import AsyncLLM

    with pytest.raises(ValueError, match=r"LLM: Config.data_parallel_size=2: allowed: 1 \(LLM "
                                         "runs one engine in this process"):
        LLM(Config(data_parallel_size=2))
    with pytest.raises(ValueError, match="AsyncLLM: Config.data_parallel_size=2: allowed: 1 "
                                         r"\(AsyncLLM runs one engine core"):
        AsyncLLM(Config(data_parallel_size=2))
    with pytest.raises(ValueError, match="DPAsyncLLM: Config.data_parallel_size=1: allowed: an "
                                         "int >= 2"):
        DPAsyncLLM(Config())


def test_replicas_get_their_own_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    config = Config(device="cuda", data_parallel_size=2, tensor_parallel_size=2)
    assert replica_devices(config) == ["0,1", "2,3"]
    assert replica_devices(Config(device="cuda", data_parallel_size=3)) == ["0", "1", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    assert replica_devices(Config(device="cuda", data_parallel_size=3)) == ["4", "6", "7"]
    with pytest.raises(ValueError, match=r"data_parallel_size=2 x tensor_parallel_size=2 = 4 "
                                         r"GPUs: allowed: at most the 3 visible"):
        replica_devices(config)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError, match="MASTER_ADDR='10.0.0.1', MASTER_PORT='29500' with "
                                         "data_parallel_size=2 x tensor_parallel_size=2: "
                                         "allowed: both unset"):
        replica_devices(config)
    # On a CPU every replica shares it.
    assert replica_devices(Config(device="cpu", data_parallel_size=2)) == [None, None]


def test_serve_with_more_replicas_than_gpus_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str],
                                                        tmp_path: Path) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with socket.socket() as sock:  # a free port: the address is checked first
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # An existing model folder (no weights read: the GPUs are counted first).
    (tmp_path / "config.json").write_text("{}")
    assert cli.main(["serve", str(tmp_path), "--data-parallel-size", "2",
                     "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("myvllm serve: data_parallel_size=2 x tensor_parallel_size=1 = 2 "
                           "GPUs: allowed: at most the 1 visible")
