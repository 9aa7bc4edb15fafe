"""The garbage collector's settings for a process that runs an engine (no JAX).

Each engine step makes thousands of short-lived containers (the step's inputs, results and
outputs), and with Python's default young-generation threshold of 700 allocations the
collector runs many times a step; every few young collections become older ones, and a
full one walks the whole heap, where a process that imported JAX and transformers keeps
about a million objects that never die. Measured with scripts/bench_host.py's pure host
engine on a 2-core Intel Xeon (Emerald Rapids), a decode step at 1024 sequences took 38.7
ms with the defaults, 12.6 ms with the young threshold at 20,000, 10.9 ms with that and
the start-up heap frozen, and 11.3 ms with the collector off; at 256 sequences freezing is
what counts (3.1 -> 2.4 ms).

Two steps, as long-running Python servers commonly take them:
- `raise_threshold`: every engine raises the young generation's threshold to
  `YOUNG_THRESHOLD` (process-wide; never lowered, and a collector switched off stays off).
  A collection then waits for more allocations; memory held by garbage in reference cycles
  waits a little longer, bounded by the threshold.
- `freeze_heap`: the CLIs (`jaxpage.serve`, `jaxpage.generate`), whose engine lives as
  long as the process, collect once and freeze what is alive after start-up (gc.freeze),
  so later collections never walk it. The library does not: an object frozen while alive
  is never collected, so in a notebook that builds one LLM after another a dropped
  engine caught in a reference cycle would keep its KV pool's memory.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000


def raise_threshold(young: int = YOUNG_THRESHOLD) -> None:
    """The young generation's collection threshold at least `young` allocations."""
    threshold, middle, old = gc.get_threshold()
    if 0 < threshold < young:
        gc.set_threshold(young, middle, old)


def freeze_heap() -> None:
    """Collect, then move every object alive into the permanent generation (gc.freeze)."""
    gc.collect()
    gc.freeze()
