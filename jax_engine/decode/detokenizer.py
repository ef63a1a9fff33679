"""Incremental detokenization and stop-string matching.

Decoding each new token alone breaks multi-byte characters and SentencePiece spacing, so we
decode a short window (prefix_offset..end) and emit only what extends the previously decoded
window, holding back text that ends in an incomplete UTF-8 sequence ("\ufffd"). Text that could
still become the start of a stop string is also held back until it is decided.
"""
from __future__ import annotations

from typing import Any, Callable, Optional


def _backend_decode(tokenizer: Any, skip_special_tokens: bool) -> Optional[Callable[[list[int]], str]]:
    """The Rust tokenizer's own decode when it is exactly what tokenizer.decode(ids,
    skip_special_tokens, clean_up_tokenization_spaces=False) returns: a transformers
    TokenizersBackend whose _decode is not overridden (it then calls the backend and only cleans
    up spaces on request; spaces_between_special_tokens does not apply to it). Why: decode()
    first converts the ids through to_py_obj, ~3.4 against ~1.1 us per call, and a decode step
    calls it twice per sequence."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(tokenizer, TokenizersBackend) or type(tokenizer)._decode is not TokenizersBackend._decode \
            or backend is None:
        return None
    return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool, stops: list[str],
                 include_stop: bool, spaces_between_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.spaces = spaces_between_special_tokens
        self.stops = stops
        self.include_stop = include_stop
        self.ids: list[int] = list(prompt_ids[-6:])   # a little context for correct spacing
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""          # all decoded output text
        self.emitted = 0        # chars of `text` already handed out
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.stopped = False
        self._fast = _backend_decode(tokenizer, skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast(ids)
        return self.tok.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False,
                               spaces_between_special_tokens=self.spaces)

    def _advance(self) -> Optional[int]:
        """Decode what the ids appended since the last read added: the text's length before it
        when text grew, None when it did not (nothing new, or it ends inside a UTF-8 character)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        start = len(self.text)
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return start

    def add(self, token_id: int) -> Optional[str]:
        """Append a token; returns the matched stop string if generation must stop."""
        self.ids.append(token_id)
        start = self._advance()
        if start is not None and self.stops:
            # only the region new text could complete needs searching
            window_start = max(0, start - self._hold)
            best = None
            for s in self.stops:
                i = self.text.find(s, window_start)
                if i != -1 and (best is None or i < best[0]):
                    best = (i, s)
            if best is not None:
                i, s = best
                self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
                self.stopped = True
                return s
        return None

    def add_many(self, token_ids: list[int]) -> None:
        """Append several tokens of a request without stop strings (speculation emits up to
        k + 1 a step): what add does for each, with two decodes for the run instead of two per
        token. The text is the same; a run that ends inside a UTF-8 character holds the whole
        run's text until a later token completes it (add would hand out the run's earlier
        characters first)."""
        if self.stops:
            raise ValueError("add_many is for requests without stop strings (add checks each token)")
        if token_ids:
            self.ids.extend(token_ids)
            self._advance()

    def take(self, final: bool) -> str:
        """New text safe to emit (all of it when `final`, incomplete UTF-8 included)."""
        if final and not self.stopped and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            self.text += full[len(prefix):]
            self.read_offset = len(self.ids)
        end = len(self.text) if final or not self.stops else max(self.emitted, len(self.text) - self._hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
