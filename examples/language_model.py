"""A decoder-only language model on `kt.layers.Decoder` built without an encoder.

Built without an encoder sequence, each `DecoderBlock` has only masked self-attention
and the FFN: a GPT-style causal language model. It learns English number words from
the built-in numbers corpus, reports held-out perplexity, and completes prompts:

    KERAS_BACKEND=tensorflow python examples/language_model.py [--epochs 4]
"""

import argparse
import math

import keras
import numpy as np
from num2words import num2words

import keras_transformer as kt
from keras_transformer.decoding import END_ID, PAD_ID, START_ID


def language_model(vocab_size, d_model=64, num_layers=2):
    ids = keras.Input((None,), dtype="int32", name="token_ids")
    embedding = kt.layers.SinusoidalEmbedding(vocab_size, d_model, dropout=0.1)
    x = embedding(ids)  # x sqrt(d_model) + sinusoids
    x = kt.layers.Decoder(num_layers, num_heads=4, d_ff=4 * d_model, dropout=0.1)(
        x, decoder_padding_mask=keras.ops.not_equal(ids, PAD_ID))
    return keras.Model(ids, embedding(x, reverse=True))  # logits with the tied embedding


def sequences(tokenizer, texts, length):
    """`[START] w_1 .. w_n` as input, `w_1 .. w_n [END]` as target, padded to `length`."""
    ids = tokenizer.tokenize_dense(texts).numpy()
    inputs = np.zeros((len(texts), length), "int32")
    targets = np.zeros((len(texts), length), "int32")
    for i, row in enumerate(ids):
        row = row[row != PAD_ID][: length - 1]
        inputs[i, : len(row) + 1] = [START_ID, *row]
        targets[i, : len(row) + 1] = [*row, END_ID]
    return inputs, targets


def complete(model, tokenizer, prompt, length=32):
    """Greedy continuation. Each step re-runs the whole (fixed-length, padded) window: the
    causal mask hides what follows the current position. Short texts only."""
    prompt_ids = tokenizer.tokenize_dense([prompt]).numpy()[0]
    ids = np.zeros((1, length), "int32")
    ids[0, : len(prompt_ids) + 1] = [START_ID, *prompt_ids]
    for position in range(len(prompt_ids), length - 1):
        logits = keras.ops.convert_to_numpy(model(ids))
        next_id = int(logits[0, position].argmax())
        if next_id == END_ID:
            break
        ids[0, position + 1] = next_id
    return tokenizer.detokenize_dense(ids[:, 1:])[0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-size", type=int, default=8000)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(0)
    numbers = np.random.default_rng(0).permutation(1_000_000)[: args.train_size + 500]
    texts = [num2words(int(n)) for n in numbers]
    tokenizer = kt.text.Tokenizer.build(texts[:-500], vocab_size=300, min_frequency=5)
    length = 32
    x, y = sequences(tokenizer, texts[:-500], length)
    x_test, y_test = sequences(tokenizer, texts[-500:], length)

    model = language_model(tokenizer.vocab_size)
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=PAD_ID))
    model.fit(x, y, batch_size=64, epochs=args.epochs, verbose=2)
    perplexity = math.exp(model.evaluate(x_test, y_test, verbose=0))
    print(f"held-out perplexity per token: {perplexity:.2f} (vocabulary {tokenizer.vocab_size})")
    for prompt in ("three hundred and", "nine thousand"):
        print(f"  {prompt!r} -> {complete(model, tokenizer, prompt, length)!r}")
    return perplexity


if __name__ == "__main__":
    main()
