"""SlotStore's bulk K/V moves on their edge cases: rows that keep no tokens at all.

A drafter keeps all but the last two tokens of each row, so a group made only of rows with a
1-token prompt and their first generated token keeps zero slots: realigning or copying such rows
must be an empty operation, not a crash (issue 8).
"""

from __future__ import annotations

import torch

from batchspec.kv import SlotStore

LAYERS, ROWS, HEADS, CAPACITY, DIM = 2, 3, 2, 8, 4


def filled_store(seed: int) -> SlotStore:
    store = SlotStore(LAYERS, ROWS, CAPACITY)
    gen = torch.Generator().manual_seed(seed)
    store.data = torch.randn((LAYERS, 2, ROWS, HEADS, CAPACITY, DIM), generator=gen)
    return store


def test_gather_slots_that_keep_nothing_change_nothing():
    store = filled_store(0)
    before = store.data.clone()
    store.gather_slots(2, torch.zeros((2, 0), dtype=torch.long))
    store.gather_slots(0, torch.zeros((0, 3), dtype=torch.long))
    assert torch.equal(store.data, before)


def test_copy_rows_of_zero_width_change_nothing():
    src, dst = filled_store(0), filled_store(1)
    before = dst.data.clone()
    rows = torch.tensor([0, 2])
    dst.copy_rows(src, rows, torch.tensor([1, 0]), torch.zeros((2, 0), dtype=torch.long))
    empty = torch.zeros(0, dtype=torch.long)
    dst.copy_rows(src, empty, empty, torch.zeros((0, 4), dtype=torch.long))
    assert torch.equal(dst.data, before)


def test_copy_rows_still_moves_what_it_is_asked_to():
    """The empty case did not cost the general one: slot j of dst row b <- slot map[b, j] of src row."""
    src, dst = filled_store(0), filled_store(1)
    slot_map = torch.tensor([[0, 0, 1], [2, 3, 4]])
    dst.copy_rows(src, torch.tensor([2, 0]), torch.tensor([0, 1]), slot_map)
    for dst_row, src_row in ((0, 2), (1, 0)):
        want = src.data[:, :, src_row].index_select(3, slot_map[dst_row])
        assert torch.equal(dst.data[:, :, dst_row, :, :3], want)
