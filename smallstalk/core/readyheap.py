# cython: annotation_typing=False
# (The compiled build: its ints are Python ints of any size, not C ones.)
"""A tube's ready heap: its ready jobs' entries ordered by (pri, id), each
carrying the job's gen so that an entry the job has left is known stale.

An entry is one int, `pri << 96 | id << 32 | gen & M32`: smaller than a
(pri, id, gen) tuple, and compared in one step. Code that reads a heap's
entries itself (the read side's listings, `explain`, `search`, the heaps'
compaction) takes them apart with `entry_id`, `entry_pri` and
`entry_has_gen`, and makes a cursor with `entry_of`.
Entries are never removed in the middle: a reserve or a move leaves its old
entry behind, and the reader at the top drops it (`Queries._top_ready`);
`State.compact_heaps` rebuilds a heap that stale entries outgrow.

`ListHeap`, a list kept in heapq's order, is the reference and what the
pure build runs as `ReadyHeap`. The compiled build runs its twin,
`readyarray.pyx`: the same methods over a C array of 128-bit entries, where
reading the top's id and gen, a push and a pop make no int objects and
call no Python function (here each is arithmetic on multi-word ints and a
call of heapq's)."""

from __future__ import annotations

from collections.abc import Iterable
from heapq import heapify, heappop, heappush

# Masks of an entry's fields (core/model.py shares them with the rest).
M32 = (1 << 32) - 1
M64 = (1 << 64) - 1


def entry_of(pri: int, id: int, gen: int) -> int:
    """The entry of job `id` at `pri` (gen: the job's, unmasked)."""
    return (pri << 96) | (id << 32) | (gen & M32)


def entry_id(entry: int) -> int:
    """The id of the job `entry` was made for."""
    return (entry >> 32) & M64


def entry_pri(entry: int) -> int:
    """The priority `entry` orders its job by."""
    return entry >> 96


def entry_has_gen(entry: int, gen: int) -> bool:
    """Was `entry` made with this gen (a job's, unmasked)? Where not, the job
    has left the state the entry put it in: the entry is stale."""
    return (gen & M32) == entry & M32


class ListHeap(list):
    """Entries (ints) in heapq's order; a list, so that `len`, indexing (a
    walk of the heap's tree) and iteration (the entries, in the array's
    order) read it as before."""

    __slots__ = ()

    def __init__(self, keys: Iterable[int] = ()) -> None:
        super().__init__(keys)
        heapify(self)

    def push(self, pri: int, id: int, gen: int) -> None:
        """Add the entry of a job that is ready now (gen: the job's, unmasked)."""
        heappush(self, (pri << 96) | (id << 32) | (gen & M32))  # entry_of, inlined: every put

    def add_unordered(self, pri: int, id: int, gen: int) -> None:
        """Add an entry without keeping the heap's order, for a snapshot's
        load of many: `reorder` before the heap is read or pushed to again."""
        self.append((pri << 96) | (id << 32) | (gen & M32))  # entry_of, inlined: per job

    def reorder(self) -> None:
        """Restore the heap's order after `add_unordered` (one heapify)."""
        heapify(self)

    def top_id(self) -> int:
        """The id of the top entry's job; 0 (no job's id) when empty."""
        return (self[0] >> 32) & M64 if self else 0  # entry_id, inlined: every reserve

    def top_has_gen(self, gen: int) -> bool:
        """Was the top entry pushed with this gen (a job's, unmasked)? Where
        not, the job has left the state the entry put it in: the entry is stale."""
        return (gen & M32) == self[0] & M32  # entry_has_gen, inlined: every reserve

    def drop_top(self) -> None:
        """Drop the top entry."""
        heappop(self)


try:  # the compiled build's twin (readyarray.pyx)
    from smallstalk.core.readyarray import ReadyHeap
except ImportError:  # the pure build
    ReadyHeap = ListHeap
