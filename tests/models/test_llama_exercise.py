"""Grader for the exercise "delete src/myvllm/models/llama.py and write it back".

Run:  uv run pytest tests/models/test_llama_exercise.py -x            (seconds: one rank)
      uv run pytest tests/models/test_llama_exercise.py -m slow   (1-2 minutes: two ranks)
Each test checks one part, in the order you would build it; read the first failure's message.
The oracle is HF transformers' LlamaForCausalLM on tiny random checkpoints: "llama" (plain
RoPE, untied lm_head) and "llama3" (llama3 RoPE scaling, tied embeddings, attention and MLP
biases). The decoder stack (models/decoder.py) is shared with Qwen3; what you write is
Llama's attention and the class that puts it into that stack.

At tensor_parallel_size 1 a rank's head counts equal the config's, so a model that uses the
totals passes every one-rank test: test_attention_holds_this_ranks_heads builds rank 0 of 2
in this process, and the slow test_two_ranks_over_gloo_match_hf runs two ranks for real.
When an output differs, the message says which step looks missing when HF's model with that
step removed gives your output (RoPE, a norm), and names RoPE applied to v when the v your
attention hands to Attention changes with the positions.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from helpers_models import (
    load_hf_reference,
    prefill_context,
    random_prompts,
    tiny_checkpoint,
    tiny_config,
)
from helpers_tp_ranks import prefill_logits, pretend_rank, run_ranks

from myvllm.layers.attention import Attention
from myvllm.layers.rotary_embedding import RotaryEmbedding
from myvllm.models.config import get_head_dim
from myvllm.models.decoder import DecoderLayer
from myvllm.utils.context import Context, forward_context
from myvllm.utils.checkpoint import iter_checkpoint_tensors
from myvllm.utils.hf_config import load_hf_config
from myvllm.utils.loader import load_model

KINDS = ["llama", "llama3"]
EXPECTED_PACKING = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
MODULE = "myvllm.models.llama"
START_HERE = (
    "create src/myvllm/models/llama.py with a class LlamaForCausalLM that takes the "
    "transformers config: a CausalLM (models/decoder.py) built with a LlamaAttention of your "
    "own. HowToApproachvLLM.md, Step 2, \"Exercise 2: delete models/llama.py and write it "
    "back\", gives the steps"
)


def _llama_class():
    try:
        module = importlib.import_module(MODULE)
    except ModuleNotFoundError as e:
        if e.name != MODULE:
            raise  # the file exists, and an import inside it fails: its traceback says which
        module = None  # failed below, outside the except: no chained traceback to read past
    if module is None:
        pytest.fail(f"src/myvllm/models/llama.py does not exist: {START_HERE}.", pytrace=False)
    cls = getattr(module, "LlamaForCausalLM", None)
    if cls is None:
        pytest.fail(f"src/myvllm/models/llama.py has no LlamaForCausalLM: {START_HERE}.",
                    pytrace=False)
    return cls


@contextmanager
def _hf_without(hf: Any, step: str) -> Iterator[None]:
    """HF's model with one step of the forward removed: "rope", or a norm by its module name
    ("input_layernorm", "post_attention_layernorm" in every layer, "norm" the final one)."""
    from transformers.models.llama import modeling_llama

    if step == "rope":
        original = modeling_llama.apply_rotary_pos_emb
        modeling_llama.apply_rotary_pos_emb = lambda q, k, *args, **kwargs: (q, k)
        try:
            yield
        finally:
            modeling_llama.apply_rotary_pos_emb = original
        return
    norms = [hf.model.norm] if step == "norm" else [getattr(layer, step)
                                                    for layer in hf.model.layers]
    handles = [norm.register_forward_hook(lambda m, args, out: args[0]) for norm in norms]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


MISSING_STEP_HINTS = {
    "rope": "looks like RoPE is not applied: rotate q and k with your rotary_emb(positions, q, "
            "k) after the split and before attention",
    "input_layernorm": "looks like input_layernorm is not applied: the attention must run the "
                       "norm it is given with qkv_proj, norm_linear(norm, self.qkv_proj, x, "
                       "residual), not qkv_proj alone",
    "post_attention_layernorm": "looks like post_attention_layernorm is not applied before the "
                                "MLP",
    "norm": "looks like the final norm (model.norm) is not applied before the LM head",
}


def _missing_step(got: torch.Tensor, hf: Any, hf_output: Callable[[], torch.Tensor],
                  steps: tuple[str, ...]) -> str:
    """The hint for the first step whose removal from HF's forward gives `got`, else ""."""
    for step in steps:
        with _hf_without(hf, step):
            if torch.allclose(got, hf_output(), atol=1e-4):
                return MISSING_STEP_HINTS[step] + ". "
    return ""


V_ROTATED = (
    "the v your attention gives Attention changes with the positions: looks like RoPE is "
    "applied to v. RoPE rotates q and k only (so that q . k depends on how far apart two "
    "tokens are); v is what attention averages, and a rotated v mixes each token's position "
    "into the output. Rotate with rotary_emb(positions, q, k) and pass v to attn as qkv_proj "
    "gave it"
)


@torch.no_grad()
def _v_moves_with_positions(model: Any) -> bool:
    """Whether layer 0's attention hands its Attention a v that depends on the positions:
    the same hidden states at positions 0..4 and 7..11 must give the same v."""
    layer = model.model.layers[0]
    attn = next((m for m in layer.modules() if isinstance(m, Attention)), None)
    if attn is None or not hasattr(layer, "self_attn"):
        return False  # test_decode_logits_match_hf names a missing Attention
    seen: list[torch.Tensor] = []

    def keep_v(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        v = args[2] if len(args) > 2 else kwargs.get("v")
        if isinstance(v, torch.Tensor):
            seen.append(v.detach().clone())

    x = torch.randn(5, model.config.hidden_size)
    handle = attn.register_forward_pre_hook(keep_v, with_kwargs=True)
    try:
        for start in (0, 7):
            with forward_context(prefill_context([5])):
                layer.self_attn(torch.arange(start, start + 5), x)
    finally:
        handle.remove()
    return len(seen) == 2 and not torch.equal(seen[0], seen[1])


def _diagnosis(model: Any, got: torch.Tensor, hf: Any, hf_output: Callable[[], torch.Tensor],
               steps: tuple[str, ...]) -> str:
    """What looks wrong, when the output alone says it: v rotated, or a step missing."""
    if _v_moves_with_positions(model):
        return V_ROTATED + ". "
    return _missing_step(got, hf, hf_output, steps)


def _build(kind: str):
    config = load_hf_config(tiny_checkpoint(kind))
    return _llama_class()(config).eval()


def _checkpoint_names_as_ours(kind: str) -> dict[str, list[str]]:
    """our parameter name -> the checkpoint tensor name(s) loaded into it."""
    mapping = getattr(_llama_class(), "packed_modules_mapping", {})
    out: dict[str, list[str]] = {}
    for name, _ in iter_checkpoint_tensors(tiny_checkpoint(kind)):
        ours = ".".join(mapping[p][0] if p in mapping else p for p in name.split("."))
        out.setdefault(ours, []).append(name)
    return out


@pytest.fixture(scope="module", params=KINDS)
def loaded(request):
    kind = request.param
    model = _build(kind)
    try:
        load_model(model, tiny_checkpoint(kind))
    except Exception as e:  # reported as a failure of this fixture's tests, with the reason
        pytest.fail(f"load_model failed for the {kind!r} checkpoint: {type(e).__name__}: {e}")
    return kind, model, load_hf_reference(tiny_checkpoint(kind))


# 1. Structure ---------------------------------------------------------------------------------


def test_class_is_registered() -> None:
    from myvllm.models import get_model_class

    cls = _llama_class()  # first: its message says what to write when the file is missing
    assert get_model_class(["LlamaForCausalLM"]) is cls, (
        'models/__init__.py must map "LlamaForCausalLM" to models.llama.LlamaForCausalLM'
    )


def test_packed_modules_mapping() -> None:
    mapping = getattr(_llama_class(), "packed_modules_mapping", None)
    assert mapping == EXPECTED_PACKING, (
        "LlamaForCausalLM.packed_modules_mapping (a class attribute) tells the loader which "
        "checkpoint tensors are packed into one parameter; expected "
        f"{EXPECTED_PACKING}, got {mapping}"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_parameter_names_match_checkpoint(kind: str) -> None:
    model = _build(kind)
    ours = set(dict(model.named_parameters()))
    expected = set(_checkpoint_names_as_ours(kind))
    if model.config.tie_word_embeddings:
        ours.discard("lm_head.weight")
    missing, extra = sorted(expected - ours), sorted(ours - expected)
    assert not missing and not extra, (
        "module names must equal the checkpoint's tensor names (model.embed_tokens, "
        "model.layers.N.self_attn.qkv_proj, model.layers.N.mlp.gate_up_proj, model.norm, "
        f"lm_head ...).\n  checkpoint tensors with no parameter: {missing}\n  parameters with "
        f"no checkpoint tensor: {extra}"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_parameter_shapes(kind: str) -> None:
    from transformers import LlamaForCausalLM as HFLlama

    model, hf = _build(kind), HFLlama(tiny_config(kind))
    hf_shapes = {n: p.shape for n, p in hf.named_parameters()}
    ours = dict(model.named_parameters())
    wrong = []
    for our_name, ckpt_names in _checkpoint_names_as_ours(kind).items():
        if our_name not in ours:
            continue  # reported by test_parameter_names_match_checkpoint
        # A packed parameter stacks the rows of its parts (q+k+v, gate+up).
        want = list(hf_shapes[ckpt_names[0]])
        want[0] = sum(hf_shapes[n][0] for n in ckpt_names)
        if list(ours[our_name].shape) != want:
            wrong.append(f"{our_name}: {list(ours[our_name].shape)}, expected {want}")
    assert not wrong, (
        "parameter shapes differ from the checkpoint's (packed ones: q+k+v rows, gate+up rows). "
        "Read every size from the config (head_dim = config.head_dim if set):\n  "
        + "\n  ".join(wrong)
    )


def test_head_dim_comes_from_config() -> None:
    config = tiny_config("llama", head_dim=8)  # 4 heads x 8 != hidden 64
    model = _llama_class()(config)
    qkv = dict(model.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape[0] == (4 + 2 * 2) * 8, (
        "with config.head_dim=8, qkv_proj must have (heads + 2*kv_heads) * 8 rows; use "
        "config.head_dim when present, else hidden_size // num_attention_heads"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_tied_embeddings_follow_config(kind: str) -> None:
    model = _build(kind)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == bool(model.config.tie_word_embeddings), (
        f"config.tie_word_embeddings={model.config.tie_word_embeddings}: lm_head.weight must "
        f"{'be' if model.config.tie_word_embeddings else 'not be'} the same Parameter as "
        "model.embed_tokens.weight"
    )


# 2. Numbers -------------------------------------------------------------------------------------


@torch.no_grad()
def test_attention_takes_the_layer_norm(loaded) -> None:
    kind, model, _ = loaded
    layer = model.model.layers[0]
    if not isinstance(layer, DecoderLayer):
        return  # a decoder layer of your own: test_first_decoder_layer_matches_hf checks it
    contract = (
        "the shared DecoderLayer runs input_layernorm, then calls self_attn(positions, "
        "hidden_states) with its output and expects the attention's output [tokens, "
        "hidden_size] back: start with qkv_proj(hidden_states) (models/decoder.py)"
    )
    x = torch.randn(5, model.config.hidden_size)
    try:
        with forward_context(prefill_context([5])):
            out = layer.self_attn(torch.arange(5), layer.input_layernorm(x))
    except TypeError as e:
        pytest.fail(f"[{kind}] {type(e).__name__}: {e}\n{contract}")
    assert isinstance(out, torch.Tensor) and out.shape == x.shape, f"[{kind}] {contract}"


def test_rope_matches_hf(loaded) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    kind, model, _ = loaded
    config = model.config
    ropes = {id(m): m for m in model.modules() if isinstance(m, RotaryEmbedding)}
    assert ropes, (
        "no RotaryEmbedding module found: build it with layers.rotary_embedding.get_rope(...)"
    )
    positions = torch.tensor([0, 1, 5, 17, 63, 64, 100, config.max_position_embeddings - 1])
    n, head_dim = len(positions), get_head_dim(config)
    q, k = torch.randn(n, 4, head_dim), torch.randn(n, 2, head_dim)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    for rope in ropes.values():
        q_out, k_out = rope(positions, q.clone(), k.clone())
        assert torch.allclose(q_out, q_ref[0].transpose(0, 1), atol=1e-5) and torch.allclose(
            k_out, k_ref[0].transpose(0, 1), atol=1e-5
        ), (
            f"[{kind}] RoPE differs from HF: pass head_dim, config.max_position_embeddings and "
            "rope_parameters(config) (theta AND scaling, e.g. llama3) to get_rope"
        )


def test_embedding_matches_hf(loaded) -> None:
    kind, model, hf = loaded
    ids = torch.randint(0, model.config.vocab_size, (10,))
    with torch.no_grad():
        got = model.model.embed_tokens(ids)
        want = hf.model.embed_tokens(ids)
    assert torch.equal(got, want), f"[{kind}] model.embed_tokens output differs from HF's"


@torch.no_grad()
def test_values_are_not_rotated(loaded) -> None:
    kind, model, _ = loaded
    if _v_moves_with_positions(model):
        pytest.fail(f"[{kind}] {V_ROTATED}", pytrace=False)


@torch.no_grad()
def test_first_decoder_layer_matches_hf(loaded) -> None:
    kind, model, hf = loaded
    ids = torch.randint(0, model.config.vocab_size, (9,))
    captured = []
    handle = model.model.layers[0].register_forward_hook(lambda m, i, o: captured.append(o))
    try:
        with forward_context(prefill_context([9])):
            model(ids, torch.arange(9))
    finally:
        handle.remove()
    out = captured[0]
    # nano-vllm style layers return (hidden, residual) with the residual add deferred.
    got = out[0] + out[1] if isinstance(out, tuple) else out

    def layer_0() -> torch.Tensor:
        return hf(ids[None], output_hidden_states=True).hidden_states[1][0]

    if torch.allclose(got, layer_0(), atol=1e-4):
        return
    steps = ("rope", "input_layernorm", "post_attention_layernorm")
    pytest.fail(
        f"[{kind}] decoder layer 0 output (hidden + residual) differs from HF's: "
        f"{_diagnosis(model, got, hf, layer_0, steps)}The layer runs input_layernorm -> qkv_proj "
        "-> RoPE -> attention -> o_proj -> residual -> post_attention_layernorm -> "
        "gate_up_proj -> SiluAndMul -> down_proj", pytrace=False)


@torch.no_grad()
def test_prefill_logits_match_hf(loaded) -> None:
    kind, model, hf = loaded
    prompts = [torch.randint(0, model.config.vocab_size, (n,)) for n in (7, 12)]
    with forward_context(prefill_context([7, 12])):
        hidden = model(torch.cat(prompts), torch.cat([torch.arange(7), torch.arange(12)]))
        last = model.compute_logits(hidden)

    def last_logits() -> torch.Tensor:
        return torch.stack([hf(p[None]).logits[0, -1] for p in prompts])

    want = last_logits()
    assert last is not None and last.shape == want.shape, (
        f"[{kind}] compute_logits in a prefill must return one row per sequence "
        f"({tuple(want.shape)}), "
        f"got {None if last is None else tuple(last.shape)}: use ParallelLMHead"
    )
    if not torch.allclose(last, want, atol=1e-4):
        steps = ("rope", "input_layernorm", "post_attention_layernorm", "norm")
        pytest.fail(f"[{kind}] prefill logits differ from HF's: "
                    f"{_diagnosis(model, last, hf, last_logits, steps)}If decoder layer 0 "
                    "matches (test_first_decoder_layer_matches_hf), look at what runs after "
                    "it: the later layers, model.norm and lm_head", pytrace=False)


@torch.no_grad()
def test_decode_logits_match_hf(loaded) -> None:
    kind, model, hf = loaded
    config, block_size = model.config, 4
    shape = (8, block_size, config.num_key_value_heads, get_head_dim(config))
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    assert len(attns) == config.num_hidden_layers, (
        "each decoder layer needs one layers.attention.Attention"
    )
    for m in attns:
        m.k_cache, m.v_cache = torch.zeros(shape), torch.zeros(shape)
    try:
        tokens = torch.randint(0, config.vocab_size, (6,)).tolist()
        table = [5, 2, 7]
        slot = lambda p: table[p // block_size] * block_size + p % block_size  # noqa: E731
        with forward_context(prefill_context(
            [6], slot_mapping=torch.tensor([slot(p) for p in range(6)], dtype=torch.int32)
        )):
            model(torch.tensor(tokens), torch.arange(6))
        for step in range(3):
            tokens.append(int(torch.randint(0, config.vocab_size, ())))
            pos = len(tokens) - 1
            with forward_context(Context(
                is_prefill=False, slot_mapping=torch.tensor([slot(pos)], dtype=torch.int32),
                context_lens=torch.tensor([len(tokens)], dtype=torch.int32),
                block_tables=torch.tensor([table], dtype=torch.int32),
            )):  # fmt: skip
                got = model.compute_logits(model(torch.tensor([tokens[-1]]), torch.tensor([pos])))
            want = hf(torch.tensor([tokens])).logits[0, -1]
            assert torch.allclose(got[0], want, atol=1e-4), (
                f"[{kind}] decode step {step} logits differ from HF's while prefill may match: "
                "positions must be the absolute position of the new token"
            )
    finally:
        for m in attns:
            m.k_cache = m.v_cache = torch.tensor([])


# 3. Two ranks ----------------------------------------------------------------------------------

TP = 2


def _heads_hint(config: Any) -> str:
    return (f"each of the {TP} ranks holds num_attention_heads / {TP} = "
            f"{config.num_attention_heads // TP} query heads and num_key_value_heads / {TP} = "
            f"{config.num_key_value_heads // TP} KV heads: build QKVParallelLinear with the "
            "config's totals, then take this rank's counts from qkv_proj.num_heads and "
            "qkv_proj.num_kv_heads for the split sizes and for Attention")


def _check_heads(kind: str, heads: list[tuple[int, int]], config: Any, rank: int) -> None:
    want = (config.num_attention_heads // TP, config.num_key_value_heads // TP)
    wrong = sorted({h for h in heads if h != want})
    if wrong:
        totals = (config.num_attention_heads, config.num_key_value_heads)
        what = ("looks like the config's total head counts, not this rank's"
                if totals in wrong else "not this rank's share")
        pytest.fail(f"[{kind}] at tensor_parallel_size {TP}, rank {rank}'s Attention layers "
                    f"have (num_heads, num_kv_heads) = {wrong}: {what}; {_heads_hint(config)}",
                    pytrace=False)


@pytest.mark.parametrize("kind", KINDS)
def test_attention_holds_this_ranks_heads(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of 2 built in this process: no forward (that needs the two ranks), the shapes."""
    from myvllm.layers.attention import Attention

    config = load_hf_config(tiny_checkpoint(kind))
    pretend_rank(monkeypatch, 0, TP)
    model = _llama_class()(config)
    heads = [(m.num_heads, m.num_kv_heads) for m in model.modules() if isinstance(m, Attention)]
    _check_heads(kind, heads, config, rank=0)


@pytest.mark.slow
def test_two_ranks_over_gloo_match_hf() -> None:
    """Your model at tensor_parallel_size 2: two spawned processes over gloo, each building
    its shard from the same file and loading the checkpoint through the weight loaders; rank
    0's prefill logits against HF's."""
    module = importlib.import_module(MODULE)
    cls = _llama_class()
    prompts = random_prompts([7, 12])
    paths = [str(tiny_checkpoint(kind)) for kind in KINDS]
    ranks = run_ranks(prefill_logits, TP, paths, prompts, (MODULE, inspect.getfile(module)))
    for rank, result in enumerate(ranks):
        if isinstance(result, BaseException):
            pytest.fail(f"rank {rank} of {TP} failed before it could build the model:\n{result}",
                        pytrace=False)
    for i, kind in enumerate(KINDS):
        config = load_hf_config(paths[i])
        for rank, result in enumerate(ranks):
            _check_heads(kind, result[i]["heads"], config, rank)
            if "error" in result[i]:
                pytest.fail(f"[{kind}] at tensor_parallel_size {TP}, rank {rank} failed; "
                            f"{_heads_hint(config)}.\n{result[i]['error']}", pytrace=False)
        hf = load_hf_reference(paths[i])
        with torch.no_grad():
            want = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
        got = ranks[0][i]["logits"]
        assert got is not None and torch.allclose(torch.tensor(got), want, atol=1e-4), (
            f"[{kind}] at tensor_parallel_size {TP} rank 0's prefill logits differ from HF's "
            f"although one rank matches: sizes must be this rank's ({_heads_hint(config)}), "
            "and o_proj takes num_attention_heads * head_dim inputs in total (RowParallelLinear "
            f"keeps 1/{TP} of them per rank); {cls.__name__} must build every layer from the "
            "config, not from numbers typed in"
        )
