"""The garbage collector of a serving process, set for a hot path that allocates many short-lived objects."""

from __future__ import annotations

import gc

# Allocations between young collections (CPython's default is 700). Every token's records, chunks and SSE
# events are garbage within milliseconds; at the default a busy frontend ran ~70 young and ~0.5 full
# collections a second, and each full one walked the ~100k objects of its modules, templates and router.
# A young collection walks what is young and alive, mostly the open requests' coroutines, tasks and futures
# (15-25k objects at 64 streams, 3-9 ms of CPU each), however rarely it runs: at 10,000 a frontend at 64
# streams ran five a second, at 50,000 one every three seconds, no longer.
YOUNG_THRESHOLD = 50_000


def settle_gc() -> None:
    """Once startup is done: move what exists now out of the collector's sight and collect young objects
    less often. What startup built lives as long as the process, so no full collection needs to walk it."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
