"""A text classifier on `kt.layers.Encoder`: is the number written in words even or odd?

The built-in numbers corpus gives English number words ("four hundred and twelve");
the label is the parity of the number. The encoder output is mean-pooled over the real
tokens (padding masked out) and classified. Tokenization is SentencePiece run by TensorFlow Text
(`kt.text.Tokenizer`), whatever the Keras backend:

    KERAS_BACKEND=torch python examples/text_classifier.py [--train-size 6000]
"""

import argparse

import keras
import numpy as np
from num2words import num2words

import keras_transformer as kt


class MaskedMean(keras.layers.Layer):
    """Mean over the time axis of the positions where `mask` is True."""

    def call(self, x, mask):
        weights = keras.ops.expand_dims(keras.ops.cast(mask, x.dtype), -1)  # (B, T, 1)
        return keras.ops.sum(x * weights, axis=1) / keras.ops.maximum(keras.ops.sum(weights, axis=1), 1.0)


def classifier(vocab_size, length, d_model=64, num_layers=2):
    ids = keras.Input((length,), dtype="int32", name="token_ids")
    padding = keras.ops.not_equal(ids, kt.decoding.PAD_ID)
    x = kt.layers.SinusoidalEmbedding(vocab_size, d_model, dropout=0.1)(ids)
    x = kt.layers.Encoder(num_layers, num_heads=4, d_ff=4 * d_model, dropout=0.1)(x, padding_mask=padding)
    logits = keras.layers.Dense(2)(MaskedMean()(x, padding))
    return keras.Model(ids, logits)


def examples(numbers):
    return [num2words(int(n)) for n in numbers], (np.asarray(numbers) % 2).astype("int32")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-size", type=int, default=6000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--vocab-size", type=int, default=400)
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    numbers = rng.permutation(100_000)[: args.train_size + 1000]
    train_texts, train_labels = examples(numbers[:-1000])
    test_texts, test_labels = examples(numbers[-1000:])  # numbers never seen in training

    tokenizer = kt.text.Tokenizer.build(train_texts, vocab_size=args.vocab_size, min_frequency=5)
    length = 24
    x_train = tokenizer.tokenize_dense(train_texts).numpy()[:, :length]
    x_test = tokenizer.tokenize_dense(test_texts).numpy()[:, :length]
    x_train = np.pad(x_train, [(0, 0), (0, length - x_train.shape[1])])
    x_test = np.pad(x_test, [(0, 0), (0, length - x_test.shape[1])])
    print(f"{len(train_texts)} training sentences, e.g. {train_texts[0]!r} -> {train_labels[0]}; "
          f"vocabulary {tokenizer.vocab_size} pieces")

    model = classifier(tokenizer.vocab_size, length)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x_train, train_labels, batch_size=64, epochs=args.epochs, verbose=2)
    accuracy = model.evaluate(x_test, test_labels, verbose=0)[1]
    print(f"held-out accuracy: {accuracy:.3f} (chance 0.5)")
    return accuracy


if __name__ == "__main__":
    main()
