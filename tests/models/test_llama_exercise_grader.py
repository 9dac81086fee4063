"""The Llama exercise's grader (test_llama_exercise.py) catches the mistakes a learner makes.

Each test writes a broken llama.py (the reference file with one step changed) to a temporary
directory, puts it in place of myvllm.models.llama, and runs the grader's own checks on it:
the grader must fail, with a message that names the mistake.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import test_llama_exercise as grader
from helpers_models import load_hf_reference, tiny_checkpoint

import myvllm.models.llama as reference
from myvllm.utils.hf_config import load_hf_config
from myvllm.utils.loader import load_model

# The reference lines each mistake changes. If llama.py is rewritten, change them here.
# (The norms are the decoder layer's, in models/decoder.py: a learner's llama.py cannot skip
# one, so no variant here does; the grader still names a skipped norm if its output says so.)
RoPE_CALL = "        q, k = self.rotary_emb(positions, q, k)\n"
RANK_HEADS = ("        self.num_heads = self.qkv_proj.num_heads  # this rank's share\n"
              "        self.num_kv_heads = self.qkv_proj.num_kv_heads\n")

SKIPS_ROPE = (RoPE_CALL, "")
# RoPE applied to v: beside q and k, or in place of k.
ROTATES_V_TOO = (RoPE_CALL, RoPE_CALL + "        _, v = self.rotary_emb(positions, q, v)\n")
ROTATES_V_NOT_K = (RoPE_CALL, "        q, v = self.rotary_emb(positions, q, v)\n")
TOTAL_HEADS = (RANK_HEADS, "        self.num_heads = config.num_attention_heads\n"
                           "        self.num_kv_heads = config.num_key_value_heads\n")


def install_variant(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                    change: tuple[str, str]) -> ModuleType:
    """llama.py with `change` (old, new) applied, imported as myvllm.models.llama."""
    source = Path(reference.__file__).read_text()
    old, new = change
    assert source.count(old) == 1, f"llama.py no longer has the line this test breaks: {old!r}"
    path = tmp_path / "llama.py"
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location(grader.MODULE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, grader.MODULE, module)
    spec.loader.exec_module(module)
    return module


def loaded(kind: str) -> tuple[str, object, object]:
    """What the grader's `loaded` fixture gives, built from the installed llama.py."""
    model = grader._build(kind)
    load_model(model, tiny_checkpoint(kind))
    return kind, model, load_hf_reference(tiny_checkpoint(kind))


@pytest.mark.parametrize(("change", "message"), [
    (SKIPS_ROPE, "looks like RoPE is not applied"),
], ids=["skips_rope"])
def test_a_skipped_step_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                 change: tuple[str, str], message: str) -> None:
    install_variant(monkeypatch, tmp_path, change)
    model = loaded("llama")
    grader.test_attention_takes_the_layer_norm(model)  # passes: the contract's shapes hold
    grader.test_rope_matches_hf(model)  # passes: the RoPE module is right, used or not
    with pytest.raises(pytest.fail.Exception, match=message):
        grader.test_first_decoder_layer_matches_hf(model)


@pytest.mark.parametrize("change", [ROTATES_V_TOO, ROTATES_V_NOT_K],
                         ids=["rotates_q_k_and_v", "rotates_q_and_v"])
def test_rope_on_v_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                            change: tuple[str, str]) -> None:
    install_variant(monkeypatch, tmp_path, change)
    model = loaded("llama")
    grader.test_rope_matches_hf(model)  # passes: the RoPE module is right, misused or not
    message = "looks like RoPE is applied to v"
    with pytest.raises(pytest.fail.Exception, match=message):
        grader.test_values_are_not_rotated(model)
    with pytest.raises(pytest.fail.Exception, match=message):
        grader.test_first_decoder_layer_matches_hf(model)
    with pytest.raises(pytest.fail.Exception, match=message):
        grader.test_prefill_logits_match_hf(model)


def test_the_reference_passes_the_layer_check() -> None:
    """The other side of the tests above: nothing is flagged on a right llama.py."""
    grader.test_values_are_not_rotated(loaded("llama3"))
    grader.test_first_decoder_layer_matches_hf(loaded("llama3"))


def test_total_head_counts_pass_one_rank_and_are_caught_at_two(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    install_variant(monkeypatch, tmp_path, TOTAL_HEADS)
    grader.test_prefill_logits_match_hf(loaded("llama"))  # one rank cannot see it
    with pytest.raises(pytest.fail.Exception,
                       match="looks like the config's total head counts, not this rank's"):
        grader.test_attention_holds_this_ranks_heads("llama", monkeypatch)


@pytest.mark.slow
def test_total_head_counts_fail_the_two_rank_run(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    """The ranks are spawned processes: they build the variant from its file, as the grader
    hands it to them."""
    install_variant(monkeypatch, tmp_path, TOTAL_HEADS)
    config = load_hf_config(tiny_checkpoint("llama"))
    with pytest.raises(pytest.fail.Exception, match=(
            rf"rank 0's Attention layers have \(num_heads, num_kv_heads\) = "
            rf"\[\({config.num_attention_heads}, {config.num_key_value_heads}\)\]: looks "
            "like the config's total head counts")):
        grader.test_two_ranks_over_gloo_match_hf()
