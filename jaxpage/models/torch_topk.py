"""Which k of n values `torch.topk` picks on CPU when values tie: HF's routing choice.

torch's CPU topk (ATen's `topk_impl_loop`) fills a vector of (value, index) pairs in index
order and runs libstdc++'s `std::partial_sort` when k * 64 <= n, else `std::nth_element`,
comparing values only. Among equal values the winners are whichever that algorithm's
partitioning leaves in front: not the lowest index (`jax.lax.top_k`'s rule) nor the highest,
but a deterministic function of the whole row (all-equal rows of 4, 8 and 64 pick {2, 3},
{4, 5, 6} for k=3, and {40, ..., 47} for k=8). This module ports those libstdc++ routines
line by line so a tie across the k-th place routes a token to the experts HF routes it to.
The set is all that matters (expert outputs are summed), so the order within it is not kept.
"""

from __future__ import annotations

import numpy as np

Pair = tuple[float, int]


def torch_cpu_topk_indices(row: np.ndarray, k: int) -> list[int]:
    """The indices `torch.topk(torch.tensor(row), k)` returns on CPU, ascending."""
    q = [(float(v), i) for i, v in enumerate(row)]
    n = len(q)
    if k * 64 <= n:  # partial_sort: its heap_select decides the set, sort_heap only orders it
        _heap_select(q, 0, k, n)
    else:
        _nth_element(q, 0, k - 1, n)
    return sorted(i for _, i in q[:k])


def _greater(a: Pair, b: Pair) -> bool:  # torch's comparator for largest=True (no NaNs here)
    return a[0] > b[0]


def _adjust_heap(q: list[Pair], first: int, hole: int, length: int, value: Pair) -> None:
    top = second = hole
    while second < (length - 1) // 2:
        second = 2 * (second + 1)
        if _greater(q[first + second], q[first + second - 1]):
            second -= 1
        q[first + hole] = q[first + second]
        hole = second
    if length % 2 == 0 and second == (length - 2) // 2:
        second = 2 * (second + 1)
        q[first + hole] = q[first + second - 1]
        hole = second - 1
    parent = (hole - 1) // 2  # __push_heap
    while hole > top and _greater(q[first + parent], value):
        q[first + hole] = q[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    q[first + hole] = value


def _heap_select(q: list[Pair], first: int, middle: int, last: int) -> None:
    length = middle - first
    if length >= 2:  # __make_heap
        for parent in range((length - 2) // 2, -1, -1):
            _adjust_heap(q, first, parent, length, q[first + parent])
    for i in range(middle, last):
        if _greater(q[i], q[first]):  # __pop_heap(first, middle, i)
            value, q[i] = q[i], q[first]
            _adjust_heap(q, first, 0, length, value)


def _move_median_to_first(q: list[Pair], result: int, a: int, b: int, c: int) -> None:
    if _greater(q[a], q[b]):
        m = b if _greater(q[b], q[c]) else (c if _greater(q[a], q[c]) else a)
    else:
        m = a if _greater(q[a], q[c]) else (c if _greater(q[b], q[c]) else b)
    q[result], q[m] = q[m], q[result]


def _unguarded_partition(q: list[Pair], first: int, last: int, pivot: int) -> int:
    while True:
        while _greater(q[first], q[pivot]):
            first += 1
        last -= 1
        while _greater(q[pivot], q[last]):
            last -= 1
        if not first < last:
            return first
        q[first], q[last] = q[last], q[first]
        first += 1


def _insertion_sort(q: list[Pair], first: int, last: int) -> None:
    for i in range(first + 1, last):
        value = q[i]
        if _greater(value, q[first]):
            q[first + 1:i + 1] = q[first:i]
            q[first] = value
        else:  # __unguarded_linear_insert
            j = i
            while _greater(value, q[j - 1]):
                q[j] = q[j - 1]
                j -= 1
            q[j] = value


def _nth_element(q: list[Pair], first: int, nth: int, last: int) -> None:
    """std::nth_element (introselect)."""
    if first == last or nth == last:
        return
    depth = 2 * ((last - first).bit_length() - 1)  # 2 * floor(log2(n))
    while last - first > 3:
        if depth == 0:
            _heap_select(q, first, nth + 1, last)
            q[first], q[nth] = q[nth], q[first]
            return
        depth -= 1
        _move_median_to_first(q, first, first + 1, first + (last - first) // 2, last - 1)
        cut = _unguarded_partition(q, first + 1, last, first)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _insertion_sort(q, first, last)
