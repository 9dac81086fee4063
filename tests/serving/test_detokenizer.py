"""The incremental detokenizer: deltas that are right across multi-byte characters and merged
(SentencePiece) tokens, and stop strings that span tokens and end at the right character."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers_models import save_byte_tokenizer
from myvllm.serving.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Token i is byte i: every character outside ASCII spans several tokens; eos is byte 0."""
    from transformers import AutoTokenizer

    path: Path = tmp_path_factory.mktemp("byte_tokenizer")
    save_byte_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


SP_WORDS = ["▁Hello", "▁world", "!", "▁", "He", "llo", "▁wor", "ld"]


@pytest.fixture(scope="module")
def sp_tokenizer() -> Any:
    """A SentencePiece-style tokenizer (as Llama 2's): "▁" marks a word's leading space, which
    the decoder strips at the start of a string, and bytes fall back to <0xNN> tokens."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({w: 259 + i for i, w in enumerate(SP_WORDS)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def sp_ids(*pieces: str) -> list[int]:
    """Ids of SentencePiece pieces; a non-word piece is spelled as its UTF-8 bytes."""
    ids = []
    for piece in pieces:
        if piece in SP_WORDS:
            ids.append(259 + SP_WORDS.index(piece))
        else:
            ids.extend(3 + b for b in piece.encode())
    return ids


def stream(detok: IncrementalDetokenizer, token_ids: list[int],
           chunks: int = 1) -> list[str]:
    """Feed token_ids `chunks` at a time (as steps hand them over); deltas, finish() last."""
    deltas = []
    for i in range(0, len(token_ids), chunks):
        deltas.append(detok.add_tokens(token_ids[i:i + chunks]))
        if detok.stopped:
            break
    deltas.append(detok.finish())
    return deltas


def test_multi_byte_characters_come_out_whole(byte_tokenizer: Any) -> None:
    text = "a€ 日本語 🙂!"
    ids = list(text.encode())
    detok = IncrementalDetokenizer(byte_tokenizer, prompt_token_ids=list(b"Hi "))
    deltas = stream(detok, ids)
    assert "".join(deltas) == text == detok.output_text
    assert not any("\ufffd" in d for d in deltas)
    # Each character appears in the step of its last byte, and not before.
    assert deltas[:4] == ["a", "", "", "€"]
    assert detok.num_tokens == len(ids)


def test_merged_tokens_keep_their_spaces(sp_tokenizer: Any) -> None:
    prompt = sp_ids("▁Hello")
    completion = sp_ids("▁world", "€", "!", "▁wor", "ld")
    detok = IncrementalDetokenizer(sp_tokenizer, prompt)
    deltas = stream(detok, completion)
    # Decoded one by one the tokens lose their spaces ("world", "wor"); in context they do not.
    assert "".join(deltas) == " world€! world"
    assert deltas[:5] == [" world", "", "", "€", "!"]
    full = sp_tokenizer.decode(prompt + completion, skip_special_tokens=True)
    assert full == sp_tokenizer.decode(prompt) + "".join(deltas)
    # Several steps' tokens at once (a front end that fell behind): one window, same text.
    for chunks in (2, 3, len(completion)):
        merged = stream(IncrementalDetokenizer(sp_tokenizer, prompt), completion, chunks)
        assert "".join(merged) == " world€! world"


def test_special_tokens_are_skipped(sp_tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(sp_tokenizer, [1] + sp_ids("▁Hello"))
    assert "".join(stream(detok, sp_ids("!") + [2])) == "!"
    assert detok.num_tokens == 2


def test_partial_character_at_the_end_is_flushed_like_a_full_decode(byte_tokenizer: Any) -> None:
    ids = list("ok€".encode())[:-1]  # the request ended (max_tokens) inside "€"
    detok = IncrementalDetokenizer(byte_tokenizer, [])
    deltas = stream(detok, ids)
    assert deltas[-1] != "" and "".join(deltas) == byte_tokenizer.decode(ids)


def test_stop_string_spanning_tokens_ends_output_right_before_it(byte_tokenizer: Any) -> None:
    text = "Thought: go. Observation: sunny"
    detok = IncrementalDetokenizer(byte_tokenizer, [], stop=["Observation:"])
    deltas = stream(detok, list(text.encode()))
    assert detok.stopped and detok.stop_string == "Observation:"
    assert "".join(deltas) == detok.output_text == "Thought: go. "
    # The tokens after the stop string's last one are not consumed.
    assert detok.num_tokens == len("Thought: go. Observation:")
    # "Obs..." was held back while it could still become the stop string, never emitted.
    assert all("O" not in d for d in deltas)


def test_held_back_text_that_is_not_a_stop_string_comes_out(byte_tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer, [], stop=["END"])
    deltas = stream(detok, list(b"the EN"))
    assert deltas[-3:] == ["", "", "EN"]  # "E", "EN" held back until finish()
    assert "".join(deltas) == "the EN" and not detok.stopped


def test_stop_string_inside_one_merged_token(sp_tokenizer: Any) -> None:
    # "llo" ends inside the token "llo"... and "o w" spans two tokens.
    detok = IncrementalDetokenizer(sp_tokenizer, [], stop=["o w"])
    deltas = stream(detok, sp_ids("He", "llo", "▁world"), chunks=3)
    assert "".join(deltas) == "Hell" and detok.stopped


def test_multi_byte_stop_string(byte_tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer, [], stop=["€"])
    assert "".join(stream(detok, list("5 € each".encode()))) == "5 "


def test_bad_stop_strings_are_refused(byte_tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(byte_tokenizer, [], stop=[""])


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=24),
       cut=st.tuples(st.integers(0, 24), st.integers(1, 6)), chunks=st.integers(1, 4))
def test_stream_equals_full_decode_cut_at_first_stop(byte_tokenizer: Any, text: str,
                                                     cut: tuple[int, int], chunks: int) -> None:
    """Any text, any stop string taken from it, any number of tokens per step: the deltas
    add up to the text cut right before the stop string's first occurrence."""
    start, length = cut
    stop = text[start:start + length]
    detok = IncrementalDetokenizer(byte_tokenizer, [], stop=[stop] if stop else [])
    deltas = stream(detok, list(text.encode()), chunks)
    expected = text[:text.find(stop)] if stop else text
    assert "".join(deltas) == detok.output_text == expected
    assert not any("\ufffd" in d for d in deltas)
