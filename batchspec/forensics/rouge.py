"""ROUGE-L (longest-common-subsequence F1) between two texts.

The audit reports it next to exact match to show how little a text-overlap metric notices: a
desynchronised batch that repeats or garbles a few words still scores high. Written here rather than
taken from `rouge-score`, whose default tokenizer keeps only [a-z0-9] (it scores any Chinese or
Japanese output as empty) and which would pull in nltk and absl for thirty lines of arithmetic.
"""

from __future__ import annotations

import re

# CJK ideographs, kana and hangul are scored one character at a time (there are no spaces to split
# on); everything else by runs of word characters, lowercased, punctuation ignored.
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_TOKEN = re.compile(rf"[{_CJK}]|[^\W{_CJK}]+")


def words(text: str) -> list[str]:
    """The units ROUGE-L compares."""
    return _TOKEN.findall(text.lower())


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence (one DP row, O(len(a) * len(b)) time)."""
    if len(a) < len(b):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0
        for j, y in enumerate(b, start=1):
            above = row[j]
            row[j] = diagonal + 1 if x == y else max(row[j], row[j - 1])
            diagonal = above
    return row[-1]


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 of `candidate` against `reference`: 1.0 for identical word sequences (also when
    both are empty), 0.0 when they share no word."""
    cand, ref = words(candidate), words(reference)
    if not cand and not ref:
        return 1.0
    common = lcs_length(cand, ref)
    if common == 0:
        return 0.0
    precision, recall = common / len(cand), common / len(ref)
    return 2 * precision * recall / (precision + recall)
