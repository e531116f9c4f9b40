"""Detectors for the symptoms a desynchronised batch leaves in its output.

Published batched speculative decoders that lose track of positions or KV entries do not crash:
they repeat themselves ("not not not not"), emit unknown tokens (`<unk><unk>`, U+FFFD), stop at once,
or keep going after the end-of-sequence token. Each detector is a pure function of token ids / text.

Greedy decoding of small models loops on its own, and byte-level tokenizers emit U+FFFD when a
multi-byte character is cut off by the token budget, so `corruption_flags` raises a flag only for a
symptom the oracle (plain decoding of the same prompt) does not share.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class Loop:
    """An n-gram of `size` tokens repeated `repeats` times back to back from `start`."""

    start: int
    size: int
    repeats: int

    @property
    def covered(self) -> int:
        return self.size * self.repeats


def find_loop(tokens: Sequence[int], max_size: int = 8, min_repeats: int = 4) -> Loop | None:
    """The loop covering the most tokens, or None if no n-gram of at most `max_size` tokens repeats
    `min_repeats` times in a row. Ties go to the shorter n-gram."""
    best: Loop | None = None
    for size in range(1, max_size + 1):
        run = 0  # how many consecutive i satisfy tokens[i] == tokens[i + size]
        for i in range(len(tokens) - size + 1):
            if i + size < len(tokens) and tokens[i] == tokens[i + size]:
                run += 1
                continue
            # tokens[i - run : i + size] has period `size`
            repeats = (run + size) // size
            if repeats >= min_repeats and (best is None or repeats * size > best.covered):
                best = Loop(i - run, size, repeats)
            run = 0
    return best


def count_unknown(tokens: Sequence[int], text: str, unk_id: int | None, vocab_size: int | None = None) -> int:
    """Unknown-token ids, ids outside the tokenizer's vocabulary [0, vocab_size) (a model may score
    more ids than its tokenizer knows, e.g. a padded LM head) and U+FFFD characters in the text."""
    unknown = sum(1 for t in tokens if t == unk_id or (vocab_size is not None and not 0 <= t < vocab_size))
    return unknown + text.count(REPLACEMENT_CHAR)


def tokens_after_stop(tokens: Sequence[int], stop_ids: Collection[int]) -> int:
    """How many tokens follow the first stop token (0 if there is none)."""
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return len(tokens) - i - 1
    return 0


def content_length(tokens: Sequence[int], stop_ids: Collection[int]) -> int:
    """Tokens before the first stop token: what a reader of the output actually gets."""
    return len(tokens) - tokens_after_stop(tokens, stop_ids) - any(t in stop_ids for t in tokens)


def corruption_flags(
    audited: Sequence[int],
    audited_text: str,
    oracle: Sequence[int],
    oracle_text: str,
    stop_ids: Collection[int],
    unk_id: int | None,
    vocab_size: int | None = None,
) -> dict[str, bool]:
    """Symptoms of corruption in an audited output that its oracle does not show.

    - repetition_loop: its longest back-to-back n-gram loop covers more tokens than the oracle's;
    - unknown_tokens: more unknown ids (`unk_id`, or outside [0, vocab_size)) / U+FFFD than the oracle;
    - empty: nothing before the first stop token, while the oracle has content;
    - beyond_eos: tokens after a stop token (plain decoding never produces any).
    """
    audited_loop, oracle_loop = find_loop(audited), find_loop(oracle)
    loop_cover = audited_loop.covered if audited_loop else 0
    return {
        "repetition_loop": loop_cover > (oracle_loop.covered if oracle_loop else 0),
        "unknown_tokens": count_unknown(audited, audited_text, unk_id, vocab_size)
        > count_unknown(oracle, oracle_text, unk_id, vocab_size),
        "empty": content_length(audited, stop_ids) == 0 and content_length(oracle, stop_ids) > 0,
        "beyond_eos": tokens_after_stop(audited, stop_ids) > 0,
    }
