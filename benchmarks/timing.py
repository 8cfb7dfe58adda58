"""What the benchmarks share: a first run (which may compile), then timed repeats."""

from __future__ import annotations

import time


def first_then_repeats(run, repeats: int, warmups: int = 1):
    """`(first output, first runs' seconds, each repeat's seconds)`: `run()` `warmups`
    times, which may compile and so are timed apart (together), then `repeats` more times.
    A compiled search on PyTorch needs two: a shape's first search runs eagerly there and
    its second exports the programs."""
    t = time.perf_counter()
    for _ in range(warmups):
        output = run()
    first = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return output, first, times


def search_warmups(compile) -> int:
    """The warm-up runs a `translate(..., compile=compile)` needs before it runs compiled:
    two for a compiled search on PyTorch (a shape's first search runs eagerly there, its
    second exports the programs), one otherwise."""
    import keras

    return 2 if keras.backend.backend() == "torch" and compile is not False else 1
