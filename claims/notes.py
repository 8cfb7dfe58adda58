"""The paper's design notes, measured on this machine.

1. **Why divide by sqrt(d_k)** (section 3.2.1, footnote 4): for q and k with independent
   zero-mean, unit-variance components, `q . k` has variance d_k; `q . k / sqrt(d_k)`
   has variance 1. Unscaled, large logits push the softmax to one-hot, where its
   gradient vanishes. Measured: the variance of both, the largest softmax weight and
   the mean gradient magnitude reaching the logits, against d_k.
2. **Dot-product versus additive attention** (section 3.2.1): the same in theory, but
   dot-product is "much faster and more space-efficient in practice". Measured: time and
   (JAX) temporary memory of `keras_transformer.ops.scaled_dot_product_attention`
   against `keras.layers.AdditiveAttention` as n grows.
3. **Sinusoidal versus learned positions** (section 3.5): the paper chose sinusoids
   hoping they let the model extrapolate to longer sequences. Measured: the same small
   Transformer, with either encoding, trained to copy sequences of length <= L and
   tested on lengths up to 3L; token accuracy by position. Whatever happens is reported.

Run it from a checkout with `python -m claims.notes` (or `python -m claims` for Table 1 and
the design notes).
"""

from __future__ import annotations

import dataclasses
import math
import sys

import keras
import numpy as np
from keras import ops

from claims import measure
from keras_transformer.layers import Decoder, Encoder, SinusoidalPositionalEncoding
from keras_transformer.ops import scaled_dot_product_attention


@dataclasses.dataclass
class NotesConfig:
    """What to measure. The defaults take a few minutes on 2 CPU cores."""

    key_dims: tuple[int, ...] = (4, 16, 64, 256, 1024)
    samples: int = 4096
    keys: int = 64  # keys per softmax in the saturation measurement
    lengths: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    width: int = 64
    copy_length: int = 16  # L: the longest training sequence
    test_lengths: tuple[int, ...] = (8, 16, 24, 32, 48)
    copy_steps: int = 1500
    copy_batch: int = 64
    copy_width: int = 64
    repeats: int = 5
    seed: int = 0

    @classmethod
    def quick(cls) -> "NotesConfig":
        """Small sizes: seconds, for tests and a first look."""
        return cls(key_dims=(4, 64, 256), samples=512, lengths=(64, 128, 256), copy_length=6,
                   test_lengths=(6, 12), copy_steps=60, copy_batch=32, copy_width=32, repeats=2)


def dot_product_scaling(key_dims, samples: int = 4096, keys: int = 64, seed: int = 0) -> list[dict]:
    """Variance of q.k with and without the 1/sqrt(d_k) factor, and what the softmax does.

    For each d_k: `samples` query/key pairs with N(0, 1) components give the variance of
    `q . k` and of `q . k / sqrt(d_k)`. Then `samples // keys` queries each attend over
    `keys` keys: the mean largest softmax weight, and the mean absolute gradient of
    `sum(softmax(z) * u)` (u random) with respect to the logits z, computed by the
    backend's autodiff. A one-hot softmax passes no gradient back to z.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for d_k in key_dims:
        q = rng.normal(size=(samples, d_k)).astype("float32")
        k = rng.normal(size=(samples, d_k)).astype("float32")
        dots = measure.to_numpy(ops.sum(ops.multiply(q, k), axis=-1))
        row = {"d_k": d_k, "variance": float(dots.var()), "scaled_variance": float((dots / math.sqrt(d_k)).var())}
        queries = rng.normal(size=(samples // keys, 1, d_k)).astype("float32")
        key_matrix = rng.normal(size=(samples // keys, keys, d_k)).astype("float32")
        upstream = ops.convert_to_tensor(rng.normal(size=(samples // keys, keys)).astype("float32"))
        logits = measure.to_numpy(ops.sum(queries * key_matrix, axis=-1))  # (queries, keys)
        for name, z in (("unscaled", logits), ("scaled", logits / math.sqrt(d_k))):
            weights = measure.to_numpy(ops.softmax(z, axis=-1))
            grad = measure.input_gradient(lambda v: ops.softmax(v, axis=-1) * upstream, z.astype("float32"))
            row[f"{name}_max_weight"] = float(weights.max(-1).mean())
            row[f"{name}_gradient"] = float(np.abs(grad).mean())
        rows.append(row)
    return rows


def dot_versus_additive(lengths, d: int = 64, repeats: int = 5, seed: int = 0) -> list[dict]:
    """Time and (JAX) temporary memory of one attention call, batch 1, one head.

    Scaled dot-product: `keras_transformer.ops.scaled_dot_product_attention`, which forms
    an n x n score matrix. Additive (Bahdanau): `keras.layers.AdditiveAttention`, which
    forms `tanh(q_i + k_j)`, an n x n x d tensor.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        x = rng.normal(size=(1, n, d)).astype("float32")
        q, k, v = (ops.convert_to_tensor(x) for _ in range(3))

        def dot(q, k, v):
            return scaled_dot_product_attention(q[:, :, None], k[:, :, None], v[:, :, None])[:, :, 0]

        additive = keras.layers.AdditiveAttention()
        additive([q, v, k])
        scale = [w.value for w in additive.trainable_variables]

        def add(q, k, v):
            out, _ = additive.stateless_call(scale, [], [q, v, k])
            return out

        row = {"n": n}
        for name, fn in (("dot", dot), ("additive", add)):
            row[f"{name}_seconds"] = measure.median_seconds(measure.compiled(fn), q, k, v, repeats=repeats,
                                                            min_seconds=0.02)
            row[f"{name}_temp_bytes"] = measure.peak_temp_bytes(fn, q, k, v)
        rows.append(row)
    return rows


class CopyModel(keras.Model):
    """A small encoder-decoder Transformer with sinusoidal or learned positions."""

    def __init__(self, vocab_size: int, d_model: int, positions: str, max_positions: int, **kwargs):
        super().__init__(**kwargs)
        self.d_model, self.positions = d_model, positions
        self.token_embedding = keras.layers.Embedding(vocab_size, d_model)
        if positions == "sinusoidal":
            self.position_embedding = SinusoidalPositionalEncoding()
        elif positions == "learned":
            self.position_embedding = keras.layers.Embedding(max_positions, d_model)
        else:
            raise ValueError(f"`positions` must be 'sinusoidal' or 'learned'. Received: {positions!r}")
        self.encoder = Encoder(2, 4, 4 * d_model, dropout=0.0)
        self.decoder = Decoder(2, 4, 4 * d_model, dropout=0.0)
        self.logits = keras.layers.Dense(vocab_size)

    def embed(self, ids):
        x = self.token_embedding(ids) * math.sqrt(self.d_model)
        if self.positions == "sinusoidal":
            return x + self.position_embedding(x)
        return x + self.position_embedding(ops.arange(ops.shape(ids)[1]))[None]

    def call(self, inputs):
        source, target = inputs["source_ids"], inputs["target_ids"]
        source_mask, target_mask = ops.not_equal(source, 0), ops.not_equal(target, 0)
        memory = self.encoder(self.embed(source), padding_mask=source_mask)
        out = self.decoder(self.embed(target), memory, decoder_padding_mask=target_mask,
                           encoder_padding_mask=source_mask)
        return self.logits(out)


START, FIRST_SYMBOL, VOCAB = 2, 4, 16


def copy_batch(rng, count: int, width: int, min_length: int, max_length: int):
    """Sequences of symbols 4..15, lengths uniform in [min_length, max_length], padded with
    0 to `width`; the decoder reads `[START] y_1 .. y_{n-1}` and predicts `y_1 .. y_n`."""
    lengths = rng.integers(min_length, max_length + 1, size=count)
    source = rng.integers(FIRST_SYMBOL, VOCAB, size=(count, width)).astype("int32")
    source[np.arange(width)[None, :] >= lengths[:, None]] = 0
    decoder_input = np.concatenate([np.full((count, 1), START, "int32"), source[:, :-1]], axis=1)
    decoder_input[np.arange(width)[None, :] >= lengths[:, None]] = 0
    return {"source_ids": source, "target_ids": decoder_input}, source


def position_extrapolation(config: NotesConfig, positions: str, progress=print) -> dict:
    """Train the copy task on lengths <= L with `positions`; token accuracy per position on
    test sequences of each of `config.test_lengths` (teacher forcing)."""
    keras.utils.set_random_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    L = config.copy_length
    model = CopyModel(VOCAB, config.copy_width, positions, max_positions=max(config.test_lengths))
    schedule = keras.optimizers.schedules.CosineDecay(0.0, config.copy_steps, warmup_target=2e-3,
                                                      warmup_steps=max(1, config.copy_steps // 10))
    model.compile(optimizer=keras.optimizers.Adam(schedule, beta_1=0.9, beta_2=0.98, epsilon=1e-9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0))
    x, y = copy_batch(rng, config.copy_batch * config.copy_steps, L, 1, L)
    progress(f"  copy task, {positions} positions: training {config.copy_steps} steps on lengths 1..{L}")
    history = model.fit(x, y, batch_size=config.copy_batch, epochs=1, verbose=0)
    result = {"positions": positions, "final_loss": float(history.history["loss"][-1]), "by_length": []}
    for n in config.test_lengths:
        x, y = copy_batch(np.random.default_rng(config.seed + n), 256, n, n, n)
        predicted = measure.to_numpy(model.predict(x, batch_size=256, verbose=0)).argmax(-1)
        per_position = (predicted == y).mean(0)
        result["by_length"].append({
            "length": n,
            "accuracy": float(per_position.mean()),
            "accuracy_within_L": float(per_position[:L].mean()),
            "accuracy_beyond_L": float(per_position[L:].mean()) if n > L else None,
            "per_position": [round(float(a), 4) for a in per_position],
        })
    return result


def run(config: NotesConfig, progress=print) -> dict:
    results = {"backend": keras.backend.backend(), "config": dataclasses.asdict(config)}
    progress("  q.k variance and softmax saturation")
    results["scaling"] = dot_product_scaling(config.key_dims, config.samples, config.keys, config.seed)
    progress("  dot-product versus additive attention")
    results["additive"] = dot_versus_additive(config.lengths, config.width, config.repeats, config.seed)
    results["positions"] = [position_extrapolation(config, p, progress) for p in ("sinusoidal", "learned")]
    return results


def _mib(x):
    return "not measured" if x is None else f"{x / 2**20:.3f}"


def to_markdown(results: dict) -> str:
    c = results["config"]
    out = [f"## The design notes, measured\n\nBackend: {results['backend']}.\n",
           "### Why divide by sqrt(d_k)\n",
           f"{c['samples']} pairs of N(0, 1) vectors per d_k; softmax over {c['keys']} keys; "
           "gradient = mean |d sum(softmax(z) * u) / dz| (u ~ N(0, 1)), by autodiff.\n"]
    out.append(measure.markdown_table(
        ["d_k", "var(q.k)", "var(q.k / sqrt(d_k))", "max weight, unscaled", "max weight, scaled",
         "gradient, unscaled", "gradient, scaled"],
        [[r["d_k"], f"{r['variance']:.2f}", f"{r['scaled_variance']:.3f}", f"{r['unscaled_max_weight']:.3f}",
          f"{r['scaled_max_weight']:.3f}", f"{r['unscaled_gradient']:.2e}", f"{r['scaled_gradient']:.2e}"]
         for r in results["scaling"]]))
    out.append("\n### Dot-product versus additive attention\n")
    out.append(f"One head, d = {c['width']}, batch 1, forward pass; memory is XLA's temporary buffers.\n")
    add = results["additive"]
    rows = [[r["n"], f"{r['dot_seconds'] * 1e3:.3f}", f"{r['additive_seconds'] * 1e3:.3f}",
             f"{r['additive_seconds'] / r['dot_seconds']:.1f}x", _mib(r["dot_temp_bytes"]),
             _mib(r["additive_temp_bytes"])] for r in add]
    out.append(measure.markdown_table(["n", "dot ms", "additive ms", "additive / dot", "dot MiB", "additive MiB"],
                                      rows))
    k = min(3, len(add))
    out.append("\nFitted time exponents in n (largest {k} n): dot {d:.2f}, additive {a:.2f}.\n".format(
        k=k, d=measure.fit_exponent([r["n"] for r in add[-k:]], [r["dot_seconds"] for r in add[-k:]]),
        a=measure.fit_exponent([r["n"] for r in add[-k:]], [r["additive_seconds"] for r in add[-k:]])))
    out.append("\n### Sinusoidal versus learned positions beyond the training length\n")
    out.append(f"Copy task, 2 + 2 layers, d = {c['copy_width']}, trained {c['copy_steps']} steps on lengths "
               f"1..{c['copy_length']} (L); teacher-forced token accuracy on 256 sequences of each test length. "
               "The learned table has rows for every tested position; those beyond L are never trained.\n")
    rows = []
    for p in results["positions"]:
        for r in p["by_length"]:
            beyond = "-" if r["accuracy_beyond_L"] is None else f"{100 * r['accuracy_beyond_L']:.1f}%"
            rows.append([p["positions"], r["length"], f"{100 * r['accuracy']:.1f}%",
                         f"{100 * r['accuracy_within_L']:.1f}%", beyond])
    out.append(measure.markdown_table(["positions", "test length", "accuracy", "positions <= L", "positions > L"],
                                      rows))
    return "\n".join(out)


def plots(results: dict, output_dir) -> list:
    s = results["scaling"]
    paths = [measure.loglog_plot(
        f"{output_dir}/notes_scaling.png",
        {"var(q.k)": ([r["d_k"] for r in s], [r["variance"] for r in s]),
         "var(q.k / sqrt(d_k))": ([r["d_k"] for r in s], [r["scaled_variance"] for r in s]),
         "softmax gradient, unscaled": ([r["d_k"] for r in s], [r["unscaled_gradient"] for r in s]),
         "softmax gradient, scaled": ([r["d_k"] for r in s], [r["scaled_gradient"] for r in s])},
        "d_k", "value", "Dot-product variance and softmax gradient against d_k")]
    a = results["additive"]
    series = {"dot-product time (s)": ([r["n"] for r in a], [r["dot_seconds"] for r in a]),
              "additive time (s)": ([r["n"] for r in a], [r["additive_seconds"] for r in a])}
    if results["backend"] == "jax":
        series["dot-product memory (MiB)"] = ([r["n"] for r in a], [r["dot_temp_bytes"] / 2**20 for r in a])
        series["additive memory (MiB)"] = ([r["n"] for r in a], [r["additive_temp_bytes"] / 2**20 for r in a])
    paths.append(measure.loglog_plot(f"{output_dir}/notes_additive.png", series, "sequence length n", "cost",
                                     "Dot-product versus additive attention"))
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4.2))
    ax = fig.subplots()
    for p in results["positions"]:
        longest = p["by_length"][-1]
        ax.plot(range(1, longest["length"] + 1), longest["per_position"], marker=".", label=p["positions"])
    ax.axvline(results["config"]["copy_length"] + 0.5, color="grey", linestyle="--", label="longest trained")
    ax.set_xlabel("position")
    ax.set_ylabel("token accuracy")
    ax.set_title(f"Copying sequences of length {results['positions'][0]['by_length'][-1]['length']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{output_dir}/notes_positions.png", dpi=120)
    return paths + [f"{output_dir}/notes_positions.png"]


def main(argv=None) -> int:
    return measure.command(
        argv, prog="python -m claims.notes",
        description="Measure the paper's design notes: the 1/sqrt(d_k) scaling, dot-product versus additive "
                    "attention, and sinusoidal versus learned positions on sequences longer than any seen "
                    "in training. Memory is read from XLA, so it is measured on the JAX backend only.",
        title="Design notes", stem="notes", configs=NotesConfig, run=run, to_markdown=to_markdown, plots=plots)


if __name__ == "__main__":
    sys.exit(main())
