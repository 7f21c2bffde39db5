"""How a node's process keeps the garbage collector's pauses short and rare.

A node's event loop stands still while a collection runs, and every stream the process serves
with it. Two settings, made once the node serves (:func:`settle`):

- **What start-up built is frozen.** Modules, settings, clients and the node itself live as long
  as the process: one collection, then ``gc.freeze()``. A full collection while serving then walks
  only what was made since (``docs/performance.md``: 35 to 72 ms before, a few ms after).
- **The young generation is collected every** :data:`YOUNG` **allocations, not every 700.**
  Nearly everything a request allocates (events, messages, futures, log fields) is freed by its
  reference count before a collection sees it; a collection pays for what is still alive, plus a
  fixed part (about 0.3 ms here). Measured with ``gc.callbacks`` over 1,000 requests via an edge,
  the SDK, the edge and a worker in one process (``scripts/request_bench.py``'s mesh), heap
  frozen in both: every 700 allocations, 143 collections of all generations took 71 to 75 us a
  request; every 5,000, 9 or 10 young collections took 10 to 12 us. The longest young
  collection grows from about 0.4 to 1.2 ms, and the garbage waiting for one is at most that
  many more objects.
"""

from __future__ import annotations

import gc

YOUNG = 5000
"""Allocations (net of frees) between two collections of the youngest generation."""


def settle() -> None:
    """Freeze what the process built so far and collect the young generation every
    :data:`YOUNG` allocations; the older generations keep the interpreter's thresholds."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG, middle, old)
