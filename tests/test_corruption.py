"""The symptom detectors the audit reports next to exact match: corruption flags and ROUGE-L."""

from __future__ import annotations

import pytest

from batchspec.forensics.corruption import corruption_flags, count_unknown, find_loop
from batchspec.forensics.rouge import rouge_l

STOP = frozenset({1})


def test_corruption_flags_only_for_symptoms_the_oracle_lacks() -> None:
    assert find_loop([3, 4, 5, 5, 5, 5, 6]).repeats == 4
    assert find_loop([3, 4, 3, 4, 3, 4, 3, 4, 9]).size == 2
    assert find_loop([3, 4, 5, 3, 4, 5]) is None
    oracle = [3, 4, 5, 6, 1]
    flags = corruption_flags([3, 7, 7, 7, 7, 2, 2], "x \ufffd", oracle, "x", STOP, unk_id=2)
    assert flags == {"repetition_loop": True, "unknown_tokens": True, "empty": False, "beyond_eos": False}
    flags = corruption_flags([1, 8], "", oracle, "x", STOP, unk_id=2)
    assert flags["empty"] and flags["beyond_eos"]
    looping_oracle = [3, 3, 3, 3, 3, 3]
    assert not corruption_flags(looping_oracle, "", looping_oracle, "", STOP, 2)["repetition_loop"]


def test_ids_outside_the_tokenizer_vocabulary_are_unknown_tokens() -> None:
    assert count_unknown([3, 120, 4, -1], "", unk_id=2, vocab_size=101) == 2
    assert count_unknown([3, 120], "", unk_id=2) == 0  # no vocabulary given: only <unk> and U+FFFD count
    flags = corruption_flags([3, 4, 120], "x y", [3, 4, 5], "x y z", STOP, unk_id=2, vocab_size=101)
    assert flags["unknown_tokens"]


def test_rouge_l_barely_notices_a_swapped_word() -> None:
    reference = "the cat sat on the mat and then it slept in the warm sun all day"
    assert rouge_l(reference, reference) == 1.0
    assert rouge_l(reference.replace("slept", "not not"), reference) > 0.9
    assert rouge_l("", reference) == 0.0 and rouge_l("", "") == 1.0
    assert rouge_l("猫が寝た", "猫が寝る") == pytest.approx(2 * 0.75 * 0.75 / 1.5)
