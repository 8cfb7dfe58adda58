"""Measuring tools shared by the Table 1 and design-note scripts.

Each works on the current Keras backend: gradients with respect to an input, the median
time of a call, the peak temporary memory of a call (on JAX, from XLA's buffer
assignment), and the longest chain of dependent operations in a traced call (on JAX,
from its jaxpr). Where a backend cannot give a number, the function returns `None`
and the reports say "not measured".
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import time
from collections.abc import Callable, Sequence

import keras
import numpy as np

# Where the measurements write unless told otherwise (the repository's benchmark results).
RESULTS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "claims"


def to_numpy(x) -> np.ndarray:
    """A backend tensor (or anything array-like) as a NumPy array."""
    return np.asarray(keras.ops.convert_to_numpy(x))


def input_gradient(fn: Callable, x: np.ndarray) -> np.ndarray:
    """The gradient of `sum(fn(x))` with respect to `x`, as NumPy, on any backend.

    Example:

    >>> import numpy as np
    >>> input_gradient(lambda x: x * x, np.array([1.0, -2.0], "float32")).tolist()
    [2.0, -4.0]
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        return np.asarray(jax.grad(lambda v: jnp.sum(fn(v)))(jnp.asarray(x)))
    if backend == "tensorflow":
        import tensorflow as tf

        v = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(v)
            total = tf.reduce_sum(fn(v))
        return tape.gradient(total, v).numpy()
    if backend == "torch":
        import torch

        v = torch.tensor(x, requires_grad=True)
        fn(v).sum().backward()
        return v.grad.detach().cpu().numpy()
    raise NotImplementedError(f"input_gradient does not support the {backend!r} backend")


def compiled(fn: Callable) -> Callable:
    """`fn` compiled the backend's usual way for inference: `jax.jit`, `tf.function`
    with XLA, or eager PyTorch under `torch.no_grad`."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.jit(fn)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, jit_compile=True)
    if backend == "torch":
        import torch

        def run(*args):
            with torch.no_grad():
                return fn(*args)

        return run
    return fn


def median_seconds(fn: Callable, *args, repeats: int = 5, min_seconds: float = 0.0) -> float:
    """Median wall time of `fn(*args)` over `repeats` calls after one warm-up call.

    Each timed call waits for the result (`keras.ops.convert_to_numpy`). When one call is
    shorter than `min_seconds`, each sample is the mean of enough calls to last that long.
    """
    keras.ops.convert_to_numpy(fn(*args))
    t = time.perf_counter()
    keras.ops.convert_to_numpy(fn(*args))
    once = time.perf_counter() - t
    inner = max(1, math.ceil(min_seconds / max(once, 1e-9)))
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        keras.ops.convert_to_numpy(out)
        samples.append((time.perf_counter() - t) / inner)
    return statistics.median(samples)


def peak_temp_bytes(fn: Callable, *args) -> int | None:
    """Bytes of temporary buffers XLA allocates for `fn(*args)` (JAX only; else `None`).

    This is the memory a call needs beyond its inputs and outputs: for attention, the
    score matrices. It is read from the compiled program's buffer assignment, so it is
    exact and free of allocator noise.
    """
    if keras.backend.backend() != "jax":
        return None
    import jax

    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    return int(stats.temp_size_in_bytes)


def dependency_depth(fn: Callable, *args) -> int | None:
    """The longest chain of dependent primitive operations in `fn(*args)` (JAX only).

    This counts what must run one after another however many processors there are:
    the "sequential operations" of the paper's Table 1. It is read from the jaxpr
    (nested jaxprs counted by their own depth); `None` on other backends.
    """
    if keras.backend.backend() != "jax":
        return None
    import jax

    return _jaxpr_depth(jax.make_jaxpr(fn)(*args).jaxpr)


def _jaxpr_depth(jaxpr) -> int:
    depth = {}  # variable -> length of the longest chain producing it

    def of(v):  # literals (constants) start no chain
        return 0 if type(v).__name__ == "Literal" else depth.get(v, 0)

    longest = 0
    for eqn in jaxpr.eqns:
        inner = 1
        for param in eqn.params.values():
            sub = getattr(param, "jaxpr", param)
            if hasattr(sub, "eqns"):
                inner = max(inner, _jaxpr_depth(sub))
        if eqn.primitive.name == "scan":  # the body runs `length` times, one after another
            inner *= eqn.params["length"]
        start = max((of(v) for v in eqn.invars), default=0)
        for v in eqn.outvars:
            depth[v] = start + inner
        longest = max(longest, start + inner)
    return longest


def fit_exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The slope of log(y) against log(x): y grows as x to this power.

    Example:

    >>> round(fit_exponent([1, 2, 4, 8], [3, 12, 48, 192]), 6)
    2.0
    """
    slope, _ = np.polyfit(np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float)), 1)
    return float(slope)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_outputs(output_dir, stem: str, results: dict, markdown: str) -> list[pathlib.Path]:
    """Write `<stem>.json` and `<stem>.md` into `output_dir`; return their paths."""
    out = pathlib.Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    paths[1].write_text(markdown, encoding="utf-8")
    return paths


def loglog_plot(path, series: dict, xlabel: str, ylabel: str, title: str) -> pathlib.Path:
    """Draw `{label: (xs, ys)}` on log-log axes into a PNG (a `Figure` of its own, no display,
    the process's matplotlib backend left alone)."""
    import matplotlib.ticker
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4.2))
    ax = fig.subplots()
    ticks = set()
    for label, (xs, ys) in series.items():
        pairs = [(x, y) for x, y in zip(xs, ys) if y]
        if pairs:
            ax.loglog(*zip(*pairs), marker="o", label=label)
            ticks.update(x for x, _ in pairs)
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # label the measured sizes only
    ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return pathlib.Path(path)


def command(argv, prog: str, description: str, title: str, stem: str, configs, run: Callable,
            to_markdown: Callable, plots: Callable) -> int:
    """The command line both measurements share: `--output-dir`, `--quick`; run, then write
    `<stem>.json`, `<stem>.md` and the plots, and print the Markdown.

    `configs` is the measurement's config class, with a `quick()` constructor.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--output-dir", default=str(RESULTS), help="Markdown, JSON and PNG plots go here.")
    parser.add_argument("--quick", action="store_true", help="Small sizes: seconds instead of minutes.")
    args = parser.parse_args(argv)
    config = configs.quick() if args.quick else configs()
    print(f"{title} on {keras.backend.backend()}: writing to {args.output_dir}/", flush=True)
    results = run(config, progress=lambda s: print(s, flush=True))
    markdown = to_markdown(results)
    written = write_outputs(args.output_dir, stem, results, markdown)
    written += plots(results, args.output_dir)
    print(markdown)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0

