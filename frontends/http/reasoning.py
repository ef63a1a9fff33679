"""Reasoning parsers: split a `<think>...</think>` answer into `reasoning_content` and `content`,
as vLLM's and SGLang's `--reasoning-parser` do.

- `qwen3` (Qwen3, QwQ): the answer reasons only when it opens with `<think>` (or the rendered
  prompt already ends with an open `<think>`, as in Qwen3-*-Thinking-2507 templates); with
  `enable_thinking=false` the template writes an empty think block into the prompt and the answer
  is all content.
- `deepseek_r1` (DeepSeek-R1 and its distills): the template opens `<think>` in the prompt, so
  everything up to `</think>` is reasoning, and an answer without `</think>` is all reasoning.

Reasoning runs up to the first `</think>` (an answer cut off before it is all reasoning); a
leading `<think>` in the answer is dropped. `ReasoningSplitter` is the one implementation;
`split_reasoning` runs it over a whole answer, so streamed and unstreamed results agree. Tags are
matched as text: a tag split over several tokens or events is held back until it is complete.
"""
from __future__ import annotations

from typing import Optional

from frontends.http.openai_schema import field_error

REASONING_PARSERS = ("qwen3", "deepseek_r1")

THINK_START = "<think>"
THINK_END = "</think>"


def check_reasoning_parser(name: Optional[str]) -> Optional[str]:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r} (known: {', '.join(REASONING_PARSERS)})")
    return name


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Incremental split: `feed(text)` and `finish()` return (reasoning, content) pieces.
    `prompt_opened`: the rendered prompt ends inside an open `<think>` block."""

    def __init__(self, parser: str, prompt_opened: bool = False):
        check_reasoning_parser(parser)
        self.parser = parser
        self._buf = ""
        self._started = False                      # the optional leading <think> is settled
        self._thinking = parser == "deepseek_r1" or prompt_opened
        self._lead = False                         # just past </think>: drop the blank lines after it

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        if not self._started:
            stripped = self._buf.lstrip()
            if len(stripped) < len(THINK_START) and THINK_START.startswith(stripped):
                return "", ""                      # could still become <think>
            self._started = True
            if stripped.startswith(THINK_START):
                self._thinking = True
                self._buf = stripped[len(THINK_START):]
        if not self._thinking:
            out, self._buf = self._buf, ""
            return "", self._content(out)
        idx = self._buf.find(THINK_END)
        if idx >= 0:
            reasoning, content = self._buf[:idx], self._buf[idx + len(THINK_END):]
            self._buf, self._thinking, self._lead = "", False, True
            return reasoning, self._content(content)
        hold = partial_suffix(self._buf, THINK_END)
        ready, self._buf = self._buf[:len(self._buf) - hold], self._buf[len(self._buf) - hold:]
        return ready, ""

    def _content(self, text: str) -> str:
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        return text

    def finish(self) -> tuple[str, str]:
        """End of the answer: whatever is still held."""
        rest, self._buf = self._buf, ""
        if not self._started:
            self._started = True
            if rest.lstrip() == THINK_START:       # only ever a prefix of <think> is held here
                return "", ""
        return (rest, "") if self._thinking else ("", self._content(rest))


def split_reasoning(text: str, parser: str, prompt_opened: bool = False) -> tuple[Optional[str], str]:
    """(reasoning or None when there is none, content) of a whole answer."""
    s = ReasoningSplitter(parser, prompt_opened)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    reasoning = r1 + r2
    return (reasoning or None), c1 + c2


def prompt_opens_thinking(prompt_text: str) -> bool:
    """The rendered prompt ends inside an open think block (the answer starts as reasoning)."""
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_START)


# chat_template_kwargs: only these keys reach the template (CVE-2025-62426: a client could set
# `tokenize` and the like); each with the type its templates read.
TEMPLATE_KWARGS = {"enable_thinking": bool, "thinking": bool}


def template_kwargs(value: Optional[dict]) -> dict:
    """The allowed `chat_template_kwargs`; anything else is a 400 naming the key."""
    out = {}
    for key, v in (value or {}).items():
        kind = TEMPLATE_KWARGS.get(key)
        where = f"chat_template_kwargs.{key}"
        if kind is None:
            raise field_error(where, f"{where} is not allowed (allowed keys: {', '.join(TEMPLATE_KWARGS)})")
        if not isinstance(v, kind):
            raise field_error(where, f"{where} must be a {kind.__name__}")
        out[key] = v
    return out
