"""`keras-transformer train`: bad input, and a short run killed, resumed and finished."""

import csv
import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from keras_transformer.tools import cli

# Small enough for CI: the tiny preset's width, one block, short sentences.
SMALL = ["--train-size", "1500", "--vocab-size", "300", "--batch-tokens", "1024", "--max-length", "32",
         "--num-layers", "1", "--quiet"]


def _run(tmp_path, *args):
    return cli.main(["train", "--output-dir", str(tmp_path), *SMALL, *args])


def test_bad_input_exits_2_before_training(tmp_path, capsys):
    src, tgt = tmp_path / "a.txt", tmp_path / "b.txt"
    src.write_text("one\ntwo\nthree\n")
    tgt.write_text("eins\nzwei\n")
    cases = [
        (["--source-file", str(src), "--target-file", str(tgt)], r"a.txt has 3 lines, .*b.txt has 2 lines"),
        (["--source-file", str(src), "--target-file", str(tmp_path / "nope.txt")], r"File not found: .*nope.txt"),
        (["--vocab-size", "4"], r"--vocab-size 4 is too small"),
    ]
    bad_tsv = tmp_path / "bad.tsv"
    bad_tsv.write_text("a\tb\nno tab\n")
    cases.append((["--tsv", str(bad_tsv)], r"bad.tsv, line 2"))
    undecodable = tmp_path / "bytes.tsv"
    undecodable.write_bytes(b"a\tb\n\xc3\x28\tx\n")
    cases.append((["--tsv", str(undecodable)], r"bytes.tsv, line 2: not valid UTF-8"))
    empty = tmp_path / "empty.tsv"
    empty.write_text("\n\n")
    cases.append((["--tsv", str(empty)], r"empty.*2 empty lines skipped"))
    for i, (args, message) in enumerate(cases):
        out = tmp_path / f"run{i}"
        assert cli.main(["train", "--output-dir", str(out), *args]) == 2
        err = capsys.readouterr().err
        assert __import__("re").search(message, err), err
        assert err.count("error:") == 1
        assert not out.exists()  # nothing written before the error


def test_different_config_in_output_dir_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"preset": "base"}))
    (tmp_path / "precious.txt").write_text("keep me")
    assert _run(tmp_path, "--steps", "10") == 2
    err = capsys.readouterr().err
    assert "different config" in err and "preset: saved 'base', now 'tiny'" in err
    assert (tmp_path / "precious.txt").read_text() == "keep me"
    assert json.loads((tmp_path / "config.json").read_text()) == {"preset": "base"}


def test_exit_status_from_the_console_script(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "keras_transformer.tools.cli", "train", "--output-dir", str(tmp_path), "--vocab-size", "3"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2 and "too small" in result.stderr


def test_killed_run_resumes_and_ends_at_the_requested_step(tmp_path):
    args = [sys.executable, "-m", "keras_transformer.tools.cli", "train", "--output-dir", str(tmp_path), *SMALL,
            "--steps", "80", "--steps-per-epoch", "10", "--average-checkpoints", "3"]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = tmp_path / "state" / "state.npz"
    deadline = time.time() + 240
    try:
        # Kill once at least two epochs have been saved, whatever is being written then.
        while time.time() < deadline:
            if state.exists():
                with np.load(state) as data:
                    if int(data["epochs_done"]) >= 2:
                        break
            if process.poll() is not None:
                pytest.fail("training ended before it could be killed")
            time.sleep(0.05)
        else:
            pytest.fail("no checkpoint within the deadline")
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
    with np.load(state) as data:
        done_before = int(data["epochs_done"])
    assert done_before < 8
    result = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"resuming {tmp_path} after step {done_before * 10}" in result.stdout
    assert json.loads((tmp_path / "metrics.json").read_text())["steps"] == 80
    # Every file on disk is complete: all checkpoints load, no temporary file is left.
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]
    for path in list((tmp_path / "checkpoints").glob("*.npz")) + [state]:
        with np.load(path) as data:
            assert len(data.files) > 0
    with np.load(state) as data:
        assert int(data["epochs_done"]) == 8
    # The finished run holds everything `train` promises, and the loss fell.
    with open(tmp_path / "log.csv") as f:
        losses = [float(r["loss"]) for r in csv.DictReader(f)]
    assert len(losses) >= 8 and losses[-1] < losses[0] * 0.8
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert 0.0 < metrics["test_accuracy"] <= 1.0
    for name in ("config.json", "model.keras", "curves.png", "tokenizer/vocab.txt"):
        assert (tmp_path / name).is_file(), name
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert any((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))
    assert len(list((tmp_path / "checkpoints").glob("checkpoint_*.npz"))) == 3
