"""`PrefixCache`: K/V of token blocks prefilled before, reused when a new row's prompt starts the same.

What is kept: the K/V (all layers, K and V) of full blocks of BLOCK_TOKENS tokens from slot 0 of a row,
one [layers, 2, heads, block, dim] tensor per block, under a byte budget with least-recently-used
eviction. Rows of different models (the target and its drafter) share one cache and one budget, each
model under its own `space` name.

Keys: a hash chain of blocks, stored as a flat dict keyed by (space, the parent block's serial number,
this block's token ids). A block's K/V depends on every token before it, so its key names the whole
prefix: the parent's serial stands for the tokens before the block (serials are never reused, and
the root's is 0), the ids tuple for the block's own. The dict compares the ids tuple (and the serial)
on every hash match, so a hash collision can never hand out another prefix's K/V. A radix tree at
token granularity would match partial blocks too, but fixed blocks make every entry the same size
(one tensor, one budget unit, one eviction step), and what a partial match would save is less than a
block of prefill; a lookup is one dict probe per block.

Block size: 16 tokens, as vLLM's default. A prompt's uncached tail of up to BLOCK_TOKENS - 1 tokens is
recomputed; on a CPU prefilling 40-100 tokens/s that is up to ~0.15-0.4 s of a request's first token at
16 (32 would double it), while smaller blocks would only add entries (a 1,000-token prefix is 62
blocks, each a dict probe and one tensor copy when filled).

Eviction order keeps chains whole: a lookup or insert touches a chain from its last block to its
first, so a block is always more recently used than its children, and the least recently used block
never has a cached child. An insert never evicts the chain it extends (when the budget cannot hold
more of it, it stops).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .slots import SlotStore

BLOCK_TOKENS = 16
_ROOT = 0  # the parent serial of a prompt's first block

# (space, parent block's serial, this block's token ids)
_Key = tuple[str, int, tuple[int, ...]]


@dataclass(eq=False)
class _Block:
    serial: int
    key: _Key
    kv: torch.Tensor  # [layers, 2, heads, block, dim]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class PrefixCache:
    """Blocks of K/V under `budget_bytes` (only the tensors count: a key is a few dozen integers)."""

    def __init__(self, budget_bytes: int, block: int = BLOCK_TOKENS) -> None:
        self.budget = budget_bytes
        self.block = block
        self.bytes = 0
        self._blocks: OrderedDict[_Key, _Block] = OrderedDict()  # least recently used first
        self._serials = itertools.count(_ROOT + 1)
        self.evicted = 0  # blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def _chain(self, space: str, ids: list[int]) -> list[_Block]:
        """The cached blocks of the longest cached prefix of `ids` made of full blocks, in order."""
        chain: list[_Block] = []
        parent = _ROOT
        for start in range(0, len(ids) - self.block + 1, self.block):
            found = self._blocks.get((space, parent, tuple(ids[start : start + self.block])))
            if found is None:
                break
            chain.append(found)
            parent = found.serial
        return chain

    def _touch(self, chain: list[_Block]) -> None:
        """Most recently used, the chain's first block last (see the module docstring)."""
        for entry in reversed(chain):
            self._blocks.move_to_end(entry.key)

    def fill(self, space: str, ids: list[int], store: SlotStore, row: int, limit: int) -> int:
        """Write the K/V of the longest cached prefix of `ids`, at most `limit` tokens, into slots
        [0, n) of `store`'s row `row`; returns n (0: nothing cached)."""
        chain = self._chain(space, ids)
        n = min(len(chain) * self.block, limit)
        if n <= 0:
            return 0
        self._touch(chain)
        for i, entry in enumerate(chain[: -(-n // self.block)]):  # the last block may be cut short
            start = i * self.block
            store.write_slots(row, start, entry.kv[:, :, :, : min(self.block, n - start)])
        return n

    def insert(self, space: str, ids: list[int], store: SlotStore, row: int) -> None:
        """Keep the K/V of every full block of `ids`, which `store`'s row `row` holds from slot 0, that
        is not cached yet, evicting least recently used blocks to stay within the budget."""
        chain = self._chain(space, ids)
        self._touch(chain)  # the blocks this insert extends are evicted last
        parent = chain[-1].serial if chain else _ROOT
        for start in range(len(chain) * self.block, len(ids) - self.block + 1, self.block):
            kv = store.row_kv(row, start, self.block).clone()
            entry = _Block(next(self._serials), (space, parent, tuple(ids[start : start + self.block])), kv)
            if not self._make_room(entry.nbytes, chain):
                break
            self._blocks[entry.key] = entry
            self.bytes += entry.nbytes
            chain.append(entry)
            parent = entry.serial
        self._touch(chain)

    def _make_room(self, size: int, keep: list[_Block]) -> bool:
        """Evict least recently used blocks until `size` more bytes fit, never one of `keep` (they
        were touched last, so reaching one means only they are left); False if it cannot."""
        if size > self.budget:
            return False
        kept = {entry.serial for entry in keep}
        while self.bytes + size > self.budget:
            oldest = next(iter(self._blocks.values()))
            if oldest.serial in kept:
                return False
            del self._blocks[oldest.key]
            self.bytes -= oldest.nbytes
            self.evicted += 1
        return True

    def chains_intact(self) -> bool:
        """Every cached block's parent is cached (eviction only ever takes blocks without children)."""
        serials = {entry.serial for entry in self._blocks.values()} | {_ROOT}
        return all(key[1] in serials for key in self._blocks)
