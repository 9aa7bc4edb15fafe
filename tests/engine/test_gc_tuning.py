"""jaxpage.engine.gc_tuning: the young generation's threshold raised, never lowered, a
collector switched off left off; the heap frozen by the CLIs (no JAX)."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from jaxpage.engine import gc_tuning


@pytest.fixture
def threshold():
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


@pytest.mark.parametrize("before,after", [
    ((700, 10, 10), (50_000, 10, 10)),  # Python's default: raised, the older ones kept
    ((20_000, 5, 7), (50_000, 5, 7)),
    ((100_000, 10, 10), (100_000, 10, 10)),  # higher already: never lowered
    ((0, 10, 10), (0, 10, 10)),  # the collector switched off: left off
])
def test_raise_threshold(threshold, before, after):
    gc.set_threshold(*before)
    gc_tuning.raise_threshold()
    assert gc.get_threshold() == after


def test_freeze_heap_moves_what_is_alive_out_of_the_collections():
    """In a process of its own (a frozen heap stays frozen): the objects alive before the
    call are in the permanent generation after it, hardly any left in the others, and
    garbage made before it (a reference cycle) was collected first, not frozen."""
    code = (
        "import gc, weakref\n"
        "from jaxpage.engine import gc_tuning\n"
        "class Node: pass\n"
        "a = Node(); a.me = a; cycle = weakref.ref(a); del a\n"  # a cycle nobody holds
        "kept = [Node() for _ in range(1000)]\n"
        "gc_tuning.freeze_heap()\n"
        "print(gc.get_freeze_count(), len(gc.get_objects()), cycle() is None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    frozen, tracked, collected = int(out[0]), int(out[1]), out[2] == "True"
    assert frozen > 1000 and tracked < 100 and collected
