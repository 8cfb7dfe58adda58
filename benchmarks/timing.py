"""What the benchmarks share: a first run (which may compile), then timed repeats."""

from __future__ import annotations

import time


def first_then_repeats(run, repeats: int):
    """`(first output, first run's seconds, each repeat's seconds)`: `run()` once, which
    may compile and so is timed apart, then `repeats` more times."""
    t = time.perf_counter()
    output = run()
    first = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return output, first, times
