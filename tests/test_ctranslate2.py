"""`keras-transformer export --format ctranslate2`: a CTranslate2 model that translates like
our greedy search, with CTranslate2 and SentencePiece alone; bad input is one line."""

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest

from keras_transformer.tools import cli
from tests.conftest import BACKEND

pytestmark = pytest.mark.skipif(
    BACKEND != "torch",
    reason="the export reads the weights as NumPy (the same code on every backend) and CTranslate2 runs "
    "without Keras; one backend keeps CI short",
)

# The served process: CTranslate2 and SentencePiece only (and no keras_transformer).
SERVE = """
import json, sys
import ctranslate2, sentencepiece
directory, sentences, extra, beam = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sp = sentencepiece.SentencePieceProcessor(model_file=directory + "/sentencepiece.model")
pieces = [sp.encode(s, out_type=str) for s in sentences]
translator = ctranslate2.Translator(directory, device="cpu")
results = translator.translate_batch(pieces, beam_size=beam, max_decoding_length=max(map(len, pieces)) + extra)
loaded = sorted(m for m in ("keras_transformer", "keras", "tensorflow", "torch", "jax") if m in sys.modules)
print(json.dumps({"translations": [sp.decode(r.hypotheses[0]) for r in results], "imported": loaded}))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory, small):
    out = tmp_path_factory.mktemp("ct2") / "run"
    assert cli.main(["train", "--output-dir", str(out), *small, "--steps", "80"]) == 0
    return out


def _serve(directory, sentences, extra=10, beam=1):
    result = subprocess.run([sys.executable, "-c", SERVE, str(directory), json.dumps(sentences), str(extra), str(beam)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _held_out(run):
    from keras_transformer.tools.config import TrainConfig
    from keras_transformer.tools.run_setup import load_corpus

    config = TrainConfig(**json.loads((run / "config.json").read_text()))  # as `evaluate` reads it
    return [source for source, _ in load_corpus(config).test]


def test_a_float32_export_translates_like_our_greedy_search_with_ctranslate2_alone(run, tmp_path, capsys):
    from keras_transformer.tools.evaluation import load_run

    out = tmp_path / "ct2"
    assert cli.main(["export", "--run-dir", str(run), "--format", "ctranslate2", "--output", str(out)]) == 0
    assert "CTranslate2 model written to" in capsys.readouterr().out
    assert {"model.bin", "sentencepiece.model", "README.md", "config.json"} <= {p.name for p in out.iterdir()}
    sentences = _held_out(run)
    model, tokenizer = load_run(run)
    ids = tokenizer.tokenize_dense(sentences).numpy()
    ours = tokenizer.detokenize_dense(model.translate(ids, 1, max_extra_length=10))
    assert len(set(ours)) > len(ours) // 2, ours  # a model that says different things: the check can fail
    served = _serve(out, sentences, extra=10)
    assert served["imported"] == []
    assert served["translations"] == ours


def test_int8_is_a_quarter_of_the_weights_and_still_translates(run, tmp_path):
    float32, int8 = tmp_path / "float32", tmp_path / "int8"
    for path, extra in ((float32, []), (int8, ["--quantization", "int8"])):
        assert cli.main(["export", "--run-dir", str(run), "--format", "ctranslate2", "--output", str(path),
                         *extra]) == 0
    assert (int8 / "model.bin").stat().st_size < 0.5 * (float32 / "model.bin").stat().st_size
    sentences = _held_out(run)
    exact, quantized = _serve(float32, sentences)["translations"], _serve(int8, sentences)["translations"]
    agreement = np.mean([a == b for a, b in zip(exact, quantized)])
    assert agreement >= 0.5, (agreement, exact, quantized)


def test_a_float16_export_overflows_nothing(run, tmp_path):
    # The projection's bias of -1e9 (for [PAD] and [START]) printed NumPy's "overflow encountered
    # in cast" when CTranslate2 stored it as float16.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["export", "--run-dir", str(run), "--format", "ctranslate2", "--output",
                         str(tmp_path / "ct2"), "--quantization", "int8_float16"]) == 0
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []


def test_the_weight_types_checked_are_ctranslate2s():
    from ctranslate2.specs import model_spec

    from keras_transformer.tools.ctranslate2_export import quantizations

    assert quantizations() == tuple(model_spec.ACCEPTED_MODEL_TYPES)


def test_bad_export_requests_are_one_line_and_write_nothing(run, tmp_path, capsys, monkeypatch):
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("keep")
    wordpiece = tmp_path / "wordpiece_run"
    (wordpiece / "tokenizer").mkdir(parents=True)
    (wordpiece / "tokenizer" / "tokenizer.json").write_text('{"kind": "wordpiece", "lower_case": false, "vocab_size": 9}')
    (wordpiece / "model.keras").write_text("")
    new = tmp_path / "new"
    cases = [
        (["--run-dir", str(run), "--format", "onnx", "--output", str(new)], "invalid choice: 'onnx'"),
        (["--run-dir", str(run), "--format", "ctranslate2", "--quantization", "int3", "--output", str(new)],
         "--quantization int3 is not a CTranslate2 weight type; known: "),
        (["--run-dir", str(run), "--quantization", "int8", "--output", str(new)],
         "--quantization applies to --format ctranslate2 only"),
        (["--run-dir", str(run), "--format", "ctranslate2", "--output", str(full)],
         f"--output {full} holds files that are not a CTranslate2 export (mine.txt)"),
        (["--run-dir", str(wordpiece), "--format", "ctranslate2", "--output", str(new)],
         "the run's tokenizer is wordpiece"),
        # The SavedModel's search settings were ignored by a CTranslate2 export without a word.
        (["--run-dir", str(run), "--format", "ctranslate2", "--beam-size", "1", "--output", str(new)],
         "--beam-size, --length-penalty and --max-input-length are the SavedModel's search settings"),
        (["--run-dir", str(run), "--format", "ctranslate2", "--length-penalty", "1.0", "--output", str(new)],
         "a CTranslate2 model takes beam_size, length_penalty and max_input_length each time it translates"),
        (["--run-dir", str(run), "--format", "ctranslate2", "--max-input-length", "64", "--output", str(new)],
         "--beam-size, --length-penalty and --max-input-length are the SavedModel's search settings"),
    ]
    for argv, message in cases:
        try:
            status = cli.main(["export", *argv])
        except SystemExit as exit_info:  # the parser's own check (a --format it does not know)
            status = exit_info.code
        assert status == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (argv, err)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)  # as if nothing were installed
    assert cli.main(["export", "--run-dir", str(run), "--format", "ctranslate2", "--output", str(new)]) == 2
    assert "pip install 'keras-transformer[ctranslate2]'" in capsys.readouterr().err
    assert not new.exists() and [p.name for p in full.iterdir()] == ["mine.txt"]
