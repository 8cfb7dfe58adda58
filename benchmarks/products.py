"""The matrix products of one decoding step, timed alone on each engine's CPU kernels.

A decoding step of a small model is a few thousand numbers per operation, and how fast the
engine's float32 matrix product is at those shapes sets a floor under the step: PyTorch
calls its BLAS (MKL in the x86 wheels) once per product, XLA (under JAX and TensorFlow)
emits its own. For a preset, the products of a step of `--rows` decoded rows (sentences x
beam) are timed one by one: `(rows, d_model) x (d_model, d_model)` (the attention's
projections: four in self-attention, two in encoder-decoder attention, per layer), the
feed-forward pair, and the output projection onto the vocabulary; each row of the JSON
gives microseconds per product and, weighted by how many a step makes, per step.

PyTorch: `torch.mm` called from Python in `torch.inference_mode()` (what the exported
search replays, less the call's Python). JAX and TensorFlow: the product repeated inside
one compiled loop (`jax.lax.fori_loop`, a `tf.while_loop` under `jit_compile=True`), each
iteration's input depending on the last, so that the time is the kernel's, not the
dispatch's. Nothing is asserted: the script prints a table and writes JSON.

    python benchmarks/products.py [--preset tiny] [--rows 8 32]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from timing import first_then_repeats  # noqa: E402 (beside this script)

LOOP = 1000  # products per compiled loop


def shapes(preset: dict, vocab_size: int) -> list[tuple[str, int, int, int]]:
    """`(name, inner, outer, count per step)` of a decoding step's products for one layer
    stack of the preset (the decoder's: the encoder runs once per search)."""
    d, f, n = preset["d_model"], preset["d_ff"], preset["num_layers"]
    return [("attention projections", d, d, 6 * n), ("feed-forward in", d, f, n), ("feed-forward out", f, d, n),
            ("vocabulary", d, vocab_size, 1)]


def _median_us(run, calls: int, repeats: int) -> float:
    """Microseconds per product: `run()` once (it compiles, or warms the kernel's caches),
    then the median of `repeats` timed runs of `calls` products each."""
    _, _, times = first_then_repeats(run, repeats)
    return statistics.median(times) / calls * 1e6


def time_torch(rows: int, inner: int, outer: int, repeats: int) -> float:
    import torch

    x, w = torch.randn(rows, inner), torch.randn(inner, outer)

    def run():
        with torch.inference_mode():
            for _ in range(LOOP):
                torch.mm(x, w)
    return _median_us(run, LOOP, repeats)


def time_jax(rows: int, inner: int, outer: int, repeats: int) -> float:
    import jax
    import jax.numpy as jnp

    x, w = jnp.ones((rows, inner)), jnp.full((inner, outer), 1e-3)

    @jax.jit
    def loop(x, w):
        def body(_, x):  # the next input depends on the product: nothing is hoisted
            return x + 1e-6 * jnp.sum(x @ w, axis=1, keepdims=True)
        return jax.lax.fori_loop(0, LOOP, body, x)
    return _median_us(lambda: loop(x, w).block_until_ready(), LOOP, repeats)


def time_tensorflow(rows: int, inner: int, outer: int, repeats: int) -> float:
    import tensorflow as tf

    x, w = tf.ones((rows, inner)), tf.fill((inner, outer), 1e-3)

    @tf.function(jit_compile=True)
    def loop(x, w):
        def body(i, x):
            return i + 1, x + 1e-6 * tf.reduce_sum(tf.matmul(x, w), axis=1, keepdims=True)
        return tf.while_loop(lambda i, x: i < LOOP, body, (tf.constant(0), x))[1]
    return _median_us(lambda: loop(x, w).numpy(), LOOP, repeats)


ENGINES = {"torch": time_torch, "jax": time_jax, "tensorflow": time_tensorflow}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="The model's size: a Transformer preset.")
    parser.add_argument("--vocab-size", type=int, default=1000)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32],
                        help="Rows decoded at once: sentences x beam (benchmarks/decode.py: 8 greedy, 32 with beam 4).")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default="benchmarks/results/products.json")
    args = parser.parse_args(argv)
    from keras_transformer.defaults import PRESETS

    results = []
    for rows in args.rows:
        for name, inner, outer, count in shapes(PRESETS[args.preset], args.vocab_size):
            row = {"rows": rows, "product": name, "shape": f"{rows}x{inner} . {inner}x{outer}", "per_step": count}
            for engine in args.engines:
                row[f"{engine}_us"] = round(ENGINES[engine](rows, inner, outer, args.repeats), 2)
            results.append(row)
            print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        for engine in args.engines:
            step = sum(r[f"{engine}_us"] * r["per_step"] for r in results if r["rows"] == rows)
            print(f"rows={rows}: {engine} {step:.0f} us of products per decoding step")
    path = pathlib.Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": vars(args), "products": results}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
