"""Every script in examples/ runs, with smaller sizes than its defaults, in one backend's
suite: an example is the library's public API in a short script, and what it calls (the
layers, training, search and export) is checked on every backend by the other tests.
compose_layers, text_classifier and language_model run on PyTorch (eager training of a
small model is quickest there), translate_files and export_and_serve on TensorFlow (where
every backend's export runs), multi_device on PyTorch and, in tests/test_distribution.py,
in children that start JAX and TensorFlow with several devices."""

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

from tests.conftest import BACKEND, only_on

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def load(name):
    sys.path.insert(0, str(EXAMPLES))  # export_and_serve imports translate_files
    try:
        spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLES))


def test_every_example_is_short_and_tested():
    scripts = sorted(p.stem for p in EXAMPLES.glob("*.py"))
    tested = {"compose_layers", "text_classifier", "language_model", "translate_files", "export_and_serve",
              "multi_device"}
    assert set(scripts) == tested
    for name in scripts:
        lines = (EXAMPLES / f"{name}.py").read_text().count("\n")
        assert lines <= 120, f"examples/{name}.py has {lines} lines"


ON_TORCH = only_on("torch", "an example of the public API; the layers and the training it uses are checked on "
                             "every backend (test_layer_harness, test_learning)")


@ON_TORCH
def test_compose_layers():
    results = load("compose_layers").main(["--steps", "40", "--length", "8"])
    assert set(results) == {"functional", "subclassed"}
    # At least the majority class (0.892 of the held-out tokens) after 40 steps; a broken
    # model guesses near 0.5.
    assert min(results.values()) >= 0.88, results


@ON_TORCH
def test_text_classifier():
    accuracy = load("text_classifier").main(["--train-size", "600", "--epochs", "3", "--vocab-size", "200"])
    assert accuracy > 0.6, accuracy  # chance is 0.5; 0.73-0.76 on the three backends


@ON_TORCH
def test_language_model():
    perplexity = load("language_model").main(["--train-size", "600", "--epochs", "1"])
    assert 1.0 < perplexity < 32.0, perplexity  # a uniform guess over the 64 pieces is 64; 7.0-7.5 measured


@pytest.fixture(scope="module")
def translate_files_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("translate_files") / "run"
    scores = load("translate_files").main(["--run-dir", str(run_dir), "--steps", "2", "--size", "1500",
                                           "--holdout", "8", "--eval-size", "2"])
    return run_dir, scores


@only_on("tensorflow", "the example is the library's train, evaluate and translate, which test_cli_translate "
                       "runs on every backend; its run feeds test_export_and_serve here")
def test_translate_files(translate_files_run):
    run_dir, scores = translate_files_run
    assert scores["sentences"] == 2 and scores["bleu_signature"].startswith("nrefs:1")
    assert (run_dir / "model.keras").is_file() and (run_dir / "tokenizer").exists()


@pytest.mark.skipif(BACKEND != "tensorflow",
                    reason="export always runs on TensorFlow (a child process under JAX and PyTorch, which "
                           "test_export runs on every backend); one backend keeps CI short")
def test_export_and_serve(translate_files_run, tmp_path):
    run_dir, _ = translate_files_run
    translations = load("export_and_serve").main(["--run-dir", str(run_dir), "--output", str(tmp_path / "saved")])
    # The SavedModel's strings are the library's beam search of the same batch.
    from keras_transformer.tools.evaluation import load_run

    model, tokenizer = load_run(run_dir)
    ids = tokenizer.tokenize_dense(load("export_and_serve").SENTENCES).numpy()
    expected = tokenizer.detokenize_dense(model.translate(ids, beam_size=4, length_penalty=0.6))
    assert translations == expected


@pytest.mark.skipif(BACKEND != "torch", reason="on JAX and TensorFlow the example needs several devices, fixed when "
                    "the backend starts: tests/test_distribution.py runs it in the child that checks distribution")
def test_multi_device(capsys):
    loss = load("multi_device").main(["--steps", "3"])  # PyTorch: one device, in this process
    assert np.isfinite(loss)
    assert "Keras has no distribution API on the torch backend; training on one device." in capsys.readouterr().out
