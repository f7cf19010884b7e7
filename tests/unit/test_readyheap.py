"""The ready heap against heapq over ints: the reference (`ListHeap`) and the
build's own (`ReadyHeap`: the compiled build's C array under `make test`'s
compiled run) keep the same entries in the same slots through any sequence
of pushes, drops and rebuilds."""

from __future__ import annotations

import heapq
import pickle
import random

import pytest

from smallstalk.core.readyheap import (
    M32,
    M64,
    ListHeap,
    ReadyHeap,
    entry_has_gen,
    entry_id,
    entry_of,
    entry_pri,
)

HEAPS = [ListHeap, ReadyHeap]


def _key(pri: int, id: int, gen: int) -> int:
    return (pri << 96) | (id << 32) | (gen & M32)


@pytest.mark.parametrize("cls", HEAPS)
def test_random_pushes_and_drops_match_heapq(cls) -> None:
    rng = random.Random(7)
    heap, ref = cls(), []
    for step in range(20_000):
        if ref and rng.random() < 0.45:
            assert heap.top_id() == (ref[0] >> 32) & M64
            gen = ref[0] & M32
            assert heap.top_has_gen(gen) and heap.top_has_gen(gen + 2**32)
            assert not heap.top_has_gen(gen + 1)
            heap.drop_top()
            heapq.heappop(ref)
        else:
            # A few priorities and ids, so that ties on pri (and on pri and id,
            # a job pushed again with a new gen) are common; the extremes too.
            pri = rng.choice([0, 1, 1024, 2**31, 2**32 - 1])
            jid = rng.choice([1, 2, rng.randrange(1, 5000), 2**40 + 3, 2**63 - 1])
            gen = rng.choice([0, 1, 2**32 - 1, 2**32, 2**40 + 5])  # unmasked, as a job's
            heap.push(pri, jid, gen)
            heapq.heappush(ref, _key(pri, jid, gen))
        if step % 997 == 0:
            assert list(heap) == ref  # the same slots, not just the same top
            assert len(heap) == len(ref)
            assert [heap[i] for i in range(len(ref))] == ref
    while ref:
        assert heap.top_id() == (ref[0] >> 32) & M64
        heap.drop_top()
        heapq.heappop(ref)
    assert not heap and len(heap) == 0
    assert heap.top_id() == 0  # no job has id 0: an empty heap's top finds none


@pytest.mark.parametrize("cls", HEAPS)
def test_built_from_keys_and_added_unordered_as_heapify_does(cls) -> None:
    rng = random.Random(11)
    keys = [_key(rng.randrange(0, 2**32), rng.randrange(1, 2**64), rng.randrange(0, 2**32))
            for _ in range(3000)]
    ref = list(keys)
    heapq.heapify(ref)
    assert list(cls(keys)) == ref
    assert list(cls(iter(keys))) == ref  # a generator, as State.compact_heaps gives
    more = [(rng.randrange(0, 2**32), rng.randrange(1, 2**64), rng.randrange(0, 2**40))
            for _ in range(500)]
    heap = cls(keys)
    for pri, jid, gen in more:  # as a snapshot's load adds its ready jobs
        heap.add_unordered(pri, jid, gen)
    heap.reorder()
    ref.extend(_key(*e) for e in more)
    heapq.heapify(ref)
    assert list(heap) == ref
    assert heap[-1] == ref[-1]
    assert list(pickle.loads(pickle.dumps(heap))) == ref  # the console's snapshot pickles state


@pytest.mark.parametrize("cls", HEAPS)
def test_out_of_range_is_an_error_not_a_crash(cls) -> None:
    heap = cls()
    with pytest.raises(IndexError):
        heap.drop_top()
    with pytest.raises(IndexError):
        heap[0]
    heap.push(1, 2, 3)
    with pytest.raises(IndexError):
        heap[1]
    if cls is not ListHeap:  # a list's int has no bound; a C entry's has
        with pytest.raises(OverflowError):
            heap.push(1, 2**64, 0)
        with pytest.raises(OverflowError):
            heap.add_unordered(2**32, 1, 0)
    assert list(heap) == [_key(1, 2, 3)]  # a refused entry is not half added


@pytest.mark.parametrize("cls", HEAPS)
def test_a_heap_that_grew_and_emptied_still_works(cls) -> None:
    heap = cls()
    for i in range(1, 100_001):
        heap.push(0, i, 0)
    for i in range(1, 99_991):
        assert heap.top_id() == i
        heap.drop_top()
    assert sorted(heap) == [_key(0, i, 0) for i in range(99_991, 100_001)]
    heap.push(0, 5, 1)
    assert heap.top_id() == 5 and heap.top_has_gen(1) and not heap.top_has_gen(0)


@pytest.mark.parametrize("cls", HEAPS)
def test_an_entrys_parts_read_back_what_was_pushed(cls) -> None:
    """`entry_id`, `entry_pri` and `entry_has_gen` (what the listings, explain,
    search and the compaction read entries with) take apart exactly what
    `push` made, in either heap, and `entry_of` makes the same entry."""
    pushed = [(0, 1, 0), (1024, 7, 2**32 + 5), (2**32 - 1, 2**63 - 1, 2**32 - 1),
              (5, 2**40 + 3, 2**40 + 5)]
    heap = cls()
    for pri, jid, gen in pushed:
        heap.push(pri, jid, gen)
    assert sorted(heap) == sorted(entry_of(*p) for p in pushed)
    got = sorted((entry_pri(e), entry_id(e)) for e in heap)
    assert got == sorted((pri, jid) for pri, jid, _ in pushed)
    for e in heap:
        (gen,) = [g for p, j, g in pushed if (p, j) == (entry_pri(e), entry_id(e))]
        assert entry_has_gen(e, gen) and entry_has_gen(e, gen + 2**32)
        assert not entry_has_gen(e, gen + 1)
