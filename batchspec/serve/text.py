"""Text in and out of the server: chat conversations to token ids, token ids to streamed text.

Streaming text has two traps. A token can end inside a multi-byte UTF-8 character (byte-level BPE
splits emoji and CJK characters over several tokens), so text is decoded in a sliding window and a
piece ending in an incomplete character is held back until the next token completes it. And a
stop string can arrive split over several tokens or rounds, so the tail of the text that could
still become a stop string is held back until it cannot.
"""

from __future__ import annotations

import os
from collections.abc import Sequence as Seq

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from ..errors import BatchspecError
from ..models import special_spans, tokenize, encode_prompt
from ..prompts import unicode_problem

# Stand in for message contents when the template is rendered alone, to find where each goes in the
# rendered string; only ever searched for, never tokenized.
_PLACEHOLDER = "\x00batchspec-message-{}\x00"


def encode_chat(
    tokenizer: PreTrainedTokenizerBase, messages: Seq[dict[str, str]], allow_special_tokens: bool = False
) -> list[int]:
    """Token ids of a whole conversation rendered with the chat template, ready for the assistant's turn.

    As `encode_prompt` does for one prompt, message contents are tokenized as plain text unless
    `allow_special_tokens`: a message spelling `<|im_end|>` cannot forge a turn. A single user
    message goes through `encode_prompt` itself, so the server encodes exactly as `generate` does.
    """
    if not tokenizer.chat_template:
        raise BatchspecError("this model has no chat template: use /v1/completions")
    for i, message in enumerate(messages):
        for key in ("role", "content"):
            problem = unicode_problem(message[key])
            if problem is not None:  # no tokenizer takes it (the fast ones raise a TypeError)
                raise BatchspecError(f"messages[{i}].{key}: {problem}")
    try:
        return _encode_chat(tokenizer, messages, allow_special_tokens)
    except TemplateError as err:  # templates reject conversations themselves (e.g. roles that do not alternate)
        raise BatchspecError(f"the chat template refused the conversation: {err}") from err


def _encode_chat(
    tokenizer: PreTrainedTokenizerBase, messages: Seq[dict[str, str]], allow_special_tokens: bool
) -> list[int]:
    if len(messages) == 1 and messages[0]["role"] == "user":
        return encode_prompt(tokenizer, messages[0]["content"], True, allow_special_tokens)
    rendered = _render(tokenizer, messages)
    forging = [i for i, m in enumerate(messages) if special_spans(tokenizer, m["content"])]
    if allow_special_tokens or not forging:
        # tokenized whole: pieces tokenized apart can merge differently at their seams
        return tokenize(tokenizer, rendered, split_special_tokens=False)
    marked = _render(tokenizer, [{**m, "content": _PLACEHOLDER.format(i)} for i, m in enumerate(messages)])
    pieces, spans, at = [], [], 0
    for i, message in enumerate(messages):
        before, found, marked = marked.partition(_PLACEHOLDER.format(i))
        if not found:
            break
        pieces.append(before)
        at += len(before)
        spans.append((at, at + len(message["content"])))
        at += len(message["content"])
    if len(spans) < len(messages) or "".join(p + m["content"] for p, m in zip(pieces, messages)) + marked != rendered:
        raise BatchspecError("a message spells control tokens and this model's chat template does not insert "
                             "messages verbatim, so they cannot be kept as text: pass --allow-special-tokens")
    # The template's own control tokens (found in its pieces alone, never in user text), in `rendered`.
    controls, at = [], 0
    for piece, (start, end) in zip([*pieces, marked], [*spans, (len(rendered), len(rendered))]):
        controls += [(at + s, at + e) for s, e in special_spans(tokenizer, piece)]
        at = end
    # Each forging message is tokenized with control-token parsing off, together with the template
    # text around it up to the template's nearest control tokens (no seam inside ordinary text).
    regions: list[list[int]] = []
    for i in forging:
        start, end = spans[i]
        head = max((e for _, e in controls if e <= start), default=0)
        tail = min((s for s, _ in controls if s >= end), default=len(rendered))
        if regions and head <= regions[-1][1]:
            regions[-1][1] = max(regions[-1][1], tail)
        else:
            regions.append([head, tail])
    ids, at = [], 0
    for head, tail in regions:
        ids += tokenize(tokenizer, rendered[at:head], split_special_tokens=False)
        ids += tokenize(tokenizer, rendered[head:tail], split_special_tokens=True)
        at = tail
    return ids + tokenize(tokenizer, rendered[at:], split_special_tokens=False)


def _render(tokenizer: PreTrainedTokenizerBase, messages: Seq[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)


class Detokenizer:
    """Token ids to text, one token at a time, as `decode(all ids)` would spell it.

    Each token's text is the difference between decoding a short window of recent ids with and
    without it (decoding a token alone loses the spacing some decoders derive from its neighbours);
    a difference ending in U+FFFD is an incomplete character and waits for the next token.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start: context for the decoder
        self.read = 0  # ids before this are already text

    def push(self, token: int) -> str:
        self.ids.append(token)
        done = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(done) :]
        return ""

    def flush(self) -> str:
        """What is held back (an incomplete character at the very end is spelled as U+FFFD)."""
        done = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(done) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""


class TextStream:
    """One request's output text: tokens in, text ready to send out, and where a stop string ends it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Seq[str] = ()) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        self.stop = [s for s in stop if s]
        self.text = ""  # the output so far (cut before a stop string once one is found)
        self.sent = 0  # characters of `text` handed out
        self.token_ids: list[int] = []  # tokens that made `text` (up to the one completing a stop string)
        self.stopped = False

    def add(self, tokens: Seq[int]) -> str:
        """Take a round's tokens; returns the text that can be sent now. After a stop string is
        found (`stopped`) later tokens are ignored: the request is over."""
        for token in tokens:
            if self.stopped:
                break
            self.token_ids.append(token)
            before = len(self.text)
            self.text += self.detokenizer.push(token)
            if self.stop and len(self.text) > before:
                self._find_stop(before)
        end = len(self.text) if self.stopped else len(self.text) - self._partial_stop()
        return self._take(end)

    def finish(self) -> str:
        """The rest of the text once the request has ended."""
        if not self.stopped:
            before = len(self.text)
            self.text += self.detokenizer.flush()
            if self.stop:
                self._find_stop(before)
        return self._take(len(self.text))

    def _find_stop(self, new_from: int) -> None:
        """Cut `text` before the earliest stop string that overlaps text added from `new_from` on."""
        longest = max(map(len, self.stop))
        start = max(0, new_from - longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _partial_stop(self) -> int:
        """Length of the longest tail of `text` that a stop string starts with (held back)."""
        for n in range(min(len(self.text), max(map(len, self.stop), default=0) - 1), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _take(self, end: int) -> str:
        end = max(end, self.sent)
        piece, self.sent = self.text[self.sent : end], end
        return piece


class TokenSpeller:
    """Tokens as logprobs name them: each as the text it adds after the tokens before it (decoded with
    a few of them, as `Detokenizer` does: a token decoded alone loses the spacing some decoders derive
    from its neighbours), special tokens spelled out, and a piece of a multi-byte character as U+FFFD.
    The alternatives at a position are spelled after the same tokens as the chosen one."""

    CONTEXT = 4  # preceding tokens decoded with each token

    def __init__(self, tokenizer: PreTrainedTokenizerBase, before: Seq[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.before = list(before)[-self.CONTEXT :]

    def spell(self, tokens: Seq[int]) -> list[str]:
        """Each of `tokens` as the text it would add at the current position."""
        base = self._decode(self.before)
        spelled = []
        for token in tokens:
            text = self._decode([*self.before, token])
            spelled.append(text[len(os.path.commonprefix([base, text])) :])
        return spelled

    def push(self, token: int) -> None:
        """`token` was chosen: the next position follows it."""
        self.before = [*self.before, token][-self.CONTEXT :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
