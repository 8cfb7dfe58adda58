"""`keras-transformer demo`, `evaluate`, `translate` and `export` on a short run."""

import json
import subprocess
import sys

import pytest

from keras_transformer.tools import cli


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo end to end, shortened: train, beam-search evaluation, export, reload."""
    out = tmp_path_factory.mktemp("demo")
    code = cli.main(["demo", "--output-dir", str(out), "--steps", "60", "--train-size", "1500",
                     "--eval-size", "16", "--quiet"])
    assert code == 0
    return out


def test_demo_writes_everything(demo, capsys):
    summary = json.loads((demo / "demo.json").read_text())
    assert summary["sentences"] == 16
    assert 0.0 <= summary["exact_match"] <= 1.0 and summary["bleu_signature"].startswith("nrefs:1")
    assert (demo / "translator" / "saved_model.pb").is_file()
    assert (demo / "run" / "model.keras").is_file()
    assert len((demo / "hypotheses.test.txt").read_text().splitlines()) == 16


def test_evaluate_and_translate(demo, capsys):
    run = str(demo / "run")
    assert cli.main(["evaluate", "--run-dir", run, "--limit", "8", "--beam-size", "2"]) == 0
    printed = capsys.readouterr().out
    scores = json.loads(printed.strip().splitlines()[-1])
    assert scores["sentences"] == 8 and scores["bleu_signature"].startswith("nrefs:1")
    assert printed.splitlines()[0].startswith("sacreBLEU nrefs:1") and "exact match" in printed
    assert cli.main(["translate", "--run-dir", run, "--beam-size", "1", "forty-two", "seven"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    result = subprocess.run([sys.executable, "-m", "keras_transformer.tools.cli", "translate", "--run-dir", run],
                            input="one\n\ntwo\n", capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:3][1] == ""  # an empty line translates to an empty line
    assert len(result.stdout.rstrip("\n").split("\n")) == 3


def test_export_command(demo, tmp_path, capsys):
    assert cli.main(["export", "--run-dir", str(demo / "run"), "--output", str(tmp_path / "sm")]) == 0
    assert (tmp_path / "sm" / "saved_model.pb").is_file()
    assert "tensorflow/serving" in capsys.readouterr().out


def test_missing_or_broken_checkpoint_exits_2(tmp_path, capsys):
    assert cli.main(["evaluate", "--run-dir", str(tmp_path / "nowhere")]) == 2
    assert "No run directory" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "model.keras").write_text("not a model")
    assert cli.main(["export", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "is not a Keras model file" in err and err.count("error:") == 1
