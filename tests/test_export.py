"""The exported SavedModel translates strings like `Transformer.translate`, whatever
backend trained the model, loaded in a process that never imports keras_transformer."""

import json
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_transformer as kt
from keras_transformer.text import Tokenizer, corpora
from keras_transformer.text.datasets import make_dataset

LOADER = """
import json, sys
import tensorflow as tf
import tensorflow_text  # registers the tokenizer's ops
translator = tf.saved_model.load(sys.argv[1])
texts = tf.constant(json.loads(sys.argv[2]))
out = {name: [t.decode("utf-8") for t in translator.signatures[name](texts=texts)["translation"].numpy()]
       for name in ("translate", "serving_default")}
assert "keras_transformer" not in sys.modules
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def trained():
    corpus = corpora.numbers_corpus(train_size=1500, validation_size=20, test_size=20)
    texts = [s for s, _ in corpus.train] + [t for _, t in corpus.train]
    tokenizer = Tokenizer.build(texts, vocab_size=300, min_frequency=5)
    keras.utils.set_random_seed(0)
    model = kt.models.Transformer(tokenizer.vocab_size, num_layers=1, d_model=64, num_heads=4, d_ff=128, dropout=0.0)
    model.compile(optimizer=kt.schedules.transformer_optimizer(64, warmup_steps=50), loss=kt.losses.LabelSmoothedCrossEntropy())
    data = make_dataset(corpus.train, tokenizer, batch_tokens=1024, max_length=32, repeat=True, drop_remainder=True)
    model.fit(data, steps_per_epoch=150, epochs=1, verbose=0, shuffle=False)
    return model, tokenizer, corpus


def _library_translations(model, tokenizer, texts):
    out = []
    for text in texts:  # one at a time: batching pads the source, which can change near-ties
        if not text:
            out.append("")
            continue
        ids = tokenizer.tokenize_dense([text]).numpy()
        out.extend(tokenizer.detokenize_dense(keras.ops.convert_to_numpy(model.translate(ids))))
    return out


def test_saved_model_translates_like_the_library(trained, tmp_path):
    model, tokenizer, corpus = trained
    path = kt.export.export_translator(model, tokenizer, tmp_path / "translator")
    long_input = " ".join(s for s, _ in corpus.test[:4])  # longer than any training sentence
    texts = [s for s, _ in corpus.test[:5]] + ["", long_input]
    result = subprocess.run([sys.executable, "-c", LOADER, str(path), json.dumps(texts)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    served = json.loads(result.stdout.strip().splitlines()[-1])
    assert served["translate"] == served["serving_default"]
    translations = served["translate"]
    assert translations[5] == ""  # empty in, empty out
    assert translations[6]  # a long input still translates
    assert translations[:5] == _library_translations(model, tokenizer, texts[:5])


def test_vocabulary_mismatch_is_refused(trained, tmp_path):
    model, _, _ = trained
    other = Tokenizer(["[PAD]", "[UNK]", "[START]", "[END]", "a"])
    with pytest.raises(ValueError, match=rf"has 5 tokens but the model's vocab_size is {model.vocab_size}"):
        kt.export.export_translator(model, other, tmp_path / "x")
    assert not (tmp_path / "x").exists()
