"""IncrementalDetokenizer: streamed text equals one decode of all the ids, with and without its
fast path (the Rust tokenizer's own decode, taken only when it is exactly tokenizer.decode)."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from jax_engine.decode.detokenizer import IncrementalDetokenizer, _backend_decode

WORDS = ["hello", "world", "caf\u00e9", "\u00fcber", "na\u00efve", "\u65e5\u672c", "x"]


def byte_level_tokenizer() -> TokenizersBackend:
    """Byte-level BPE with only single-byte tokens plus a few words: multi-byte characters span
    several tokens, so the detokenizer must hold back incomplete UTF-8."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(sorted(alphabet))}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return TokenizersBackend(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


class Overriding(TokenizersBackend):
    def _decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None, **kw):
        return super()._decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces, **kw).upper()


@pytest.mark.parametrize("skip", [True, False])
def test_streamed_text_equals_one_decode_on_both_paths(skip):
    tok = byte_level_tokenizer()
    text = " ".join(WORDS) + " \U0001F600 end"
    ids = [0] + tok.encode(text, add_special_tokens=False) + [1]
    want = tok.decode(ids[3:], skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    for fast in (True, False):
        d = IncrementalDetokenizer(tok, ids[:3], skip, [], False)
        assert d._fast is not None
        if not fast:
            d._fast = None
        got = ""
        for t in ids[3:]:
            d.add(t)
            got += d.take(False)
        got += d.take(True)
        assert got == want


def test_fast_path_only_when_decode_is_not_overridden():
    tok = byte_level_tokenizer()
    assert _backend_decode(tok, True) is not None
    over = Overriding(tokenizer_object=tok._tokenizer)
    assert _backend_decode(over, True) is None
    ids = over.encode("hello", add_special_tokens=False)
    d = IncrementalDetokenizer(over, [], True, [], False)
    for t in ids:
        d.add(t)
    assert d.take(True) == over.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("skip", [True, False])
def test_runs_added_together_stream_the_same_text(skip):
    """add_many (speculation's accepted runs) streams what one add per token streams, runs
    split anywhere, inside multi-byte characters included."""
    import random

    tok = byte_level_tokenizer()
    text = " ".join(WORDS) + " \U0001F600 end \u65e5\u672c"
    ids = [0] + tok.encode(text, add_special_tokens=False) + [1]
    want = tok.decode(ids[3:], skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    rng = random.Random(3)
    for _ in range(20):
        d = IncrementalDetokenizer(tok, ids[:3], skip, [], False)
        got, i = "", 3
        while i < len(ids):
            n = rng.randint(1, 9)
            d.add_many(ids[i:i + n])
            got += d.take(False)
            assert want.startswith(got)
            i += n
        assert got + d.take(True) == want
    with pytest.raises(ValueError, match="stop strings"):
        IncrementalDetokenizer(tok, [], skip, ["end"], False).add_many([5])
