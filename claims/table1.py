"""The paper's Table 1, measured on this machine.

For a self-attention layer, a restricted self-attention layer (`window=r`), a
recurrent layer (LSTM) and 1-D convolutions of the same width d, this measures:

* **cost per layer**: the median time and (on JAX) the peak temporary memory of one
  forward call as the length n grows and as d grows, with the fitted growth exponent;
* **sequential operations**: the longest chain of dependent operations in one call
  (JAX only, read from the traced program), at n and 2n;
* **maximum path length**: found from gradients. For the parallel layers it is the
  fewest stacked layers for which the gradient of the last output position with
  respect to the first input position is non-zero. A recurrent layer connects them
  in one layer, through a chain of cell steps; its path length is the number of cell
  steps on that chain, counted while the gradient is checked to be non-zero.

Every number in the output comes from the run; only the columns labelled "paper" are
the paper's. Run it from a checkout with `python -m claims.table1` (or `python -m claims` for
Table 1 and the design notes).
"""

from __future__ import annotations

import dataclasses
import platform
import sys

import keras
import numpy as np

from claims import measure
from keras_transformer.layers import MultiHeadAttention

KINDS = ("self-attention", "restricted self-attention", "recurrent", "convolution", "dilated convolution")

PAPER = {  # Vaswani et al. 2017, Table 1
    "self-attention": ("O(n^2 * d)", "O(1)", "O(1)"),
    "restricted self-attention": ("O(r * n * d)", "O(1)", "O(n / r)"),
    "recurrent": ("O(n * d^2)", "O(n)", "O(n)"),
    "convolution": ("O(k * n * d^2)", "O(1)", "O(log_k(n)) dilated, O(n / k) contiguous"),
    "dilated convolution": ("O(k * n * d^2)", "O(1)", "O(log_k(n))"),
}


@dataclasses.dataclass
class Table1Config:
    """What to measure. The defaults take a few minutes on 2 CPU cores."""

    lengths: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    widths: tuple[int, ...] = (64, 128, 256, 512, 1024)
    width: int = 128  # d while n varies
    length: int = 512  # n while d varies
    heads: int = 4
    window: int = 32  # r for the cost measurements
    kernel_size: int = 3  # k
    path_lengths: tuple[int, ...] = (16, 32, 64)  # n for the path-length search
    path_window: int = 4  # r for the path-length search
    path_width: int = 16
    depth_length: int = 64  # n (and 2n) for the sequential-operation count
    fit_points: int = 3  # the exponent is fitted on the largest this many sizes
    repeats: int = 5
    seed: int = 0

    @classmethod
    def quick(cls) -> "Table1Config":
        """Small sizes: seconds, for tests and a first look (exponents are noisier)."""
        return cls(lengths=(64, 128, 256), widths=(32, 64, 128), width=32, length=128, window=8,
                   path_lengths=(12, 24), depth_length=16, repeats=2)


def make_layer(kind: str, d: int, *, heads: int = 4, window: int = 4, kernel_size: int = 3,
               index: int = 0, unroll: bool = False) -> keras.layers.Layer:
    """One layer of `kind` with width d.

    Convolutions are causal (as in ByteNet and WaveNet): output t sees inputs
    t - k + 1 .. t. `index` is the layer's place in a stack; it sets the dilation
    `kernel_size ** index` of a dilated convolution, so that L layers see k^L inputs.
    """
    if kind == "self-attention":
        return MultiHeadAttention(heads)
    if kind == "restricted self-attention":
        return MultiHeadAttention(heads, window=window)
    if kind == "recurrent":
        # unroll=True (the step-counting path) also takes the generic loop that calls the cell.
        return keras.layers.LSTM(d, return_sequences=True, unroll=unroll, use_cudnn=False if unroll else "auto")
    if kind == "convolution":
        return keras.layers.Conv1D(d, kernel_size, padding="causal")
    if kind == "dilated convolution":
        return keras.layers.Conv1D(d, kernel_size, padding="causal", dilation_rate=kernel_size ** index)
    raise ValueError(f"Unknown layer kind {kind!r}; expected one of {KINDS}")


def apply(layer, x):
    """Call a layer the way Table 1 uses it: attention as self-attention."""
    if isinstance(layer, MultiHeadAttention):
        return layer(x, x)
    return layer(x)


def _stateless(layer, x):
    """`(fn, args)` where `fn(weights, x)` is the layer's forward pass as a pure function."""
    apply(layer, x)  # build
    weights = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]

    def fn(w, inputs):
        if isinstance(layer, MultiHeadAttention):
            out, _ = layer.stateless_call(w, non_trainable, inputs, inputs)
        else:
            out, _ = layer.stateless_call(w, non_trainable, inputs)
        return out

    return fn, (weights, x)


def layer_cost(kind: str, n: int, d: int, config: Table1Config) -> dict:
    """Median seconds and (JAX) peak temporary bytes of one forward call, batch 1."""
    keras.utils.set_random_seed(config.seed)
    layer = make_layer(kind, d, heads=config.heads, window=config.window, kernel_size=config.kernel_size)
    x = keras.ops.convert_to_tensor(np.random.default_rng(config.seed).normal(size=(1, n, d)).astype("float32"))
    fn, args = _stateless(layer, x)
    seconds = measure.median_seconds(measure.compiled(fn), *args, repeats=config.repeats, min_seconds=0.02)
    return {"seconds": seconds, "temp_bytes": measure.peak_temp_bytes(fn, *args)}


def path_length(kind: str, n: int, *, d: int = 16, window: int = 4, kernel_size: int = 3,
                heads: int = 2, max_layers: int | None = None, seed: int = 0) -> dict:
    """The maximum path length between the first and last of n positions, from gradients.

    For the parallel layers: the fewest stacked layers L for which the gradient of
    output position n with respect to input position 1 is non-zero (`layers` = L,
    `path` = L). For the recurrent layer: one layer, and `path` = the number of cell
    steps between reading position 1 and writing position n.

    Example:

    >>> path_length("self-attention", 8)["path"]
    1
    """
    keras.utils.set_random_seed(seed)
    x = np.random.default_rng(seed).normal(size=(1, n, d)).astype("float32")
    if kind == "recurrent":
        layer = make_layer(kind, d, unroll=True)
        steps = []
        cell_call = layer.cell.call

        def counting_call(*args, **kwargs):
            steps.append(None)
            return cell_call(*args, **kwargs)

        layer.cell.call = counting_call
        grad = measure.input_gradient(lambda v: layer(v)[:, -1], x)
        del layer.cell.call
        # The cell ran once per position; the chain from position 1 to position n is
        # every step from the one that reads x_1 to the one that writes y_n.
        calls_per_pass = len(steps)
        return {"layers": 1 if np.abs(grad[0, 0]).sum() > 0 else None, "path": calls_per_pass,
                "first_position_gradient": float(np.abs(grad[0, 0]).sum())}
    max_layers = max_layers or 2 * n
    layers = []
    for depth in range(1, max_layers + 1):
        if kind == "dilated convolution" and kernel_size ** (depth - 2) > n:
            break  # the previous layer's dilation already exceeded n: no new reach
        layers.append(make_layer(kind, d, heads=heads, window=window, kernel_size=kernel_size, index=depth - 1))

        def stack(v):
            for layer in layers:
                v = apply(layer, v)
            return v[:, -1]

        grad = measure.input_gradient(stack, x)
        first = float(np.abs(grad[0, 0]).sum())
        if first > 0:
            return {"layers": depth, "path": depth, "first_position_gradient": first}
    return {"layers": None, "path": None, "first_position_gradient": 0.0}


def sequential_operations(kind: str, n: int, d: int = 16, kernel_size: int = 3, window: int = 4) -> int | None:
    """The longest dependent chain of operations in one forward call (JAX only)."""
    keras.utils.set_random_seed(0)
    layer = make_layer(kind, d, window=window, kernel_size=kernel_size, heads=2)
    x = keras.ops.convert_to_tensor(np.zeros((1, n, d), "float32"))
    fn, args = _stateless(layer, x)
    return measure.dependency_depth(fn, *args)


def run(config: Table1Config, progress=print) -> dict:
    """Measure everything; return a JSON-ready dict."""
    results = {"backend": keras.backend.backend(), "machine": platform.processor() or platform.machine(),
               "config": dataclasses.asdict(config), "layers": {}}
    cost_kinds = KINDS[:4]  # a dilated convolution costs what a contiguous one does
    for kind in KINDS:
        entry = results["layers"][kind] = {"paper": dict(zip(("complexity", "sequential", "path"), PAPER[kind]))}
        if kind in cost_kinds:
            entry["by_length"] = []
            for n in config.lengths:
                progress(f"  {kind}: n={n}, d={config.width}")
                entry["by_length"].append(dict(n=n, **layer_cost(kind, n, config.width, config)))
            entry["by_width"] = []
            for d in config.widths:
                progress(f"  {kind}: n={config.length}, d={d}")
                entry["by_width"].append(dict(d=d, **layer_cost(kind, config.length, d, config)))
            k = config.fit_points
            by_n, by_d = entry["by_length"][-k:], entry["by_width"][-k:]
            entry["time_exponent_n"] = measure.fit_exponent([r["n"] for r in by_n], [r["seconds"] for r in by_n])
            entry["time_exponent_d"] = measure.fit_exponent([r["d"] for r in by_d], [r["seconds"] for r in by_d])
            if all(r["temp_bytes"] for r in by_n):
                entry["memory_exponent_n"] = measure.fit_exponent([r["n"] for r in by_n],
                                                                  [r["temp_bytes"] for r in by_n])
            elif all(r["temp_bytes"] == 0 for r in by_n):
                entry["memory_exponent_n"] = "no temporaries"
            n = config.depth_length
            entry["sequential"] = {str(n): sequential_operations(kind, n, kernel_size=config.kernel_size),
                                   str(2 * n): sequential_operations(kind, 2 * n, kernel_size=config.kernel_size)}
        progress(f"  {kind}: path length")
        entry["path_length"] = {
            str(n): path_length(kind, n, d=config.path_width, window=config.path_window,
                                kernel_size=config.kernel_size, seed=config.seed)
            for n in config.path_lengths
        }
    return results


def _fmt(x, digits=2):
    if isinstance(x, str):
        return x
    return "not measured" if x is None else f"{x:.{digits}f}"


def to_markdown(results: dict) -> str:
    c = results["config"]
    n_fit = c["lengths"][-c["fit_points"]:]
    d_fit = c["widths"][-c["fit_points"]:]
    lines = [
        "## Table 1, measured\n",
        f"Backend: {results['backend']}. d = {c['width']} while n varies, n = {c['length']} while d varies, "
        f"{c['heads']} heads, window r = {c['window']}, kernel k = {c['kernel_size']}, batch 1, forward pass. "
        f"Exponents are least-squares slopes of log(cost) on log(size) over n = {n_fit} and d = {d_fit}. "
        f"Path lengths use r = {c['path_window']}, k = {c['kernel_size']}, d = {c['path_width']}; the recurrent "
        "layer is an LSTM; the dilated convolution stacks dilations 1, k, k^2, ...; both convolutions are "
        "causal (output t sees inputs t - k + 1 .. t, times the dilation).\n",
    ]
    ns = c["path_lengths"]
    m = c["depth_length"]
    header = ["layer", "paper: complexity", "time ~ n^", "time ~ d^", "memory ~ n^", "paper: sequential ops",
              f"dependent ops at n={m} / {2 * m}", "paper: max path length",
              "measured path length at n = " + " / ".join(map(str, ns))]
    rows = []
    for kind, e in results["layers"].items():
        seq = e.get("sequential")
        seq_text = "as convolution" if seq is None else " / ".join(
            "not measured" if v is None else str(v) for v in seq.values())
        paths = " / ".join("none found" if p["path"] is None else str(p["path"]) for p in e["path_length"].values())
        if kind == "recurrent":
            paths += " cell steps (1 layer)"
        rows.append([kind, e["paper"]["complexity"],
                     _fmt(e.get("time_exponent_n")) if "by_length" in e else "as convolution",
                     _fmt(e.get("time_exponent_d")) if "by_length" in e else "as convolution",
                     _fmt(e.get("memory_exponent_n")) if "by_length" in e else "as convolution",
                     e["paper"]["sequential"], seq_text, e["paper"]["path"], paths])
    lines.append(measure.markdown_table(header, rows))
    lines.append("\n### Time and memory per layer\n")
    header = ["layer", "n", "d", "ms", "temporary MiB"]
    rows = []
    for kind, e in results["layers"].items():
        for r in e.get("by_length", []):
            rows.append([kind, r["n"], c["width"], f"{r['seconds'] * 1e3:.3f}",
                         _fmt(None if r["temp_bytes"] is None else r["temp_bytes"] / 2**20, 3)])
        for r in e.get("by_width", []):
            rows.append([kind, c["length"], r["d"], f"{r['seconds'] * 1e3:.3f}",
                         _fmt(None if r["temp_bytes"] is None else r["temp_bytes"] / 2**20, 3)])
    lines.append(measure.markdown_table(header, rows))
    return "\n".join(lines)


def plots(results: dict, output_dir) -> list:
    layers = {k: e for k, e in results["layers"].items() if "by_length" in e}
    w = results["config"]["width"]
    paths = [measure.loglog_plot(
        f"{output_dir}/table1_time_vs_n.png",
        {k: ([r["n"] for r in e["by_length"]], [r["seconds"] for r in e["by_length"]]) for k, e in layers.items()},
        "sequence length n", "seconds per forward call", f"Time per layer against n (d = {w})")]
    paths.append(measure.loglog_plot(
        f"{output_dir}/table1_time_vs_d.png",
        {k: ([r["d"] for r in e["by_width"]], [r["seconds"] for r in e["by_width"]]) for k, e in layers.items()},
        "width d", "seconds per forward call", f"Time per layer against d (n = {results['config']['length']})"))
    if results["backend"] == "jax":
        paths.append(measure.loglog_plot(
            f"{output_dir}/table1_memory_vs_n.png",
            {k: ([r["n"] for r in e["by_length"]], [r["temp_bytes"] for r in e["by_length"]])
             for k, e in layers.items()},
            "sequence length n", "temporary bytes (XLA)", f"Memory per layer against n (d = {w})"))
    return paths


def main(argv=None) -> int:
    return measure.command(
        argv, prog="python -m claims.table1",
        description="Measure the paper's Table 1 on this machine: cost per layer against n and d, "
                    "sequential operations and maximum path length, for self-attention, restricted "
                    "self-attention, a recurrent layer and convolutions. Peak memory and sequential "
                    "operations are read from XLA, so they are measured on the JAX backend only.",
        title="Table 1", stem="table1", configs=Table1Config, run=run, to_markdown=to_markdown, plots=plots)


if __name__ == "__main__":
    sys.exit(main())
