"""Compose the paper's layers in your own Keras models: Functional and subclassed.

Both models below tag each token of a sequence with whether it appeared earlier in the
sequence, a task that needs attention across positions. They train with `model.fit` on
any backend:

    KERAS_BACKEND=jax python examples/compose_layers.py [--steps 300]
"""

import argparse
import math

import keras
import numpy as np

import keras_transformer as kt

VOCAB = 32


def data(n, length, seed):
    """Random ids 1..31 (0 is padding); label 1 where the id occurred before."""
    ids = np.random.default_rng(seed).integers(1, VOCAB, size=(n, length)).astype("int32")
    seen = np.array([[ids[i, j] in ids[i, :j] for j in range(length)] for i in range(n)], "int32")
    return ids, seen


def functional_model(length, d_model=64):
    """Embedding x sqrt(d_model) + sinusoids -> encoder blocks -> per-token classifier."""
    ids = keras.Input((length,), dtype="int32")
    embed = kt.layers.SinusoidalEmbedding(VOCAB, d_model)
    x = embed(ids)  # already x sqrt(d_model) + positional encoding
    padding = keras.ops.not_equal(ids, 0)
    for _ in range(2):
        x = kt.layers.EncoderBlock(num_heads=4, d_ff=4 * d_model, dropout=0.0)(x, padding_mask=padding)
    return keras.Model(ids, keras.layers.Dense(2)(x))


class SubclassedTagger(keras.Model):
    """The same, written as a subclass: the attention layer used directly."""

    def __init__(self, d_model=64, **kwargs):
        super().__init__(**kwargs)
        self.d_model = d_model
        self.embedding = keras.layers.Embedding(VOCAB, d_model)
        self.positions = kt.layers.SinusoidalPositionalEncoding()
        self.attention = kt.layers.MultiHeadAttention(num_heads=4)
        self.attention_norm = keras.layers.LayerNormalization(epsilon=1e-6)
        self.ffn_norm = keras.layers.LayerNormalization(epsilon=1e-6)
        self.ffn = kt.layers.PositionwiseFFN(4 * d_model, dropout=0.0)
        self.classify = keras.layers.Dense(2)

    def call(self, ids):
        x = self.embedding(ids) * math.sqrt(self.d_model)
        x = x + self.positions(x)
        x = self.attention_norm(x + self.attention(x, x, value_mask=keras.ops.not_equal(ids, 0)))
        return self.classify(self.ffn_norm(x + self.ffn(x)))


def train(model, steps, length, batch=64):
    x, y = data(steps * batch, length, seed=0)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    x_test, y_test = data(500, length, seed=1)
    return model.evaluate(x_test, y_test, verbose=0)[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--length", type=int, default=12)
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(0)
    _, y = data(500, args.length, seed=1)
    print(f"majority-class accuracy: {max(y.mean(), 1 - y.mean()):.3f}")
    results = {}
    for name, model in (("functional", functional_model(args.length)), ("subclassed", SubclassedTagger())):
        results[name] = train(model, args.steps, args.length)
        print(f"{name} model: held-out token accuracy {results[name]:.3f} after {args.steps} steps")
    return results


if __name__ == "__main__":
    main()
