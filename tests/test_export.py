"""The exported SavedModel translates strings like `Transformer.translate`, whatever
backend trained the model. On TensorFlow it is loaded in a process that never imports
keras_transformer; on JAX and PyTorch a TensorFlow child process exports it (the demo's
own reload step, tested on every backend, loads it in a clean process too).

The model here is built with special ids other than the defaults (`[PAD]` is not 0), so
training, decoding, evaluation and export are all checked to take the ids from the
model and the tokenizer rather than from constants."""

import json
import os
import subprocess
import sys

import keras
import pytest

import keras_transformer as kt
from keras_transformer.tools import evaluation, saved_model_client
from keras_transformer.tools.text import Tokenizer, WordPieceTokenizer, corpora
from keras_transformer.tools.text.datasets import make_dataset
from tests.conftest import only_on, run_in_threads

# Not 0, 1, 2, 3: every place that assumed the defaults would go wrong here.
SPECIAL_IDS = dict(pad_id=5, unk_id=2, start_id=0, end_id=7)

@pytest.fixture(scope="module")
def trained():
    corpus = corpora.numbers_corpus(train_size=1500, validation_size=20, test_size=20)
    texts = [s for s, _ in corpus.train] + [t for _, t in corpus.train]
    tokenizer = Tokenizer.build(texts, vocab_size=300, min_frequency=5, **SPECIAL_IDS)
    assert (tokenizer.pad_id, tokenizer.start_id, tokenizer.end_id) == (5, 0, 7)
    keras.utils.set_random_seed(0)
    model = kt.models.Transformer(
        tokenizer.vocab_size, num_layers=1, d_model=64, num_heads=4, d_ff=128, dropout=0.0,
        pad_id=tokenizer.pad_id, start_id=tokenizer.start_id, end_id=tokenizer.end_id,
    )
    model.compile(
        optimizer=kt.schedules.transformer_optimizer(64, warmup_steps=50),
        loss=kt.losses.LabelSmoothedCrossEntropy(pad_id=tokenizer.pad_id),
        metrics=[kt.metrics.MaskedAccuracy(pad_id=tokenizer.pad_id)],
        # Keras' default, as `keras-transformer train` has it: XLA on JAX, none on a CPU-only
        # TensorFlow (there XLA's compilation of each batch shape took 5 s of this fixture's 13).
    )
    data = make_dataset(corpus.train, tokenizer, batch_tokens=1024, max_length=32, repeat=True, drop_remainder=True)
    model.fit(data, steps_per_epoch=250, epochs=1, verbose=0, shuffle=False)
    return model, tokenizer, corpus


def test_a_model_with_other_special_ids_trains_and_translates(trained):
    model, tokenizer, corpus = trained
    test = make_dataset(corpus.test, tokenizer, batch_tokens=1024, max_length=32, shuffle=False)
    accuracy = model.evaluate(test, return_dict=True, verbose=0)["accuracy"]
    assert accuracy > 0.5, accuracy  # teacher-forced, after 250 steps (chance: 1/300)
    ids = tokenizer.tokenize_dense([s for s, _ in corpus.test[:8]]).numpy()
    out = keras.ops.convert_to_numpy(model.translate(ids))
    assert all(7 in row[:-1] for row in out), out  # a trained model ends every sentence early
    for row in out:  # [END] is 7, padding after it is 5; [START] (0) never appears
        ends = list(row).index(7)
        assert (row[ends + 1 :] == 5).all() and 0 not in row
    hypotheses = evaluation.translate_texts(model, tokenizer, [s for s, _ in corpus.test])
    scores = evaluation.score(hypotheses, [t for _, t in corpus.test], tokenizer)
    assert scores["chrf"] > 30, scores


def _serve(path, texts):
    translator = saved_model_client.load(path)
    return {name: saved_model_client.translate(translator, texts, name) for name in saved_model_client.SIGNATURES}


def _library_translations(model, tokenizer, texts):
    out = []
    for text in texts:  # one at a time: batching pads the source, which can change near-ties
        if not text:
            out.append("")
            continue
        ids = tokenizer.tokenize_dense([text]).numpy()
        out.extend(tokenizer.detokenize_dense(keras.ops.convert_to_numpy(model.translate(ids))))
    return out


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """The trained model's SavedModel, exported once for the tests that serve it (on JAX
    and PyTorch each export is a TensorFlow child process)."""
    model, tokenizer, corpus = trained
    # The test sentences fit max_input_length; a longer input is cut (test_saved_model_...).
    limit = max(len(tokenizer.tokenize_dense([s]).numpy()[0]) for s, _ in corpus.test[:5])
    path = kt.export.export_translator(model, tokenizer, tmp_path_factory.mktemp("export") / "translator",
                                       max_input_length=limit)
    return path, limit


def test_saved_model_translates_like_the_library(trained, exported):
    model, tokenizer, corpus = trained
    path, limit = exported
    long_input = " ".join(s for s, _ in corpus.test[:4])  # longer than any training sentence
    texts = [s for s, _ in corpus.test[:5]] + ["", long_input]

    if keras.backend.backend() != "tensorflow":
        # Exported by a TensorFlow child process already (`export_translator` on JAX and
        # PyTorch); loaded here with TensorFlow's own API.
        served = _serve(path, texts)
    else:
        # Exported in this process: loaded in another, which never imports keras_transformer.
        result = subprocess.run([sys.executable, saved_model_client.__file__, str(path), json.dumps(texts)],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        served = json.loads(result.stdout.strip().splitlines()[-1])
        assert served["imported_keras_transformer"] is False
    assert served["translate"] == served["serving_default"]
    translations = served["translate"]
    assert translations[5] == ""  # empty in, empty out
    expected = _library_translations(model, tokenizer, texts[:5])
    assert translations[:5] == expected
    # An input past max_input_length is cut to its first tokens, as translate_texts cuts it.
    long_ids = tokenizer.tokenize_dense([long_input]).numpy()
    assert long_ids.shape[1] > limit
    cut = tokenizer.detokenize_dense(keras.ops.convert_to_numpy(model.translate(long_ids[:, :limit])))
    assert translations[6] and translations[6] == cut[0]
    # Without the long input, the batch is narrower: its first search is shorter, and the
    # full one runs only if that did not end in time. The same translations either way.
    assert _serve(path, texts[:5])["translate"] == expected


@only_on("tensorflow", "the SavedModel runs on TensorFlow whichever backend trained it (on JAX and PyTorch it is "
                       "exported by a TensorFlow child process and read here the same way)")
def test_one_loaded_translator_serves_several_threads(trained, exported):
    _, _, corpus = trained
    translator = saved_model_client.load(exported[0])  # loaded once, as a server would
    batches = [[s for s, _ in corpus.test[i:i + 3]] for i in range(0, 12, 3)]
    alone = [saved_model_client.translate(translator, batch) for batch in batches]
    results = {}

    def work(i):
        results[i] = [saved_model_client.translate(translator, batches[(i + k) % 4]) for k in range(5)]

    assert run_in_threads(work) == []
    for i in range(4):
        assert results[i] == [alone[(i + k) % 4] for k in range(5)], i


def test_vocabulary_or_special_id_mismatch_is_refused(trained, tmp_path):
    model, tokenizer, _ = trained
    other = WordPieceTokenizer(["[PAD]", "[UNK]", "[START]", "[END]", "a"])
    with pytest.raises(ValueError, match=rf"vocab_size: model {model.vocab_size}, tokenizer 5.*pad_id: model 5, tokenizer 0"):
        kt.export.export_translator(model, other, tmp_path / "x")
    # Same size, default ids: the special ids are named with both values.
    vocab = tokenizer.vocabulary
    for token in ("[PAD]", "[UNK]", "[START]", "[END]"):
        vocab.remove(token)
    same_size = WordPieceTokenizer(["[PAD]", "[UNK]", "[START]", "[END]", *vocab])
    with pytest.raises(ValueError, match="pad_id: model 5, tokenizer 0; start_id: model 0, tokenizer 2; end_id: model 7"):
        kt.export.export_translator(model, same_size, tmp_path / "x")
    with pytest.raises(evaluation.RunDirError, match="pad_id: model 5, tokenizer 0"):
        evaluation.translate_texts(model, same_size, ["one"])
    assert not (tmp_path / "x").exists()


def test_an_export_never_replaces_a_directory_of_other_files(trained, exported, tmp_path):
    # The export replaces its directory whole: a directory holding anything but an earlier
    # export, or a file, is refused before anything is written, through the library too.
    model, tokenizer, _ = trained
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "notes.txt").write_text("mine")
    (tmp_path / "a_file").write_text("mine")
    for path, message in ((tmp_path / "project", r"holds files that are not a SavedModel export \(notes.txt\)"),
                          (tmp_path / "a_file", "is a file; give a directory for the SavedModel")):
        with pytest.raises(ValueError, match=message):
            kt.export.export_translator(model, tokenizer, path)
    assert (tmp_path / "project" / "notes.txt").read_text() == "mine" and (tmp_path / "a_file").read_text() == "mine"
    assert os.listdir(tmp_path / "project") == ["notes.txt"]
    from keras_transformer.tools import files

    assert files.replacement_problem(exported[0], "savedmodel") is None  # an earlier export: replaced
    assert "not a CTranslate2 export" in files.replacement_problem(exported[0], "ctranslate2")
    for settings, message in ((dict(max_extra_length=-1), "`max_extra_length` must be an integer >= 0"),
                              (dict(length_penalty=float("nan")), "`length_penalty` must be a finite number"),
                              (dict(length_penalty=10.5), "`length_penalty` must be at most 10.0 in a SavedModel"),
                              (dict(beam_size=2**31 // model.vocab_size + 1), "`beam_size` times the vocabulary size")):
        with pytest.raises(ValueError, match=message):
            kt.export.export_translator(model, tokenizer, tmp_path / "new", **settings)
    with pytest.raises(ValueError, match="`batch_size` must be a positive integer or None"):
        evaluation.translate_texts(model, tokenizer, ["one"], batch_size=0)
    assert not (tmp_path / "new").exists()
