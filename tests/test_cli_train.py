"""`keras-transformer train`: bad input, and a short run killed, resumed and finished."""

import argparse
import csv
import dataclasses
import errno
import gzip
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap

import keras
import numpy as np
import pytest

from keras_transformer.tools import cli
from tests.conftest import SMALL_SETTINGS, copy_task, only_on


def _run(out, small, *args):
    """`train` with the `small` fixture's arguments into `out`."""
    return cli.main(["train", "--output-dir", str(out), *small, *args])


def _snapshot(directory):
    """Every file below `directory` with its bytes (an empty dict if there is none)."""
    if not directory.exists():
        return None
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _bad_input_cases(tmp_path):
    """(arguments, fragment of the one error line): every case must exit 2 and leave the
    output directory as it was."""
    def write(name, data):
        path = tmp_path / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return str(path)

    def fifo(path):
        os.mkfifo(path)
        return str(path)

    src, tgt = write("a.txt", "one\ntwo\nthree\n"), write("b.txt", "eins\nzwei\n")
    full = gzip.compress("\n".join(f"w{i}" for i in range(300)).encode())
    four_hundred = write("pairs.tsv", "".join(f"sentence {i} here\tsatz {i} hier\n" for i in range(400)))
    return [
        (["--source-file", src, "--target-file", tgt], r"a.txt has 3 lines, .*b.txt has 2 lines"),
        (["--source-file", src, "--target-file", str(tmp_path / "nope.txt")], r"File not found: .*nope.txt"),
        (["--source-file", src], r"--source-file and --target-file must be given together"),
        (["--vocab-size", "4"], r"--vocab-size must be >= 5"),
        (["--tsv", "-"], r"--tsv: - \(standard input\) cannot be a corpus: a corpus is read again by every process"),
        (["--output-dir", fifo(tmp_path / "pipe-out")],
         r"--output-dir .*pipe-out: it is not a regular file or a folder \(a device, a pipe or a socket\)"),
        (["--tsv", write("bad.tsv", "a\tb\nno tab\n")], r"bad.tsv, line 2: expected 'source<TAB>target'"),
        (["--tsv", write("bytes.tsv", b"a\tb\n\xc3\x28\tx\n")], r"bytes.tsv, line 2: not valid UTF-8"),
        (["--tsv", write("nul.tsv", b"a\tb\nc\t\x00\n")], r"nul.tsv, line 2: a NUL byte, which text never holds"),
        # Windows' "Unicode" text: every other byte is NUL, which said "binary data, not text".
        (["--tsv", write("utf16.tsv", "a\tb\n".encode("utf-16"))], r"utf16.tsv is UTF-16 text .*: save it as UTF-8$"),
        (["--tsv", write("empty.tsv", "\n\n")], r"empty.*2 lines with an empty side skipped"),
        # A source column without its translations: they were called empty lines.
        (["--tsv", write("sources.tsv", "a\t\nb\t \n")], r"empty.*2 lines with an empty side skipped"),
        (["--tsv", str(tmp_path)], r"is a directory, not a file"),
        # A name in another encoding (Python keeps its bytes as surrogates) failed writing config.json.
        (["--tsv", "caf\udce9.tsv"], r"error: --tsv is not UTF-8: b'caf\\xe9.tsv'; .* rename the file"),
        # Every process reads the corpus, and a resumed run reads it again: a pipe cannot give it twice.
        (["--tsv", fifo(tmp_path / "pipe.tsv")], r"Not a regular file: .*pipe.tsv"),
        (["--source-file", write("cut.gz", full[: len(full) // 2]), "--target-file", src], r"cut.gz is not a complete gzip file"),
        (["--source-file", write("plain.gz", "not gzip\n"), "--target-file", src], r"plain.gz is not a complete gzip file"),
        (["--train-size", "50"], r"--train-size must be in \[100, 998000\].*got 50"),
        (["--seed", "-1"], r"--seed must be in \[0, 2\*\*32\); got -1"),
        (["--seed", str(2**32)], r"error: --seed must be in \[0, 2\*\*32\); got 4294967296\.$"),
        (["--min-frequency", "-1"], r"--min-frequency must be >= 0; got -1"),
        (["--d-model", "32", "--num-heads", "3"], r"--d-model \(32\) must be divisible by --num-heads \(3\)"),
        (["--steps", "0", "--dropout", "1.5"], r"--steps must be >= 1; got 0.*--dropout must be in \[0, 1\)"),
        (["--tsv", four_hundred, "--holdout", "100000"], r"--holdout 100000 asks for 200000 held-out pairs.*400 distinct pairs"),
        (["--stop-at-exact-match", "0.9"], r"--stop-at-exact-match needs --validate-translations N > 0"),
        (["--stop-checks", "2"], r"--stop-checks 2 needs --stop-at-exact-match"),
        (["--validation-beam-size", "4"], r"error: --validation-beam-size 4 needs --validate-translations N > 0\.$"),
        (["--validate-translations", "5", "--stop-at-exact-match", "0.9", "--stop-checks", "0"],
         r"--stop-checks must be >= 1; got 0\.$"),
        (["--validate-translations", "5", "--stop-at-exact-match", "99"], r"--stop-at-exact-match must be in \(0, 1\]"),
        (["--validate-translations", "-1"], r"--validate-translations must be >= 0; got -1"),
        (["--accumulate-steps", "0"], r"--accumulate-steps must be >= 1; got 0"),
        (["--tsv", four_hundred, "--source-file", src, "--target-file", src],
         r"error: --tsv is read by --corpus tsv, and this run reads --corpus files: give the files of one corpus\.$"),
        (["--corpus", "numbers", "--source-file", src, "--target-file", src],
         r"--source-file is read by --corpus files, .*--target-file is read by --corpus files"),
        # A setting only other corpora read is refused, not ignored.
        (["--holdout", "20"], r"error: --holdout is read by --corpus files and tsv only, and this run reads --corpus "
                              r"numbers\.$"),
        (["--tsv", four_hundred, "--train-size", "1000"],
         r"error: --train-size is read by --corpus numbers only, and this run reads --corpus tsv\.$"),
        (["--min-frequency", "5"],
         r"error: --min-frequency is read by --tokenizer wordpiece only, and this run uses --tokenizer sentencepiece\.$"),
        (["--tsv", write("five.tsv", "".join(f"s{i}\tt{i}\n" for i in range(5))), "--holdout", "1"],
         r"error: 5 distinct pairs read: a corpus needs at least 6 to hold out one for validation and one for test\.$"),
        (["--learning-rate-scale", "inf", "--label-smoothing", "nan", "--dropout=-inf"],
         r"error: --dropout must be a finite number; got -inf; --label-smoothing must be a finite number; got nan; "
         r"--learning-rate-scale must be a finite number; got inf\.$"),
        (["--validate-translations", "5", "--stop-at-exact-match", "nan"],
         r"error: --stop-at-exact-match must be a finite number; got nan\.$"),
        (["--early-stopping", "3"], r"--early-stopping needs --validate-translations N > 0"),
        (["--average-from", "best"], r"--average-from best needs --validate-translations N > 0"),
        (["--validate-translations", "5", "--early-stopping", "0"], r"--early-stopping must be >= 1; got 0"),
        (["--vocab-size", "6", "--train-size", "100"], r"--vocab-size 6: SentencePiece could not learn a vocabulary of 6 "
                                                       r"pieces from \d+ texts: .* to at least \d+\."),
        (["--tsv", four_hundred, "--holdout", "20", "--max-length", "3"],
         r"only 0 training pairs are left \(20 and 20 held out for validation and test, \d+ longer than --max-length 3 "
         r"dropped.*Raise --max-length, hold out fewer pairs \(--holdout N\), or give a larger corpus\.$"),
        # The numbers corpus holds out no --holdout: the message offers what it reads.
        (["--train-size", "100", "--max-length", "2"],
         r"only \d training pairs are left \(\d+ longer than --max-length 2 dropped, 0 with an empty side skipped\); "
         r"at least 100 are needed\. Raise --max-length or give a larger corpus\.$"),
    ]


def test_bad_input_exits_2_with_one_line_and_changes_nothing(tmp_path, capsys):
    for i, (args, message) in enumerate(_bad_input_cases(tmp_path)):
        out = tmp_path / f"run{i}"
        assert cli.main(["train", "--output-dir", str(out), *args]) == 2, args
        err = capsys.readouterr().err
        assert re.search(message, err), (args, err)
        assert err.count("\n") == 1 and err.startswith("keras-transformer train: error: "), err
        assert not out.exists(), args  # nothing written before the error


def test_demo_checks_its_training_settings_as_train_does(tmp_path, capsys):
    # --train-size 5 was an internal error from the corpus builder, after the banner.
    for size in ("5", "99999999"):
        assert cli.main(["demo", "--output-dir", str(tmp_path / "demo"), "--train-size", size]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error: --train-size must be in [100, 998000]" in err and size in err, err
    # More held-out numbers than the corpus has were taken as its 1,000; a file as the
    # output directory was found by train, after the demo's first banner.
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    for argv, message in ((["--eval-size", "1001"], "--eval-size 1001 is more than the numbers corpus's 1,000"),
                          (["--output-dir", str(a_file)], f"{a_file}/run: {a_file} is a file, not a directory")):
        assert cli.main(["demo", "--output-dir", str(tmp_path / "demo"), *argv]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err, captured
    assert not (tmp_path / "demo").exists() and a_file.read_text() == "mine"
    # A run of other settings in OUTPUT_DIR/run (an earlier `demo --steps 40`): said before
    # anything is printed (it was said after the first banner, once the backend had loaded).
    (tmp_path / "demo" / "run").mkdir(parents=True)
    (tmp_path / "demo" / "run" / "config.json").write_text(json.dumps({"steps": 40}))
    assert cli.main(["demo", "--output-dir", str(tmp_path / "demo")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert "holds a run with a different config (" in captured.err and "steps: saved 40, now" in captured.err, captured


def test_bad_output_directories_are_refused_untouched(tmp_path, small, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    foreign = tmp_path / "notes"
    (foreign / "x.tmp").mkdir(parents=True)  # a user's folder that merely looks temporary
    (foreign / "todo.txt").write_text("keep me")
    for out, message in ((a_file, "is a file, not a directory"), (foreign, r"not empty and holds no run \(todo.txt, x.tmp\)")):
        before = _snapshot(out) if out.is_dir() else out.read_bytes()
        assert _run(out, small) == 2
        assert re.search(message, capsys.readouterr().err)
        assert (_snapshot(out) if out.is_dir() else out.read_bytes()) == before
    assert (foreign / "x.tmp").is_dir()
    # A run that lost its config.json: trained into again, it was a new run over the old
    # one's files (its config written anew, its vocabulary learned again); a config that is
    # JSON but no object of settings was an internal error.
    lost = tmp_path / "lost"
    for name in ("checkpoints", "tokenizer"):
        (lost / name).mkdir(parents=True)
        (lost / name / "kept").write_text("saved")
    (lost / "train.lock").write_text("")
    for config, message in ((None, rf"{lost / 'config.json'} is missing, but {lost} holds a run's files "
                                   r"\(checkpoints, tokenizer\)\. A run writes its config.json first: restore it"),
                            ("[]", r"config.json is not a run config \(JSON \[\], not an object\); restore"),
                            ("null", r"config.json is not a run config \(JSON null, not an object\)")):
        if config is not None:
            (lost / "config.json").write_text(config)
        before = _snapshot(lost)
        assert _run(lost, small) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and re.search(message, err), err
        assert _snapshot(lost) == before
    # A file where a run keeps a directory, or the reverse (train writes neither): named
    # before the backend loads; it was an OSError's "File exists" once the data was read.
    for name, found in (("state", "a file, where a run keeps a directory"),
                        ("model.keras", "a directory, where a run keeps a file")):
        odd = tmp_path / f"odd-{name}"
        odd.mkdir()
        (odd / "config.json").write_text("{}")
        (odd / name).mkdir() if name.endswith(".keras") else (odd / name).write_text("")
        before = _snapshot(odd)
        assert _run(odd, small) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{odd / name} is {found}: it is not what `train` wrote there" in err, err
        assert _snapshot(odd) == before


def test_outputs_that_cannot_be_written_are_one_line_naming_what_is_in_the_way(tmp_path, monkeypatch, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    run = str(tmp_path / "no_run")  # the outputs are checked before the run is read
    for argv in (["train", "--output-dir", str(a_file / "run"), "--steps", "1"],
                 ["demo", "--output-dir", str(a_file / "demo")],
                 ["translate", "--run-dir", run, "--output", str(a_file / "out.txt"), "x"],
                 ["export", "--run-dir", run, "--output", str(a_file / "saved")],
                 ["evaluate", "--run-dir", run, "--hypotheses", str(a_file / "h.txt")]):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{a_file} is a file, not a directory; give another" in err, (argv, err)
    assert a_file.read_text() == "mine"
    # A folder this user may not write in (tests run as root, which may write anywhere).
    with monkeypatch.context() as patch:
        patch.setattr(os, "access", lambda *args, **kwargs: False)
        assert cli.main(["train", "--output-dir", str(tmp_path / "new" / "run"), "--steps", "1"]) == 2
        assert f"{tmp_path} is not writable by this user" in capsys.readouterr().err
    # A name past the file system's 255 bytes, or a loop of links: the system refuses to look
    # (OSError from the checks, a traceback before), and the command says so in one line.
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    for argv, message in ((["train", "--output-dir", str(tmp_path / ("a" * 300) / "run")], "File name too long: "),
                          (["evaluate", "--run-dir", str(tmp_path / ("a" * 300))], "File name too long: "),
                          # Found after the corpus and the vocabulary were made (status 1).
                          (["train", "--output-dir", str(tmp_path / "loop_a" / "run")],
                           f"--output-dir {tmp_path / 'loop_a' / 'run'}: {tmp_path / 'loop_a'} is a link that cannot "
                           "be followed (Too many levels of symbolic links)"),
                          (["translate", "--run-dir", run, "--output", str(tmp_path / "loop_a"), "x"],
                           f"--output {tmp_path / 'loop_a'}: {tmp_path / 'loop_a'} is a link that cannot be followed")):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"keras-transformer {argv[0]}: error: {message}"), err
    # A folder the permissions allow but the file system refuses (read-only, or /proc).
    def refused(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    for argv in (["train", "--output-dir", str(tmp_path / "new" / "run"), "--steps", "1"],
                 ["translate", "--run-dir", run, "--output", str(tmp_path / "out.txt"), "x"]):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"nothing can be written in {tmp_path} (Read-only file system)" in err, err
    assert sorted(os.listdir(tmp_path)) == ["a_file", "loop_a", "loop_b"]


def failing(error):
    """The settings of a command whose handler raises `error`."""
    def handler(settings):
        raise error
    return argparse.Namespace(handler=handler)


def test_a_refused_write_or_memory_running_out_is_one_line_and_a_bug_keeps_its_traceback(capsys):
    args = argparse.Namespace(command="train", verbose=False)
    full = OSError(errno.ENOSPC, "No space left on device", "runs/x/checkpoints/epoch-3.weights.h5")
    assert cli.run(args, failing(full)) == 1
    assert capsys.readouterr().err == (
        "keras-transformer train: error: No space left on device: runs/x/checkpoints/epoch-3.weights.h5\n")
    assert cli.run(args, failing(OSError("raised by code"))) == 1  # no errno: not the system's refusal
    err = capsys.readouterr().err
    assert "Traceback" in err and "internal error (a bug in keras-transformer)" in err, err
    # A batch too large for the machine is not a bug either: one line naming what ran out and
    # the flags that ask for less (tests/test_cli_translate.py runs out for real on each backend).
    ResourceExhaustedError = type("ResourceExhaustedError", (Exception,), {})  # TensorFlow's, by name
    wrapped = RuntimeError("Exception encountered when calling MultiHeadAttention.call().\n\n\x1b[1mRESOURCE_EXHAUSTED: "
                           "Out of memory allocating 115216001960 bytes.\x1b[0m")
    for error, said in ((MemoryError(), "(MemoryError)"),
                        (ResourceExhaustedError("OOM when allocating tensor with shape[1,1000000,4,24,32]"),
                         "(ResourceExhaustedError: OOM when allocating tensor with shape[1,1000000,4,24,32])"),
                        (wrapped, "(RuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating 115216001960 bytes.)")):
        assert cli.run(args, failing(error)) == 1
        assert capsys.readouterr().err == (f"keras-transformer train: error: out of memory {said}; give a smaller "
                                           "--batch-tokens (or --max-length, or a smaller model)\n")
    try:  # PyTorch's CPU allocator, under Keras' own error of the layer
        try:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory")
        except RuntimeError as cause:
            raise RuntimeError("Exception encountered when calling Dense.call().") from cause
    except RuntimeError as error:
        assert cli.run(argparse.Namespace(command="translate", verbose=False), failing(error)) == 1
    assert capsys.readouterr().err == (
        "keras-transformer translate: error: out of memory (RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == "
        "0. DefaultCPUAllocator: can't allocate memory); give a smaller --batch-size, --beam-size or "
        "--max-input-length\n")


def test_an_argument_that_is_not_utf8_is_one_line(tmp_path, capsys):
    # TensorFlow raised "Error converting unicode string" for such a text or output directory.
    for argv, what in ((["translate", "--run-dir", str(tmp_path), "ok", "\udcff\udcfe abc"], "a TEXT to translate"),
                       (["train", "--output-dir", str(tmp_path / "\udcfe")], "--output-dir"),
                       (["launch", "--processes", "2", "--", "train", "--tsv", "\udcff.tsv"], "an argument of train")):
        assert cli.check(cli.parse(argv)) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"keras-transformer {argv[0]}: error: {what} is not UTF-8: b'") and err.count("\n") == 1, err
    cli.check_utf8(cli.parse(["translate", "--run-dir", str(tmp_path), "caf\u00e9 \U0001f600"]))  # any UTF-8 passes


def test_a_reader_that_stops_reading_ends_the_command_quietly(monkeypatch, capsys):
    def printing(settings):
        for i in range(3):
            print(f"line {i}", flush=True)
        return 0

    args = argparse.Namespace(command="translate", verbose=False)
    read, write = os.pipe()
    os.close(read)  # `keras-transformer translate ... | head -1`: the reader has gone
    with os.fdopen(write, "w") as closed:
        monkeypatch.setattr(sys, "stdout", closed)
        assert cli.run(args, argparse.Namespace(handler=printing)) == 1
        assert capsys.readouterr().err == ""  # no traceback, no "Broken pipe"
        print("dropped", file=closed, flush=True)  # what is left goes to the null device, without a second error
    # A broken pipe that is not the output's (its reader is still there) is the system's refusal: one line.
    read, write = os.pipe()
    with os.fdopen(write, "w") as open_pipe, os.fdopen(read):
        monkeypatch.setattr(sys, "stdout", open_pipe)
        assert cli.run(args, failing(BrokenPipeError(errno.EPIPE, "Broken pipe"))) == 1
        assert capsys.readouterr().err == "keras-transformer translate: error: Broken pipe\n"


def test_a_backend_keras_does_not_have_or_that_cannot_train_is_one_line(tmp_path, monkeypatch, capsys):
    # KERAS_BACKEND=JAX (Keras' names are lower case) raised "Unable to import backend : JAX"
    # with a traceback; Keras' numpy backend raised NotImplementedError from `fit`.
    for backend, argv, message in (
        ("JAX", ["translate", "x"], "KERAS_BACKEND='JAX' is not a Keras backend: set it to one of tensorflow, jax, torch"),
        ("numpy", ["train", "--output-dir", str(tmp_path / "run")],
         "KERAS_BACKEND='numpy': Keras' numpy backend cannot train a model (it has no fit)"),
        # openvino's search failed on "An OpenVINOKerasTensor is symbolic", with a traceback.
        ("openvino", ["evaluate"], "KERAS_BACKEND='openvino': Keras' openvino backend cannot run the search (its "
                                   "tensors are symbolic inside it)"),
    ):
        monkeypatch.setenv("KERAS_BACKEND", backend)
        assert cli.check(cli.parse(argv)) == 2
        err = capsys.readouterr().err
        assert err == f"keras-transformer {argv[0]}: error: {message}" + ("; set it to one of tensorflow, jax, torch\n"
                                                                         if backend != "JAX" else "\n"), err
    # numpy runs the search; openvino's export runs on TensorFlow; empty is Keras' default.
    for backend, command in (("numpy", "translate"), ("openvino", "export"), ("", "train")):
        monkeypatch.setenv("KERAS_BACKEND", backend)
        cli.check_backend(command)
    assert not (tmp_path / "run").exists()


def test_version_is_the_installed_distributions(capsys):
    import keras_transformer

    with pytest.raises(SystemExit) as exit_info:
        cli.parse(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"keras-transformer {keras_transformer.__version__}\n"


@pytest.mark.parametrize("argv, message", [
    (["train", "--steps", "abc"], "argument --steps: expected an integer, got 'abc'"),
    # Integers are ASCII digits (int() also reads other scripts' digits) up to 2**31 - 1: larger
    # ones failed inside TensorFlow's data pipeline and JAX's search, with a traceback.
    (["train", "--num-layers", "\u0662"], "argument --num-layers: expected an integer, got '\u0662'"),
    (["train", "--batch-tokens", "99999999999999999999"],
     "argument --batch-tokens: must be at most 2147483647, got 99999999999999999999"),
    (["translate", "--beam-size", "2147483648", "x"], "argument --beam-size: must be in [1, 2147483647], got 2147483648"),
    (["translate", "--n-best", "\u0663", "x"], "argument --n-best: expected int >= 1, got '\u0663'"),
    (["translate", "--beam-size", "1" + "0" * 400, "x"], "argument --beam-size: must be in [1, 2147483647], got 1000"),
    (["demo", "--train-size", "1e3"], "argument --train-size: expected an integer, got '1e3'"),
    (["train", "--epochs", "0"], "argument --epochs: must be >= 1, got 0"),
    (["train", "--steps", "2", "--epochs", "3"], "argument --epochs: not allowed with argument --steps"),
    (["translate", "--beam-size", "0", "x"], "argument --beam-size: must be >= 1, got 0"),
    (["translate", "--batch-size", "-1", "x"], "argument --batch-size: must be >= 1, got -1"),
    (["evaluate", "--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
    (["evaluate", "--length-penalty", "-1"], "argument --length-penalty: must be a finite number >= 0.0, got -1"),
    (["translate", "--length-penalty", "nan", "x"], "argument --length-penalty: must be a finite number >= 0.0, got nan"),
    (["translate", "--length-penalty", "60", "x"], "argument --length-penalty: must be a finite number in [0.0, 10.0], got 60"),
    (["evaluate", "--max-input-length", "0"], "argument --max-input-length: must be >= 1, got 0"),
    (["export", "--max-input-length", "-3"], "argument --max-input-length: must be >= 1, got -3"),
    (["train", "--cluster-timeout", "inf"], "argument --cluster-timeout: must be a finite number >= 1.0, got inf"),
    (["export", "--beam-size", "0"], "argument --beam-size: must be >= 1, got 0"),
    (["demo", "--eval-size", "0"], "argument --eval-size: must be >= 1, got 0"),
    (["train", "--mixed-precision", "float8"], "argument --mixed-precision: invalid choice: 'float8'"),
    (["train", "--tokenizer", "bpe"], "argument --tokenizer: invalid choice: 'bpe'"),
    (["translate", "--model", "last", "x"], "argument --model: invalid choice: 'last'"),
    # A flag the command lacks was said in the program's name, pointing at its --help.
    (["train", "--beam-size", "4"], "unrecognized arguments: --beam-size 4 (see keras-transformer train --help)"),
    (["export", "--run-dir", "r", "extra"], "unrecognized arguments: extra (see keras-transformer export --help)"),
    # A flag is written out whole: argparse took `--learning-rate 1e-4` for `--learning-rate-scale
    # 1e-4` (the paper's rate times 1e-4: a run that learns nothing), and `--max` for whichever
    # it began. The flags it may mean are named.
    (["train", "--learning-rate", "1e-4"], "unrecognized arguments: --learning-rate 1e-4; did you mean "
                                           "--learning-rate-scale? (see keras-transformer train --help)"),
    (["translate", "--beam=4", "x"], "unrecognized arguments: --beam=4; did you mean --beam-size? (see"),
    (["train", "--max", "64"], "unrecognized arguments: --max 64; did you mean --max-length or --max-minutes? (see"),
    (["train", "--vocab", "100", "--stepz", "3", "--tsv-file", "a.tsv", "--colour"],
     "did you mean --vocab-size (not --vocab), --steps (not --stepz), --tsv (not --tsv-file)? (see"),
])
def test_flag_values_are_checked_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith(f"keras-transformer {argv[0]}: error:"), err


@pytest.mark.parametrize("argv, message", [
    # A misspelt command; a flag before the command that is not the program's (argparse said
    # only "the following arguments are required: COMMAND", or took the flag's value for one).
    (["trian", "--steps", "3"], "invalid choice: 'trian' (choose from 'train', 'launch', 'evaluate', 'translate', "
                                "'export', 'demo'); did you mean train?"),
    (["--vers"], "unrecognized arguments: --vers; did you mean --version?"),
    (["--steps", "3", "train"], "unrecognized arguments: --steps; a command's flags come after the COMMAND"),
    (["-v"], "the following arguments are required: COMMAND"),
    (["xyz"], "invalid choice: 'xyz' (choose from 'train', 'launch', 'evaluate', 'translate', 'export', 'demo') ("),
])
def test_the_programs_own_mistakes_name_what_was_probably_meant(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("keras-transformer: error: ") and message in err and err.endswith(
        " (see keras-transformer --help)\n"), err


@pytest.mark.parametrize("command, flag", [
    ("train", "--tsv"), ("train", "--source-file"), ("train", "--target-file"), ("train", "--output-dir"),
    ("evaluate", "--run-dir"), ("evaluate", "--source-file"), ("evaluate", "--target-file"),
    ("evaluate", "--hypotheses"), ("translate", "--run-dir"), ("translate", "--input"), ("translate", "--output"),
    ("export", "--run-dir"), ("export", "--output"), ("demo", "--output-dir"),
])
def test_every_flag_that_names_a_file_refuses_an_empty_name(command, flag, capsys):
    # `--tsv "$CORPUS"` with the variable unset trained the numbers corpus; an empty
    # `--output-dir` or `--hypotheses` was the default, an empty `--output` of export an
    # internal error.
    with pytest.raises(SystemExit) as exit_info:
        cli.parse([command, f"{flag}=", *(["x"] if command == "translate" else [])])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"keras-transformer {command}: error: argument {flag}: expected a file or folder name, got '' "
                   f"(see keras-transformer {command} --help)\n")


@pytest.mark.parametrize("settings", [dict(tsv=""), dict(corpus="tsv", tsv=""),
                                      dict(source_file="", target_file="x.de")])
def test_a_config_with_an_empty_file_name_is_refused(settings):
    from keras_transformer.tools.config import RunError, TrainConfig

    # TrainConfig(tsv="") trained the numbers corpus: an empty name read as no file.
    name = next(key for key, value in settings.items() if value == "")
    with pytest.raises(RunError, match=f"^--{name.replace('_', '-')} must name a file; got ''.$"):
        TrainConfig(**settings).validate()


@pytest.mark.parametrize("settings, message", [
    (dict(steps=1.5), "--steps must be an integer; got 1.5"),
    (dict(steps=True), "--steps must be an integer; got True"),
    (dict(vocab_size="100"), "--vocab-size must be an integer; got '100'"),
    (dict(max_length=None), "--max-length must be an integer; got None"),
    (dict(batch_tokens=2**40), "--batch-tokens must be at most 2147483647; got 1099511627776"),
    (dict(lower_case=1), "--lower-case must be True or False; got 1"),
    (dict(dropout="0.1", tsv=5), "--tsv must be a string; got 5; --dropout must be a number; got '0.1'"),
])
def test_a_config_of_the_wrong_types_is_refused_in_one_line(settings, message):
    from keras_transformer.tools.config import RunError, TrainConfig

    # From Python (the command line's parser types every flag): a float step count trained,
    # a string vocabulary size or a max_length of None was a TypeError from a comparison.
    with pytest.raises(RunError) as error:
        TrainConfig(**settings).validate()
    assert str(error.value) == message + "."


def test_numpy_numbers_in_a_config_are_taken_as_python_numbers():
    import dataclasses

    from keras_transformer.tools.config import TrainConfig

    config = TrainConfig(steps=np.int64(40), dropout=np.float32(0.25), learning_rate_scale=2)
    config.validate()
    assert type(config.steps) is int and type(config.dropout) is float and config.learning_rate_scale == 2
    json.dumps(dataclasses.asdict(config))  # config.json holds it (np.int64 is no JSON number)


def test_different_config_in_output_dir_is_refused(tmp_path, small, capsys):
    from keras_transformer.tools.commands import train

    # The config of these flags, written by a version without --norm-first, for the base preset,
    # from another folder: the same corpus file by another path (relative, through a link).
    config = train.check(cli.parse(["train", "--output-dir", str(tmp_path), *small, "--steps", "10"]))["config"]
    (tmp_path / "link.tsv").symlink_to(config.tsv)
    saved = {k: v for k, v in dataclasses.asdict(config).items() if k != "norm_first"} | {
        "preset": "base", "tsv": os.path.relpath(tmp_path / "link.tsv")}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    (tmp_path / "precious.txt").write_text("keep me")
    assert _run(tmp_path, small, "--steps", "10") == 2
    err = capsys.readouterr().err
    # Only the setting that differs: one the saved config lacks (added since the run was
    # written) has its default there, as in every run directory of an older version.
    assert "different config (preset: saved 'base', now 'tiny')." in err, err
    assert (tmp_path / "precious.txt").read_text() == "keep me"
    assert json.loads((tmp_path / "config.json").read_text()) == saved
    # Another file is another setting.
    other = saved | {"preset": "tiny", "tsv": str(tmp_path / "precious.txt")}
    (tmp_path / "config.json").write_text(json.dumps(other))
    assert _run(tmp_path, small, "--steps", "10") == 2
    assert f"different config (tsv: saved '{tmp_path / 'precious.txt'}', now '{config.tsv}')." in capsys.readouterr().err
    assert json.loads((tmp_path / "config.json").read_text()) == other


def test_an_epoch_is_never_longer_than_the_run():
    from keras_transformer.tools.config import TrainConfig

    # `fit` reads `batches_per_epoch` batches an epoch, and its progress bar counts to it:
    # a run of 20 steps is one epoch of 20 (it showed 125/125 after 20 updates).
    for settings, epochs, batches in ((dict(steps=20), 1, 20), (dict(steps=20, accumulate_steps=2), 1, 40),
                                      (dict(steps=300, steps_per_epoch=125), 3, 125)):
        config = TrainConfig(**settings)
        assert (config.epochs(), config.batches_per_epoch()) == (epochs, batches), settings
    # The updates done after some epochs, as `train` says when it resumes (it said step
    # 125 for a finished run of 20 steps, and 375 for one of 300).
    assert [TrainConfig(steps=20).steps_after(n) for n in (0, 1)] == [0, 20]
    assert [TrainConfig(steps=300, steps_per_epoch=125).steps_after(n) for n in (1, 2, 3)] == [125, 250, 300]


def test_a_setting_the_corpus_does_not_read_is_not_compared_on_resume(tmp_path):
    from keras_transformer.tools.config import RunError, TrainConfig
    from keras_transformer.tools.run_setup import check_output_dir

    # An older version accepted (and ignored) --holdout with the numbers corpus.
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(TrainConfig(holdout=20))))
    assert check_output_dir(tmp_path, TrainConfig()) is True
    # With a corpus that reads it, it is a different run.
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(TrainConfig(corpus="tsv", tsv="a", holdout=20))))
    with pytest.raises(RunError, match="holdout: saved 20, now not given"):
        check_output_dir(tmp_path, TrainConfig(corpus="tsv", tsv="a"))


# The installed command's code path; prints which backends were imported when it ended.
LAUNCHER = """
import sys, keras_transformer_cli
status = keras_transformer_cli.main(sys.argv[1:])
print(sorted(m for m in ("tensorflow", "jax", "torch", "keras") if m in sys.modules))
sys.exit(status)
"""


def test_a_standard_stream_started_closed_is_the_null_device(tmp_path):
    # `train ... >&-` failed inside (`sys.stdout` was None), so did `translate <&-`, and an
    # error line under `2>&-`; the first file the command opened took the free descriptor
    # (TensorFlow's log, written to descriptor 2, would have gone into it).
    code = LAUNCHER.split("print(")[0] + textwrap.dedent("""
        import os
        from keras_transformer.tools.commands.common import fit_verbosity
        with open(os.environ["OPENED"], "w") as opened:
            opened.write(repr((status, opened.fileno(), sys.stdin.read(), fit_verbosity(None))))
    """)
    out = tmp_path / "out.txt"
    shell = 'exec "$0" -c "$1" translate --run-dir "$2" x <&- >&- 2>&-'
    child = subprocess.run(["sh", "-c", shell, sys.executable, code, str(tmp_path / "missing")],
                           env={**os.environ, "OPENED": str(out)}, timeout=120)
    assert child.returncode == 0
    assert out.read_text() == "(2, 3, '', 2)"  # the error's status; a new descriptor; nothing to read; no bar


def test_an_error_line_is_one_write_so_that_processes_sharing_a_stderr_keep_it_whole(tmp_path, monkeypatch):
    """Under PYTHONUNBUFFERED each write reaches the stream at once: with `print`'s two (the
    text, then the newline) two processes of one `launch` wrote "...use at most --holdout
    221.keras-transformer train: error: ..." on one line."""
    writes = []

    class Stream:
        def write(self, text):
            writes.append(text)
            return len(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Stream())
    assert cli.main(["translate", "--run-dir", str(tmp_path), "seven"]) == 2
    assert len(writes) == 1 and writes[0].startswith("keras-transformer translate: error: ") and \
        writes[0].endswith(".\n") and writes[0].count("\n") == 1, writes


def test_a_settings_mistake_exits_2_before_any_backend_loads(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "model.keras").write_text("")
    other = tmp_path / "elsewhere" / "other"  # a run of other settings (not beside the run asked for below)
    other.mkdir(parents=True)
    (other / "config.json").write_text(json.dumps({"steps": 40}))
    for argv, message in (
        (["train", "--output-dir", str(tmp_path / "run"), "--vocab-size", "3"], "--vocab-size must be >= 5"),
        # An --output-dir train cannot use was found once the backend had loaded (10 s later).
        (["train", "--output-dir", str(a_file)], "is a file, not a directory"),
        (["train", "--output-dir", str(unfinished)], "config.json is missing, but"),
        (["train", "--output-dir", str(other), "--steps", "10"],
         "holds a run with a different config (steps: saved 40"),
        (["train", "--steps", "10", "--steps-per-epoch", "5", "--early-stopping", "2", "--validate-translations", "0"],
         "--early-stopping needs --validate-translations N > 0"),
        (["evaluate", "--source-file", str(a_file)], "--source-file and --target-file must be given together"),
        (["evaluate", "--hypotheses", str(tmp_path)], "is a directory; give a file name"),
        (["translate", "--beam-size", "2", "--n-best", "3", "seven"], "--n-best 3 is more than the --beam-size 2"),
        (["translate", "--input", str(a_file), "seven"], "give TEXT arguments or --input FILE, not both"),
        # An --input translate cannot read was found once the model had loaded (8 s later).
        (["translate", "--run-dir", str(unfinished), "--input", str(tmp_path / "missing.txt")],
         f"--input: File not found: {tmp_path / 'missing.txt'}"),
        (["export", "--output", str(a_file)], "is a file; give a directory for the SavedModel"),
        # A run directory, or the model it should hold, that is not there.
        (["evaluate", "--run-dir", str(tmp_path / "nowhere")], "No run directory at "
         f"{tmp_path / 'nowhere'}: a run directory is what `train` writes (its --output-dir)."),
        (["translate", "--run-dir", str(tmp_path), "seven"], "No model at"),
        (["export", "--run-dir", str(unfinished), "--model", "best"], "No best model at"),
        # The CTranslate2 export's checks read CTranslate2's weight types, not a model.
        (["export", "--run-dir", str(unfinished), "--format", "ctranslate2", "--quantization", "int3",
          "--output", str(tmp_path / "ct2")], "--quantization int3 is not a CTranslate2 weight type"),
        (["export", "--run-dir", str(unfinished), "--format", "ctranslate2", "--output", str(tmp_path / "ct2"),
          "--model", "best"], "No best model at"),
    ):
        result = subprocess.run([sys.executable, "-c", LAUNCHER, *argv], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, (argv, result.stderr[-2000:])
        assert message in result.stderr and result.stderr.count("error:") == 1, (argv, result.stderr)
        assert result.stdout.strip() == "[]", (argv, result.stdout)  # no backend, not even Keras, was imported
    assert not (tmp_path / "run").exists() and a_file.read_text() == "mine"


def test_an_atomic_write_never_puts_a_file_in_place_of_a_folder_or_a_folder_of_a_file(tmp_path):
    from keras_transformer.tools import atomic

    (tmp_path / "folder" / "sub").mkdir(parents=True)
    (tmp_path / "file.txt").write_text("mine")
    with pytest.raises(ValueError, match="folder is a directory; writing a file there would replace it"):
        atomic.write_text(tmp_path / "folder", "text")
    with pytest.raises(ValueError, match="file.txt is a file; writing a directory there would replace it"):
        with atomic.atomic_write(tmp_path / "file.txt") as tmp:
            tmp.mkdir()
    assert sorted(os.listdir(tmp_path)) == ["file.txt", "folder"] and os.listdir(tmp_path / "folder") == ["sub"]
    atomic.write_text(tmp_path / "file.txt", "new")  # a file replaces a file
    assert (tmp_path / "file.txt").read_text() == "new"


# Writes one file and one directory `times` times, in `threads` threads, each write
# marked with its writer; loads `keras_transformer.tools.files` without the library.
WRITERS = """
import importlib.util, pathlib, sys, threading
sys.modules["keras_transformer"] = importlib.util.module_from_spec(importlib.util.find_spec("keras_transformer"))
from keras_transformer.tools import atomic
out, name, threads, times = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def write(me):
    for i in range(times):
        atomic.write_text(out / "out.txt", f"{me} {i}\\n" * 2000)
        with atomic.atomic_write(out / "dir") as tmp:
            tmp.mkdir()
            for part in ("a", "b"):
                (tmp / part).write_text(f"{me} {i}")
workers = [threading.Thread(target=write, args=(f"{name}.{k}",)) for k in range(threads)]
for w in workers:
    w.start()
for w in workers:
    w.join()
"""


@only_on("torch", "atomic writes are the tools' own Python and the file system's renames, the same for every backend")
def test_writers_of_one_target_in_threads_and_processes_each_write_it_whole(tmp_path):
    # One temporary name per target: a second writer removed the first's temporary as a
    # killed writer's leftover, and two threads exporting one model failed at once.
    writers = [subprocess.Popen([sys.executable, "-c", WRITERS, str(tmp_path), name, "3", "40"], text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name in ("p", "q")]
    for writer in writers:
        out, err = writer.communicate(timeout=120)
        assert writer.returncode == 0 and not err, err[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["dir", "out.txt"]  # nothing left beside the targets
    lines = (tmp_path / "out.txt").read_text().splitlines()
    assert len(lines) == 2000 and len(set(lines)) == 1  # one writer's whole text
    assert sorted(os.listdir(tmp_path / "dir")) == ["a", "b"]
    assert (tmp_path / "dir" / "a").read_text() == (tmp_path / "dir" / "b").read_text()


def test_a_write_removes_what_a_killed_writer_left_and_nothing_a_running_one_writes(tmp_path, monkeypatch):
    from keras_transformer.tools import atomic
    from keras_transformer.tools.config import TrainConfig
    from keras_transformer.tools.run_setup import check_output_dir

    ended = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                               text=True, timeout=60).stdout)
    left = [f"checkpoint.tmp-{ended}-{ended}.npz", "checkpoint.tmp.npz"]  # an earlier version's name too
    kept = [f"checkpoint.tmp-{os.getppid()}-1.npz", f"model.tmp-{ended}-{ended}.keras", "checkpoint.tmp-1-2.json"]
    for name in left + kept:
        (tmp_path / name).write_text("part")
    atomic.write_text(tmp_path / "checkpoint.npz", "whole")
    assert sorted(os.listdir(tmp_path)) == sorted(["checkpoint.npz", *kept])
    # A directory's write removes its own leftovers: its temporary, and the old one set aside.
    (tmp_path / f"best.old-{ended}-{ended}").mkdir()
    (tmp_path / "best.tmp").mkdir()
    with atomic.atomic_write(tmp_path / "best") as tmp:
        tmp.mkdir()
    assert not [n for n in os.listdir(tmp_path) if n.startswith("best.")]
    for name, target in (("tokenizer.tmp-3-4", "tokenizer"), ("best.old-3-4", "best"), ("best.old", "best"),
                         ("config.tmp.json", "config.json"), ("x.tmp", "x"), ("notes.txt", "notes.txt")):
        assert atomic.target_name(name) == target, name
    # Two writers that find one leftover: the one that comes second finds it gone, and writes.
    (tmp_path / f"notes.tmp-{ended}-{ended}.txt").write_text("part")
    monkeypatch.setattr(atomic, "_remove", lambda path: (_ for _ in ()).throw(FileNotFoundError(path)))
    atomic.write_text(tmp_path / "notes.txt", "whole")
    assert (tmp_path / "notes.txt").read_text() == "whole"
    monkeypatch.undo()
    # What a run killed as it wrote its config left is a run's, not a stranger's, file.
    run = tmp_path / "run"
    run.mkdir()
    (run / f"config.tmp-{ended}-{ended}.json").write_text("{")
    assert check_output_dir(run, TrainConfig()) is False


# Runs the command in a child that kills itself (SIGKILL) just before the `nth` atomic
# rename whose target is named `target`: the moment a file is complete under its
# temporary name but not yet in place. A kill anywhere else is no harder for resumption.
KILLER = """
import os, signal, sys
target, nth = sys.argv[1], int(sys.argv[2])
seen = 0
real_replace = os.replace
def replace(src, dst, *args, **kwargs):
    global seen
    if os.path.basename(os.fspath(dst)) == target:
        seen += 1
        if seen == nth:
            os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst, *args, **kwargs)
os.replace = replace
import keras_transformer_cli
sys.exit(keras_transformer_cli.main(sys.argv[3:]))
"""



def test_killed_at_any_moment_the_run_resumes_and_finishes(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--output-dir", str(out), "--tsv", copy_task(tmp_path / "copy.tsv"), "--holdout", "20",
            "--vocab-size", "100", "--batch-tokens", "512", "--max-length", "16",
            "--num-layers", "1", "--d-model", "32", "--d-ff", "64", "--norm-first", "--quiet",
            "--steps", "14", "--steps-per-epoch", "5", "--average-checkpoints", "2"]  # the last epoch 4 steps
    moments = [
        ("config.json", 1),             # the config written, not yet in place
        ("tokenizer", 1),               # the whole vocabulary written under its temporary name
        ("checkpoint_000001.npz", 1),   # an epoch checkpoint
        ("state.npz", 2),               # the resumption state of the second epoch
        ("model.keras", 1),             # training done, the averaged model not yet in place
    ]
    if keras.backend.backend() != "tensorflow":
        # The resumption state (weights, optimizer, epoch) is what each backend writes and
        # restores its own way. The other moments are before training, or after it (the
        # averaged model is made again from the checkpoints: NumPy, the same code on every
        # backend): the TensorFlow suite covers them. Each moment costs a process that
        # imports and compiles a backend.
        moments = [("state.npz", 2)]
    for target, nth in moments:
        result = subprocess.run([sys.executable, "-c", KILLER, target, str(nth), *args],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == -9, (target, result.returncode, result.stderr[-2000:])
    # The same command, run to its end (here, in this process), resumes and finishes.
    assert cli.main(args) == 0
    # TensorFlow's last kill came after the third epoch's state, the others' before the second's.
    done = 14 if keras.backend.backend() == "tensorflow" else 5
    assert f"resuming {out} after step {done}" in capsys.readouterr().out  # was 15 for 14 steps
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 14
    # Every file on disk is complete and none is left under a temporary name.
    assert not [p for p in out.rglob("*") if ".tmp" in p.name], list(out.rglob("*.tmp*"))
    for path in list((out / "checkpoints").glob("*.npz")) + [out / "state" / "state.npz"]:
        with np.load(path) as data:
            assert len(data.files) > 0
    with np.load(out / "state" / "state.npz") as data:
        assert int(data["epochs_done"]) == 3
    data = json.loads((out / "data.json").read_text())
    assert data["train_pairs"] > 400 and data["train_pairs"] + data["train_too_long"] > 500  # (a few longer than 16 pieces)
    model = keras.saving.load_model(out / "model.keras")
    assert model.norm_first  # a model setting reaches the model, and survives the resumption
    assert model.translate(np.array([[5, 6, 7]], "int32"), beam_size=1, max_length=4).shape == (1, 4)
    with open(out / "log.csv") as f:
        assert len(list(csv.DictReader(f))) >= 3
    for name in ("config.json", "model.keras", "curves.png", "tokenizer/vocab.txt", "train.lock"):
        assert (out / name).is_file(), name


def test_a_second_train_on_the_same_directory_is_refused(tmp_path, small):
    from keras_transformer.tools import files, training
    from keras_transformer.tools.config import RunError, TrainConfig

    busy = f"another `train` is running on {tmp_path}"
    with files.lock(tmp_path / "train.lock", RuntimeError("held")):
        # The command line finds the held lock before it loads a backend...
        result = subprocess.run([sys.executable, "-c", LAUNCHER, "train", "--output-dir", str(tmp_path), *small,
                                 "--steps", "10"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and busy in result.stderr, result.stderr[-2000:]
        assert result.stderr.count("error:") == 1 and result.stdout.strip() == "[]", result
        # ... and `train` itself takes the lock before it writes anything.
        with pytest.raises(RunError, match=re.escape(busy)):
            training.train(TrainConfig(train_size=1500, vocab_size=300, steps=10), tmp_path, verbose=0)
    assert not (tmp_path / "config.json").exists()  # written under the lock only


@only_on("torch", "the target, the log and the rerun's answer are the run's own files; the validation "
                  "translations are stood in for")
def test_a_run_stops_at_its_validation_target_and_a_rerun_trains_no_further(tmp_path, small, small_tsv, monkeypatch,
                                                                           capsys):
    from keras_transformer.tools import evaluation

    calls = []

    def translate_perfectly(model, tokenizer, texts, **kwargs):
        # Stands in for a model that has learned the task: every check after the
        # second epoch finds the references themselves.
        calls.append(len(texts))
        return [TRANSLATIONS[t] if len(calls) >= 2 else "" for t in texts]

    from keras_transformer.tools import run_setup
    from keras_transformer.tools.config import TrainConfig

    TRANSLATIONS = dict(run_setup.load_corpus(TrainConfig(corpus="tsv", tsv=small_tsv, **SMALL_SETTINGS)).validation)
    monkeypatch.setattr(evaluation, "translate_texts", translate_perfectly)
    args = ["--steps", "20", "--steps-per-epoch", "4", "--validate-translations", "6", "--stop-at-exact-match", "1.0"]
    assert _run(tmp_path, small, *args) == 0
    out = capsys.readouterr().out
    assert "stopped after step 8 of 20: validation exact match reached 100%" in out
    assert calls == [6, 6]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["steps"] == 8 and metrics["stopped_early"] is True
    # With an exact-match target the best epoch is ranked by exact match, not BLEU.
    assert metrics["best_epoch"] == 2 and metrics["best_val_exact_match"] == 1.0 and "best_val_bleu" not in metrics
    assert json.loads((tmp_path / "best" / "best.json").read_text())["metric"] == "exact_match"
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["val_exact_match"]) for r in rows] == [0.0, 1.0]
    assert float(rows[1]["val_chrf"]) == 100.0
    # The same command again: the run is complete at its target, so nothing more is trained,
    # and nothing is rebuilt or rewritten: its saved metrics are the answer.
    before = _snapshot(tmp_path)
    assert _run(tmp_path, small, *args) == 0
    assert "holds this run, finished at step 8 of 20: nothing left to train" in capsys.readouterr().out
    assert _snapshot(tmp_path) == before
    # Killed while finishing, before the metrics (written last) were in place, it is not
    # finished: the same command resumes it (test_killed_at_any_moment... runs that case).
    # So is a run whose metrics file is not one (rewritten by hand, say).
    config = TrainConfig(**json.loads((tmp_path / "config.json").read_text()))
    for junk in (None, b"[8]", b'{"steps": "8"}', b"\xff{"):
        if junk is None:
            (tmp_path / "metrics.json").unlink()
        else:
            (tmp_path / "metrics.json").write_bytes(junk)
        assert run_setup.finished_metrics(config, tmp_path) is None, junk
    # A resumption state that is not one (cut short, or another kind of file, which NumPy
    # would read as a pickle) is one error line; nothing is lost or written.
    state = (tmp_path / "state" / "state.npz").read_bytes()
    for junk in (b"PK\x03\x04 cut short", b"x\n"):
        (tmp_path / "state" / "state.npz").write_bytes(junk)
        before = _snapshot(tmp_path)
        assert _run(tmp_path, small, *args) == 2
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and "state.npz is not a resumption state (BadZipFile" in err, err
        assert "pickle" not in err, err
        assert _snapshot(tmp_path) == before
    # The lock file replaced by a directory: one line naming it, nothing written.
    (tmp_path / "train.lock").unlink()
    (tmp_path / "train.lock").mkdir()
    before = _snapshot(tmp_path)
    assert _run(tmp_path, small, *args) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "train.lock cannot be opened as the run's lock file" in err, err
    assert _snapshot(tmp_path) == before
    (tmp_path / "train.lock").rmdir()
    (tmp_path / "train.lock").touch()
    # So is every other file a resume reads, found before training: the epoch and best
    # checkpoints, the best epochs' scores, the log; each named, with what to do.
    (tmp_path / "state" / "state.npz").write_bytes(state)
    for name, junk, message in (
        ("checkpoints/checkpoint_000002.npz", b"PK\x03\x04 cut short", "is not a readable checkpoint (BadZipFile"),
        ("best/checkpoint_000002.npz", b"", "is not a readable checkpoint (BadZipFile"),
        ("best/best.json", b'{"scores": {"1": [0.5]}}', "best.json is not a record of validation scores (IndexError"),
        ("log.csv", b"epoch,loss\n0,0.5\n1,oops\n", "log.csv is not a training log (line 3: ValueError"),
    ):
        good = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(junk)
        before = _snapshot(tmp_path)
        assert _run(tmp_path, small, *args) == 2
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and f"{tmp_path / name.split('/')[0]}" in err and message in err, err
        assert _snapshot(tmp_path) == before
        (tmp_path / name).write_bytes(good)
    # A checkpoint whose index reads but whose weights do not (a flipped byte) is found when
    # the final model averages it: one line too, and the rerun once it is removed finishes.
    damaged = bytearray(good := (tmp_path / "checkpoints" / "checkpoint_000002.npz").read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    (tmp_path / "checkpoints" / "checkpoint_000002.npz").write_bytes(bytes(damaged))
    assert _run(tmp_path, small, *args) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "checkpoint_000002.npz is not a readable checkpoint (BadZipFile" in err, err
    (tmp_path / "checkpoints" / "checkpoint_000002.npz").unlink()
    assert _run(tmp_path, small, *args) == 0
    assert json.loads((tmp_path / "metrics.json").read_text())["steps"] == 8


def test_reverse_swaps_the_direction_of_every_corpus(tmp_path):
    from keras_transformer.tools.config import TrainConfig
    from keras_transformer.tools.run_setup import load_corpus

    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("".join(f"source {i}\ttarget {i}\n" for i in range(300)))
    forward = load_corpus(TrainConfig(corpus="tsv", tsv=str(tsv), holdout=20))
    backward = load_corpus(TrainConfig(corpus="tsv", tsv=str(tsv), holdout=20, reverse=True))
    for split in ("train", "validation", "test"):
        pairs = getattr(backward, split)
        assert pairs == [(t, s) for s, t in getattr(forward, split)]
        assert all(s.startswith("target") and t.startswith("source") for s, t in pairs)
    numbers = load_corpus(TrainConfig(train_size=200, reverse=True))
    assert ("zweiundvierzig", "forty-two") in numbers.train


@only_on("jax", "the stopping rule, best/ and its average are the run's own files and NumPy; training and "
                "resuming on every backend: the killed-run, cluster and mixed-precision tests")
def test_best_checkpoints_early_stopping_and_averaging_the_best(tmp_path, monkeypatch, capsys):
    from keras_transformer.tools import callbacks, evaluation

    tsv = copy_task(tmp_path / "copy.tsv")
    calls = []

    def translate_by_epoch(model, tokenizer, texts, **kwargs):
        # Validation quality by epoch: nothing, perfect, half the words, nothing, ...
        calls.append(len(texts))
        quality = {2: 1.0, 3: 0.5}.get(len(calls), 0.0)
        return [" ".join(REFERENCES[t].split()[: round(len(REFERENCES[t].split()) * quality)]) for t in texts]

    from keras_transformer.tools.config import TrainConfig
    from keras_transformer.tools.run_setup import load_corpus

    REFERENCES = dict(load_corpus(TrainConfig(corpus="tsv", tsv=tsv, holdout=20)).validation)
    monkeypatch.setattr(evaluation, "translate_texts", translate_by_epoch)
    out = tmp_path / "run"
    args = ["train", "--output-dir", str(out), "--tsv", tsv, "--holdout", "20", "--vocab-size", "100",
            "--batch-tokens", "512", "--max-length", "16", "--num-layers", "1", "--d-model", "32", "--d-ff", "64",
            "--quiet", "--steps", "30", "--steps-per-epoch", "3", "--validate-translations", "10",
            "--early-stopping", "2", "--average-checkpoints", "2", "--average-from", "best"]
    assert cli.main(args) == 0
    assert "stopped after step 12 of 30: validation BLEU did not improve for 2 epochs" in capsys.readouterr().out
    assert calls == [10] * 4
    record = json.loads((out / "best" / "best.json").read_text())
    assert record["best_epoch"] == 2 and record["scores"]["2"][0] == 100.0
    assert sorted(p.name for p in (out / "best").glob("*.npz")) == ["checkpoint_000002.npz", "checkpoint_000003.npz"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["best_epoch"] == 2 and metrics["best_step"] == 6 and metrics["best_val_bleu"] == 100.0
    # best/model.keras is epoch 2; model.keras the mean of the two best epochs (2 and 3).
    best, _ = evaluation.load_run(out, "best")
    final, _ = evaluation.load_run(out)
    with np.load(out / "best" / "checkpoint_000002.npz") as e2, np.load(out / "best" / "checkpoint_000003.npz") as e3:
        first = "embedding/embeddings"  # checkpoints name each weight
        np.testing.assert_allclose(keras.ops.convert_to_numpy(best.embedding.embeddings), e2[first], rtol=1e-6)
        np.testing.assert_allclose(keras.ops.convert_to_numpy(final.embedding.embeddings), (e2[first] + e3[first]) / 2,
                                   rtol=1e-5, atol=1e-7)
    assert callbacks.TrainingState.stopped(out / "state")
    # Resumed, the stopped run trains no further; evaluate and translate can use the best model.
    assert cli.main(args) == 0
    assert json.loads((out / "metrics.json").read_text())["steps"] == 12
    monkeypatch.undo()  # real translations again
    assert cli.main(["translate", "--run-dir", str(out), "--model", "best", "--beam-size", "1", "alpha beta"]) == 0


def test_best_model_of_a_run_without_validation_translations_is_refused(tmp_path, capsys):
    (tmp_path / "model.keras").write_text("")
    assert cli.main(["translate", "--run-dir", str(tmp_path), "--model", "best", "x"]) == 2
    assert "only runs trained with --validate-translations keep one" in capsys.readouterr().err


@only_on("torch", "the step budget is a Keras callback setting `stop_training`, which every backend's `fit` "
                  "reads after each batch (test_training_recipe's Ctrl-C test, on every backend)")
def test_steps_that_are_not_whole_epochs_are_trained_exactly(tmp_path, small, capsys, monkeypatch):
    # 6 updates of 2 batches each, 4 updates an epoch: the second epoch is cut short.
    # No --output-dir: the run goes to runs/, named after its corpus (copy.tsv) and preset.
    monkeypatch.chdir(tmp_path)
    out, argv = tmp_path / "runs" / "copy-tiny", ["--steps", "6", "--steps-per-epoch", "4", "--accumulate-steps", "2"]
    assert cli.main(["train", *small, *argv]) == 0
    out_lines = capsys.readouterr().out.splitlines()
    assert "a new run in runs/copy-tiny: stopped or killed, the same command resumes it" in out_lines
    assert ("the run is in runs/copy-tiny: evaluate, translate or export it with --run-dir runs/copy-tiny; its "
            "metrics:") in out_lines
    # A command that reads a run, given none, names the runs there are (folders with a config).
    (tmp_path / "runs" / "notes").mkdir()
    assert cli.main(["translate", "seven"]) == 2
    assert "No run directory at runs/numbers-tiny: a run directory is what `train` writes (its --output-dir); " \
           "runs/ holds copy-tiny.\n" in capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 6 and "stopped_early" not in metrics, metrics
    with open(out / "log.csv") as f:
        assert [row["epoch"] for row in csv.DictReader(f)] == ["0", "1"]
    with np.load(out / "state" / "state.npz") as data:
        assert int(data["epochs_done"]) == 2 and not bool(data["stopped"])
    assert len(list((out / "checkpoints").glob("*.npz"))) == 2
    assert cli.main(["train", *small, *argv]) == 0
    out = capsys.readouterr().out
    assert "finished at step 6 of 6" in out and "a new run" not in out


@only_on("torch", "`stop_training` from a callback is Keras' rule on every backend; what `train` reports "
                  "about it is the same code")
def test_a_callback_of_the_caller_can_stop_a_run(tmp_path, small_tsv, capsys):
    from keras_transformer.tools.config import TrainConfig
    from keras_transformer.tools.training import train

    class StopAtStep6(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)) >= 6:
                self.model.stop_training = True

    config = TrainConfig(corpus="tsv", tsv=small_tsv, **SMALL_SETTINGS, steps=40, steps_per_epoch=4)
    metrics = train(config, tmp_path, verbose=0, callbacks=[StopAtStep6()])
    assert metrics["steps"] == 6 and metrics["stopped_early"] is True
    assert "stopped after step 6 of 40: a callback asked to stop" in capsys.readouterr().out


def test_a_time_budget_pauses_before_an_epoch_that_would_pass_it():
    from keras_transformer.tools.callbacks import TimeBudget

    class Model:
        stop_training = False

    now = [100.0]
    budget = TimeBudget(deadline=130.0, limit="--max-minutes 0.5", clock=lambda: now[0])
    budget.set_model(Model())
    budget.set_params({"epochs": 5})
    for epoch, seconds in enumerate([10.0, 9.0]):  # ends at 110 (+10 <= 130), then 119 (+9 <= 130): no pause
        budget.on_epoch_begin(epoch)
        now[0] += seconds
        budget.on_epoch_end(epoch)
        assert not budget.model.stop_training and budget.reason is None
    budget.on_epoch_begin(2)
    now[0] += 6.0  # ends at 125; another 6 s would end at 131
    budget.on_epoch_end(2)
    assert budget.model.stop_training and budget.reason == "--max-minutes 0.5 would pass during another epoch of 6 s"
    # Not in the last epoch (the run ends there), nor in one a callback stopped for its own reason.
    for model, epoch in ((Model(), 4), (type("Stopped", (), {"stop_training": True})(), 3)):
        late = TimeBudget(deadline=0.0, limit="--max-minutes 1", clock=lambda: now[0])
        late.set_model(model)
        late.set_params({"epochs": 5})
        late.on_epoch_begin(epoch)
        late.on_epoch_end(epoch)
        assert late.reason is None and model.stop_training == (epoch == 3)


@only_on("torch", "the pause is a Keras callback setting `stop_training` (test_a_callback_of_the_caller_can_stop_a_run); "
                  "what `train` writes and resumes around it is the same code on every backend")
def test_a_run_paused_by_its_time_limit_is_continued_by_the_same_command(tmp_path, small, capsys):
    out, argv = tmp_path / "run", ["--steps", "12", "--steps-per-epoch", "4"]
    assert _run(out, small, *argv, "--max-minutes", "0.001") == 0  # past at the first epoch's end
    printed = capsys.readouterr().out
    assert "paused after step 4 of 12: --max-minutes 0.001 would pass during another epoch of" in printed
    assert printed.rstrip().endswith("}") and "the same command continues the run" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 4 and "--max-minutes 0.001" in metrics["paused"] and "stopped_early" not in metrics
    assert (out / "model.keras").is_file() and "test_accuracy" in metrics  # served and scored as a finished run
    with np.load(out / "state" / "state.npz") as data:
        assert int(data["epochs_done"]) == 1 and not bool(data["stopped"])
    assert _run(out, small, *argv) == 0  # without the limit: on to the end
    printed = capsys.readouterr().out
    assert f"resuming {out} after step 4" in printed and "paused after" not in printed
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 12 and "paused" not in metrics
    assert _run(out, small, *argv, "--max-minutes", "0.001") == 0
    assert "finished at step 12 of 12" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        _run(out, small, *argv, "--max-minutes", "0")
    assert exit_.value.code == 2 and "--max-minutes: must be a finite number >= 0.001, got 0" in capsys.readouterr().err


def test_a_progress_bar_only_in_a_terminal(monkeypatch):
    import argparse
    import io

    from keras_transformer.tools.commands.common import fit_verbosity

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdout", Terminal())
    assert fit_verbosity(argparse.Namespace(quiet=False)) == 1  # Keras' progress bar
    assert fit_verbosity(argparse.Namespace(quiet=True)) == 2  # one line per epoch
    assert fit_verbosity(argparse.Namespace()) == 1  # a command without --quiet
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # a pipe, a log file, CI
    assert fit_verbosity(argparse.Namespace(quiet=False)) == 2


@only_on("torch", "backend-independent (tokenizer files and the command line's checks)")
def test_a_damaged_tokenizer_is_one_line_naming_the_file_for_every_command(tmp_path, small, capsys):
    run = tmp_path / "run"
    assert _run(run, small, "--steps", "4") == 0
    (run / "metrics.json").unlink()  # not finished: the rerun resumes and reads the tokenizer
    kind = json.loads((run / "tokenizer" / "tokenizer.json").read_text())["kind"]
    vocab = run / "tokenizer" / ("sentencepiece.model" if kind == "sentencepiece" else "vocab.txt")
    for damage in ("missing", "garbled"):
        if damage == "missing":
            saved = vocab.read_bytes()
            vocab.unlink()
        else:
            vocab.write_bytes(b"\xff\xfe" + saved)
        before = _snapshot(run)
        capsys.readouterr()
        commands = [["train", "--output-dir", str(run), *small, "--steps", "4"],
                    ["evaluate", "--run-dir", str(run), "--limit", "2"],
                    ["translate", "--run-dir", str(run), "x y"],
                    ["export", "--run-dir", str(run), "--output", str(tmp_path / "export")]]
        # Every command with a missing file; a garbled one through the resumed run and one reader.
        for argv in commands if damage == "missing" else commands[::2]:
            assert cli.main(argv) == 2, (damage, argv)
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"The tokenizer file {vocab} " in err, (damage, argv, err)
            assert "restore the file from a copy of the run directory" in err
        assert _snapshot(run) == before and not (tmp_path / "export").exists()
    # The whole directory gone, after training began: not learned again (a vocabulary learned
    # anew may number its pieces otherwise, and the checkpoints are in the old ids).
    shutil.rmtree(run / "tokenizer")
    before = _snapshot(run)
    assert cli.main(commands[0]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{run / 'tokenizer'} is missing, but the run has trained" in err, err
    assert _snapshot(run) == before


@only_on("torch", "backend-independent (the corpus is read and split by the tools' own Python)")
def test_a_corpus_changed_since_the_run_started_is_refused_on_resume_and_by_evaluate(tmp_path, small, monkeypatch,
                                                                                      capsys):
    # The corpus by a relative path, as a user types it, in the directory train runs in.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "copy.tsv").write_text(pathlib.Path(small[1]).read_text())
    args = ["--tsv", "copy.tsv", *small[2:], "--steps", "4"]
    assert _run(tmp_path / "run", args) == 0
    assert len(json.loads((tmp_path / "run" / "data.json").read_text())["train_digest"]) == 64
    (tmp_path / "run" / "metrics.json").unlink()  # not finished: a rerun resumes and reads the corpus
    lines = (tmp_path / "copy.tsv").read_text().splitlines(keepends=True)
    (tmp_path / "copy.tsv").write_text("".join(lines[:-1]))  # one pair fewer: every split shifts
    before = _snapshot(tmp_path / "run")
    capsys.readouterr()
    for argv in (["train", "--output-dir", "run", *args], ["evaluate", "--run-dir", "run", "--limit", "2"]):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "The corpus (TSV copy.tsv (split seed 0)) is not the one the run in run " \
                                         "started with" in err, err
    assert _snapshot(tmp_path / "run") == before
    # A data record that cannot be read was taken for an older run's, which kept no digest:
    # the corpus went unchecked, and train wrote the record anew from the corpus given.
    for damaged, says in (("{", "JSONDecodeError"), ("[]", "ValueError: JSON [], not an object")):
        (tmp_path / "run" / "data.json").write_text(damaged)
        before = _snapshot(tmp_path / "run")
        for argv in (["train", "--output-dir", "run", *args], ["evaluate", "--run-dir", "run", "--limit", "2"]):
            assert cli.main(argv) == 2, argv
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"error: run/data.json is not the run's data record ({says}" in err, err
            assert "restore it from a copy of the run directory, or remove it to go on without that check." in err
        assert _snapshot(tmp_path / "run") == before
    # From another directory, the relative path in config.json names no file: said so.
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert cli.main(["evaluate", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--split test reads the run's corpus again, as" in err and "File not found: copy.tsv. Run evaluate " \
                                                                    "where train ran" in err, err


def test_corpus_digests_tell_the_pairs_and_their_splits():
    from keras_transformer.tools.text.corpora import Corpus

    corpus = Corpus(train=[("a", "b"), ("c", "d")], validation=[("e", "f")], test=[("g", "h")])
    same = Corpus(train=[("a", "b"), ("c", "d")], validation=[("e", "f")], test=[("g", "h")], description="other")
    moved = Corpus(train=[("a", "b")], validation=[("c", "d"), ("e", "f")], test=[("g", "h")])
    assert corpus.digest() == same.digest()
    assert len({corpus.digest(), moved.digest(), corpus.reversed().digest()}) == 3
    assert corpus.digest(["train"]) != moved.digest(["train"])
    shorter = Corpus(train=corpus.train, validation=[], test=[])  # held-out splits cut, as demo --eval-size does
    assert shorter.digest(["train"]) == corpus.digest(["train"]) and shorter.digest() != corpus.digest()


def test_training_curves_are_drawn_without_touching_matplotlibs_backend(tmp_path):
    import matplotlib

    from keras_transformer.tools.callbacks import plot_training_curves

    before = matplotlib.get_backend()
    matplotlib.use("svg")  # a user's own choice, which drawing the curves must keep
    try:
        log = tmp_path / "log.csv"
        log.write_text("epoch,loss,accuracy,val_loss,val_accuracy\n0,3.0,0.2,3.1,0.2\n1,2.0,0.5,2.2,0.4\n")
        assert plot_training_curves(log, tmp_path / "curves.png", steps_per_epoch=10)
        assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)


@pytest.mark.parametrize("argv, name", [
    ([], "numbers-tiny"),
    (["--preset", "small", "--reverse"], "numbers-reverse-small"),
    (["--tsv", "data/deu.txt"], "deu-tiny"),
    (["--tsv", "pairs.tsv.gz", "--preset", "base"], "pairs-base"),
    (["--source-file", "c/train.en.gz", "--target-file", "c/train.de.gz", "--reverse"], "train.en-de-reverse-tiny"),
    (["--source-file", "src.txt", "--target-file", "tgt.txt"], "src-tgt-tiny"),
    (["--tsv", "my data/.de en (v2).tsv"], "de_en__v2_-tiny"),
    (["--tsv", "d/.gz"], "tsv-tiny"),  # no letter or digit left: the corpus's name
    (["--source-file", "s/.txt", "--target-file", "t/.txt"], "files-tiny"),
])
def test_a_run_without_output_dir_is_named_after_its_corpus_and_preset(tmp_path, argv, name, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for flag in ("--tsv", "--source-file", "--target-file"):  # the files, there to be read
        if flag in argv:
            path = tmp_path / argv[argv.index(flag) + 1]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("a\tb\n")
    settings, status = cli.checked(cli.parse(["train", *argv]))
    assert status is None and settings.output_dir == os.path.join("runs", name)
    assert cli.checked(cli.parse(["train", *argv, "--output-dir", "mine"]))[0].output_dir == "mine"


def test_every_setting_is_a_flag_and_help_prints_each_default_once(capsys):
    import dataclasses

    from keras_transformer.tools.config import TrainConfig

    with pytest.raises(SystemExit):
        cli.parse(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for field in dataclasses.fields(TrainConfig):
        assert f"--{field.name.replace('_', '-')}" in text, field.name
    entries = re.split(r" (?=--[a-z-]+ )", text)
    assert "(default: None)" not in text and "(default: False)" not in text
    assert not [e for e in entries if "(default:" in e and "[default:" in e]
    # A flag parsed is the field's value: the defaults are the config's.
    defaults = cli.parse(["train"])
    assert {f.name: getattr(defaults, f.name) for f in dataclasses.fields(TrainConfig) if f.name != "corpus"} == \
        {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name != "corpus"}
