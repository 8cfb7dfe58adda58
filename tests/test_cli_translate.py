"""`keras-transformer demo`, `evaluate`, `translate` and `export` on a short run."""

import gzip
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading

import pytest

from keras_transformer.tools import cli
from tests.conftest import BACKEND, only_on


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo end to end, shortened: train, beam-search evaluation, export, reload.

    On JAX and PyTorch, a `train` run with the demo's model and tokenizer (the tiny preset,
    no dropout, WordPiece) and the library's default schedule: the demo's other steps are
    the commands and the export the tests below and test_export run on every backend, and
    each would start a TensorFlow child process here."""
    out = tmp_path_factory.mktemp("demo")
    if BACKEND == "tensorflow":
        argv = ["demo", "--output-dir", str(out), "--steps", "10", "--train-size", "1500", "--eval-size", "16"]
    else:
        argv = ["train", "--output-dir", str(out / "run"), "--steps", "10", "--train-size", "1500",
                "--preset", "tiny", "--dropout", "0", "--tokenizer", "wordpiece", "--validate-translations", "16"]
    assert cli.main([*argv, "--quiet"]) == 0
    return out


@only_on("tensorflow", "the demo's steps are train (the fixture on every backend), evaluate and translate "
                       "(test_evaluate_and_translate) and export (test_export, in every suite)")
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
    printed = capsys.readouterr()
    assert printed.out.count("\n") == 2 and printed.out.endswith("\n")  # one line each, empty or not
    assert printed.err == ""


@only_on("torch", "the warning is the command's own code; a new source width is a compilation on JAX and TensorFlow "
                  "(seconds), the first search of a shape on PyTorch runs eagerly")
def test_a_line_longer_than_the_run_trained_on_is_translated_with_a_warning(demo, capsys):
    run = str(demo / "run")
    longest = json.loads((demo / "run" / "config.json").read_text())["max_length"]
    assert cli.main(["translate", "--run-dir", run, "--beam-size", "1", "seven " * (longest + 1), "seven"]) == 0
    printed = capsys.readouterr()
    assert printed.out.count("\n") == 2
    assert printed.err == (f"keras-transformer translate: warning: 1 of the 2 texts is longer than the longest source "
                           f"the model was trained on ({longest} tokens, the run's --max-length): its translation "
                           "may stop short; split long texts into sentences\n")


@only_on("torch", "what the flag hands the model is the command's own code; the eager and compiled searches give "
                  "the same tokens on every backend in test_compiled_search")
def test_compile_flag_picks_the_search_and_false_gives_the_same_translations(demo, capsys, monkeypatch):
    import keras

    import keras_transformer as kt

    run = str(demo / "run")
    texts = ["forty-two", "seven hundred and one", "three"]
    seen, translate = [], kt.models.Transformer.translate

    def recording(self, *args, compile=True, **kwargs):
        seen.append(compile)
        # torch.compile's Inductor would take tens of seconds here: its search is
        # test_compiled_search's; this test checks what the flag hands the model.
        return translate(self, *args, compile=False if compile == "torch.compile" else compile, **kwargs)

    monkeypatch.setattr(kt.models.Transformer, "translate", recording)
    printed = {}
    for mode in ("true", "false"):
        assert cli.main(["translate", "--run-dir", run, "--beam-size", "2", "--compile", mode, *texts]) == 0
        printed[mode] = capsys.readouterr().out
        assert set(seen) == {mode == "true"}, (mode, seen)
        seen.clear()
    assert printed["false"] == printed["true"] and printed["true"].count("\n") == 3
    assert cli.main(["evaluate", "--run-dir", run, "--limit", "2", "--compile", "false"]) == 0
    assert set(seen) == {False}, seen
    seen.clear()
    capsys.readouterr()
    assert cli.main(["translate", "--run-dir", run, "--compile", "torch.compile", "seven"]) == 0
    assert set(seen) == {"torch.compile"}, seen
    seen.clear()
    # Another backend refuses it with one line, before the model loads.
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    capsys.readouterr()
    assert cli.main(["translate", "--run-dir", run, "--compile", "torch.compile", "seven"]) == 2 and seen == []
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--compile torch.compile runs on the PyTorch backend (KERAS_BACKEND=torch), not " \
                                    "on jax" in err, err


@only_on("jax", "reading and writing the files is the command's own code; the translations come from the "
                "search test_evaluate_and_translate runs on every backend")
def test_translate_a_file_into_a_file(demo, tmp_path, capsys, monkeypatch):
    from keras_transformer.tools import evaluation

    run = str(demo / "run")
    source = tmp_path / "in.txt"
    source.write_bytes(b"seven\r\n\nforty-two\nnine hundred and one\n")
    output = tmp_path / "out" / "de.txt"
    assert cli.main(["translate", "--run-dir", run, "--beam-size", "1", "--input", str(source),
                     "--output", str(output)]) == 0
    assert "4 translations in" in capsys.readouterr().out
    lines = output.read_text(encoding="utf-8").split("\n")
    assert len(lines) == 5 and lines[1] == "" and lines[4] == ""  # input order, the empty line kept
    # The same sentences on standard output give the same translations.
    assert cli.main(["translate", "--run-dir", run, "--beam-size", "1", "seven", "forty-two"]) == 0
    assert capsys.readouterr().out.splitlines() == [lines[0], lines[2]]
    # A file's name as TEXT (--input forgotten) is translated as a sentence, and said to be a file's.
    assert cli.main(["translate", "--run-dir", run, "--beam-size", "1", str(source), "seven"]) == 0
    printed = capsys.readouterr()
    assert len(printed.out.splitlines()) == 2 and printed.out.splitlines()[1] == lines[0], printed.out
    assert printed.err == (f"keras-transformer translate: warning: TEXT {str(source)!r} is the name of a file and is "
                           f"translated as a sentence; --input {source} translates the lines of the file\n"), printed.err
    # '-' is standard input and standard output.
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"seven\nforty-two\n")))
    assert cli.main(["translate", "--run-dir", run, "--beam-size", "1", "--input", "-", "--output", "-"]) == 0
    assert capsys.readouterr().out.splitlines() == [lines[0], lines[2]] and not (pathlib.Path.cwd() / "-").exists()
    # An output named .gz is gzip-compressed, as an input so named is read (it was plain
    # text under a .gz name, which --input then refused as a broken gzip file); so are
    # evaluate's hypotheses.
    assert cli.main(["translate", "--run-dir", run, "--beam-size", "1", "--input", str(source),
                     "--output", str(tmp_path / "de.txt.gz")]) == 0
    assert gzip.decompress((tmp_path / "de.txt.gz").read_bytes()).decode("utf-8") == output.read_text("utf-8")
    assert cli.main(["translate", "--run-dir", run, "--input", str(tmp_path / "de.txt.gz")]) == 0  # read back
    assert cli.main(["evaluate", "--run-dir", run, "--beam-size", "1", "--source-file", str(source), "--target-file",
                     str(source), "--hypotheses", str(tmp_path / "hypotheses.gz")]) == 0
    hypotheses = gzip.decompress((tmp_path / "hypotheses.gz").read_bytes()).decode("utf-8")
    assert hypotheses.split("\n") == [lines[0], lines[2], lines[3], ""]  # the pair with empty sides skipped
    # A link as --output stays a link: the file it leads to gets the translations.
    (tmp_path / "link.txt").symlink_to(tmp_path / "target.txt")
    assert cli.main(["translate", "--run-dir", run, "--beam-size", "1", "--output", str(tmp_path / "link.txt"),
                     "seven"]) == 0
    assert capsys.readouterr().out.endswith(f"1 translation in {tmp_path / 'link.txt'}\n")
    assert (tmp_path / "link.txt").is_symlink() and (tmp_path / "target.txt").read_text("utf-8") == lines[0] + "\n"
    os.mkfifo(tmp_path / "pipe")  # a write renamed into place would replace the pipe, not write to it
    # A pipe as --input (a shell's `<(command)`) is read as it comes, like standard input: a
    # chunk (4 lines with --batch-size 1) is translated while the pipe is still open.
    translated, translate_texts = threading.Event(), evaluation.translate_texts
    monkeypatch.setattr(evaluation, "translate_texts", lambda *a, **k: (translated.set(), translate_texts(*a, **k))[1])

    def writer():
        with open(tmp_path / "pipe", "wb", buffering=0) as pipe:
            pipe.write(b"seven\nforty-two\n" * 2)
            translated.wait(timeout=60)
            opened.append(translated.is_set())  # translated while the pipe was open
            pipe.write(b"seven\n")

    opened = []
    thread = threading.Thread(target=writer)
    thread.start()
    capsys.readouterr()
    assert cli.main(["translate", "--run-dir", run, "--beam-size", "1", "--batch-size", "1",
                     "--input", str(tmp_path / "pipe")]) == 0
    thread.join()
    assert opened == [True] and capsys.readouterr().out.splitlines() == [lines[0], lines[2]] * 2 + [lines[0]]
    monkeypatch.setattr(evaluation, "translate_texts", translate_texts)
    # /dev/null is no lines.
    assert cli.main(["translate", "--run-dir", run, "--input", os.devnull]) == 0
    assert capsys.readouterr().out == ""
    # A line past --max-input-length is cut, with one warning line of the command's own.
    assert cli.main(["translate", "--run-dir", run, "--beam-size", "1", "--max-input-length", "2",
                     "nine hundred and one thousand"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 1, captured
    assert captured.err.startswith("keras-transformer translate: warning: the text is longer than "
                                   "max_input_length=2 tokens") and captured.err.count("\n") == 1, captured.err
    # Long lines in two chunks of the input (4 lines each with --batch-size 1): one line for
    # the whole input, after the translations (it was one per chunk, each counting its own).
    long_lines = "nine hundred and one thousand\nseven\nseven\nseven\nnine hundred and one\n"
    (tmp_path / "long.txt").write_text(long_lines, "utf-8")
    assert cli.main(["translate", "--run-dir", run, "--beam-size", "1", "--batch-size", "1", "--max-input-length", "2",
                     "--input", str(tmp_path / "long.txt")]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 5, captured
    assert captured.err.startswith("keras-transformer translate: warning: 2 of the 5 texts are longer than "
                                   "max_input_length=2 tokens (the longest: "), captured.err
    assert captured.err.count("\n") == 1, captured.err
    # Standard input may never end: its chunks' warnings come as each is done.
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(long_lines.encode())))
    assert cli.main(["translate", "--run-dir", run, "--beam-size", "1", "--batch-size", "1", "--max-input-length", "2",
                     "--input", "-"]) == 0
    warned = capsys.readouterr().err.splitlines()
    assert [line.split(" longer")[0] for line in warned] == [
        "keras-transformer translate: warning: 1 of the 4 texts is", "keras-transformer translate: warning: the text is"]
    for argv, message in (
        (["--input", str(source), "seven"], "give TEXT arguments or --input FILE, not both"),
        (["--input", str(tmp_path / "missing.txt")], "File not found"),
        (["--input", str(tmp_path / ("a" * 300))], "File name too long"),  # was status 1, after loading the model
        (["--input", str(tmp_path)], "is a directory, not a file"),
        (["--input", str(source), "--output", str(tmp_path)], "is a directory, not a file"),
        (["--input", str(source), "--output", str(tmp_path / "pipe")], "it is not a regular file or a folder (a device, a pipe"),
        # A device that never ends was read until memory ran out; NUL bytes are not text.
        (["--input", "/dev/zero"], "/dev/zero, line 1: a NUL byte, which text never holds: binary data, not text"),
    ):
        assert cli.main(["translate", "--run-dir", run, *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("error:") == 1, err


@only_on("jax", "the n-best lines and the batching are the command's own code; the n-best search is checked "
                "against enumeration on every backend (test_decoding)")
def test_n_best_lists_the_beam_best_first(demo, capsys):
    from keras_transformer.tools import evaluation

    run = str(demo / "run")
    assert cli.main(["translate", "--run-dir", run, "--beam-size", "3", "--n-best", "3", "seven", "", "forty-two"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # Every input has its entry: an empty one, one empty translation (empty in, empty out).
    assert [line.split(" ||| ")[0] for line in lines] == ["0", "0", "0", "1", "2", "2", "2"]
    assert lines[3] == "1 |||  ||| 0.0000"
    lines = lines[:3] + lines[4:]
    for sentence in (lines[:3], lines[3:]):
        scores = [float(line.split(" ||| ")[2]) for line in sentence]
        assert scores == sorted(scores, reverse=True)
    # The first of each list is the translation beam search gives without --n-best.
    model, tokenizer = evaluation.load_run(run)
    best = evaluation.translate_texts(model, tokenizer, ["seven", "forty-two"], beam_size=3)
    assert [lines[0].split(" ||| ")[1], lines[3].split(" ||| ")[1]] == best
    # The default batch (by token budget: all of these in one) and batches of 2 agree.
    texts = ["seven", "forty-two", "nine hundred and one", "three", "twelve thousand and five"]
    assert evaluation.translate_texts(model, tokenizer, texts, beam_size=3) == evaluation.translate_texts(
        model, tokenizer, texts, beam_size=3, batch_size=2)
    # Greedy search's entry is scored too, as the search scores it (it said 0.0000, certainty).
    assert cli.main(["translate", "--run-dir", run, "--beam-size", "1", "--n-best", "1", "seven"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    (expected,) = evaluation.translate_texts(model, tokenizer, ["seven"], beam_size=1, n_best=1)
    assert line == f"0 ||| {expected[0][0]} ||| {expected[0][1]:.4f}" and expected[0][1] < 0, (line, expected)
    assert cli.main(["translate", "--run-dir", run, "--beam-size", "2", "--n-best", "3", "seven"]) == 2
    assert "--n-best 3 is more than the --beam-size 2 hypotheses" in capsys.readouterr().err


@only_on("jax", "how the command reads standard input is its own code; the search under it is checked in "
                "test_evaluate_and_translate, on every backend (on JAX each of the searches' shapes compiles "
                "in a fraction of the seconds a PyTorch export takes)")
def test_standard_input_is_translated_as_it_comes(demo, monkeypatch, capsys):
    """Standard input is read in chunks, each translated before the next is read: a pipe
    that never ends (`tail -f log | keras-transformer translate`) gets its translations."""
    from keras_transformer.tools import evaluation

    run = str(demo / "run")
    texts = ["seven", "three", "", "nine", "five", "six"] * 3  # short, alike: few search shapes to compile
    data = "\r\n".join(texts).encode() + b"\n"
    read = []

    class Pipe(io.BytesIO):  # gives at most 5 bytes a read: lines and line breaks are cut across reads
        def read1(self, size=-1):
            chunk = super().read1(5)
            read.append(self.tell())
            return chunk

    translate_texts = evaluation.translate_texts
    chunks = []

    def recording(model, tokenizer, chunk, *args, **kwargs):
        chunks.append((len(chunk), read[-1]))  # the chunk's size, and how much of the input was read by then
        return translate_texts(model, tokenizer, chunk, *args, **kwargs)

    monkeypatch.setattr(evaluation, "translate_texts", recording)
    # A line that is not UTF-8 after four chunks of 4 and two lines (--batch-size 1: chunks of
    # 4 lines on standard output): their translations, then one line naming it.
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(Pipe(data + b"caf\xe9\n")))
    assert cli.main(["translate", "--run-dir", run, "--beam-size", "1", "--batch-size", "1"]) == 2
    piped = capsys.readouterr()
    assert piped.err.strip().endswith(f"standard input, line {len(texts) + 1}: not valid UTF-8 (byte 3: b'\\xe9')")
    assert [size for size, _ in chunks] == [4, 4, 4, 4]
    assert chunks[0][1] < len(data) / 2  # the first chunk was translated with most of the input unread
    # The same sentences as arguments, in chunks too: an n-best list counts its lines from the
    # input's start, across chunks, and its translations are the piped ones.
    monkeypatch.setattr(evaluation, "translate_texts", translate_texts)
    assert cli.main(["translate", "--run-dir", run, "--beam-size", "1", "--n-best", "1", "--batch-size", "1",
                     *texts]) == 0
    lines = [line.split(" ||| ") for line in capsys.readouterr().out.splitlines()]
    assert [number for number, _, _ in lines] == [str(i) for i in range(len(texts))]
    assert piped.out.splitlines() == [translation for _, translation, _ in lines[:16]]


@only_on("jax", "how the command reads a terminal is its own code; the search under it is checked in "
                "test_evaluate_and_translate, on every backend")
def test_a_terminal_gets_each_translation_when_its_line_is_typed(demo, monkeypatch, capsys):
    import queue

    run = str(demo / "run")
    assert cli.main(["translate", "--run-dir", run, "--beam-size", "1", "seven", "forty-two"]) == 0
    expected = capsys.readouterr().out.splitlines()
    typed = queue.Queue()

    class Terminal(io.BytesIO):  # a terminal gives a read each line its user ends with Enter
        def isatty(self):
            return True

        def read1(self, size=-1):
            return typed.get(timeout=300)

    class Screen(io.StringIO):
        def __init__(self):
            super().__init__()
            self.lines = queue.Queue()

        def write(self, text):
            if text != "\n":  # print's line, then its line break
                self.lines.put(text)
            return super().write(text)

    screen = Screen()
    shown = []

    def user():  # types a line, waits for its translation, types the next; then Ctrl-D
        for line in (b"seven\n", b"forty-two\n"):
            typed.put(line)
            try:
                shown.append(screen.lines.get(timeout=60))
            except queue.Empty:
                shown.append(None)  # not shown while the terminal was open
        typed.put(b"")

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(Terminal()))
    monkeypatch.setattr(sys, "stdout", screen)
    thread = threading.Thread(target=user)
    thread.start()
    try:
        assert cli.main(["translate", "--run-dir", run, "--beam-size", "1"]) == 0
    finally:
        thread.join()
    assert shown == expected
    assert capsys.readouterr().err == (
        "keras-transformer translate: type a sentence and press Enter to translate it; Ctrl-D ends.\n")


@only_on("torch", "the command's --quantize is backend-independent code (load, model.quantize); the int8 "
                  "search on each backend is test_compiled_search's quantize test, in every suite")
def test_quantize_int8_translates_with_keras_int8_weights(demo, capsys):
    from keras_transformer.tools import evaluation

    run, texts = str(demo / "run"), ["seven", "forty-two", "nine hundred and one"]

    def n_best(*flags):
        assert cli.main(["translate", "--run-dir", run, "--beam-size", "2", "--n-best", "1", *flags, *texts]) == 0
        return [line.split(" ||| ") for line in capsys.readouterr().out.splitlines()]

    float32, int8 = n_best(), n_best("--quantize", "int8")
    # The library's search on Keras' int8 model: the command's translations and scores.
    model, tokenizer = evaluation.load_run(run, quantize="int8")
    kernels = [w for w in model.weights if w.path.endswith("/kernel")]  # every Dense layer's
    assert kernels and all(k.dtype == "int8" for k in kernels), {k.path: k.dtype for k in kernels}
    expected = evaluation.translate_texts(model, tokenizer, texts, beam_size=2, n_best=1)
    assert [t for _, t, _ in int8] == [t for [(t, _)] in expected]
    assert [float(s) for _, _, s in int8] == pytest.approx([s for [(_, s)] in expected], abs=2e-4)
    # int8 is not float32: the scores move (so the check above can fail).
    assert max(abs(float(a[2]) - float(b[2])) for a, b in zip(float32, int8)) > 1e-4
    with pytest.raises(SystemExit) as exit:
        cli.main(["translate", "--run-dir", run, "--quantize", "int4", "seven"])
    assert exit.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err


@pytest.mark.skipif(BACKEND != "tensorflow",
                    reason="export always runs on TensorFlow (a child process under JAX and PyTorch, the code this "
                           "TensorFlow test runs in-process); one backend keeps CI short")
def test_export_quantize_int8_writes_a_smaller_saved_model_with_int8_kernels(demo, tmp_path, capsys):
    import tensorflow as tf

    from keras_transformer.tools import saved_model_client

    run, texts = str(demo / "run"), ["seven", "forty-two", "nine hundred and one"]
    assert cli.main(["export", "--run-dir", run, "--output", str(tmp_path / "int8"), "--quantize", "int8",
                     "--beam-size", "1"]) == 0
    out = capsys.readouterr().out  # the command's report, then how to serve what it wrote
    assert f"SavedModel written to {tmp_path / 'int8'} (Dense layers int8)" in out and "tensorflow/serving" in out
    assert (tmp_path / "int8" / "saved_model.pb").is_file()
    saved = tf.saved_model.load(str(tmp_path / "int8"))
    kernels = [v for v in saved.model_variables if v.name.split(":")[0].endswith("kernel")]
    assert kernels and all(v.dtype == tf.int8 for v in kernels), {v.name: v.dtype for v in kernels}
    # It serves what the library's int8 search gives on the same batch (greedy, as exported;
    # this barely trained model's outputs run to the longest the batch's width allows).
    from keras_transformer.tools import evaluation

    model, tokenizer = evaluation.load_run(run, quantize="int8")
    expected = tokenizer.detokenize_dense(model.translate(tokenizer.tokenize_dense(texts).numpy(), beam_size=1))
    assert saved_model_client.translate(tmp_path / "int8", texts) == expected

    def size(path):
        return sum(f.stat().st_size for f in (path / "variables").iterdir())

    assert size(tmp_path / "int8") < 0.8 * size(demo / "translator")  # float32 demo export, same run
    # --quantize is Keras'; CTranslate2's weight types are --quantization's.
    assert cli.main(["export", "--run-dir", run, "--output", str(tmp_path / "ct2"), "--format", "ctranslate2",
                     "--quantize", "int8"]) == 2
    assert "give its weight type with --quantization" in capsys.readouterr().err
    assert not (tmp_path / "ct2").exists()


def test_missing_or_broken_checkpoint_exits_2(tmp_path, capsys):
    assert cli.main(["evaluate", "--run-dir", str(tmp_path / "nowhere")]) == 2
    assert "No run directory" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "model.keras").write_text("not a model")
    assert cli.main(["export", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "model.keras is not a Keras model file (ValueError: not a zip archive" in err and err.count("error:") == 1
    assert "Remove" not in err, err  # no config.json: not a directory train wrote, so no advice to rerun it
    # In a run directory, the message says how `train` writes the model again.
    from keras_transformer.tools import evaluation
    from keras_transformer.tools.files import RunDirError

    (tmp_path / "run" / "config.json").write_text("{}")
    (tmp_path / "run" / "best").mkdir()
    for model_file in (tmp_path / "run" / "model.keras", tmp_path / "run" / "best" / "model.keras"):
        model_file.write_bytes(b"PK\x03\x04 cut short")
        with pytest.raises(RunDirError, match=re.escape(f"Remove {tmp_path / 'run' / 'metrics.json'} and run the same")):
            evaluation.load_model_file(model_file)


def _console(*args, stdin=None, env_drop=("TF_CPP_MIN_LOG_LEVEL",), env_set=None, memory=None):
    """The installed command's code path (`keras_transformer_cli.main`) in a child process
    (with at most `memory` bytes of address space, if given)."""
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env.update(env_set or {})
    limit = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory})); " if memory else ""
    return subprocess.run([sys.executable, "-c", limit + "import sys, keras_transformer_cli; "
                           "sys.exit(keras_transformer_cli.main())", *args],
                          input=stdin, capture_output=True, timeout=300, env=env)


def test_the_command_line_is_quiet_and_reads_any_line_ending(demo, tmp_path):
    run = str(demo / "run")
    # Standard input of a real process: every line gets one line, in order.
    result = _console("translate", "--run-dir", run, "--beam-size", "1", stdin=b"one\r\n\ntwo\rthree\n")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.decode().split("\n")
    assert len(lines) == 5 and lines[4] == "", lines  # \r\n, \r and \n all end a line
    assert lines[1] == "", lines  # an empty line translates to an empty line
    # No TensorFlow / XLA start-up lines (CUDA probing on a CPU-only machine) unless asked for.
    assert _noise(result.stderr) == [], _noise(result.stderr)
    # A user's TF_CPP_MIN_LOG_LEVEL=2 (as in CI) asks for quiet too; the error (found once
    # the backend has loaded: the model file is not one) is one line.
    (tmp_path / "model.keras").write_text("not a model")
    (tmp_path / "config.json").write_bytes((demo / "run" / "config.json").read_bytes())  # read before the model
    result = _console("evaluate", "--run-dir", str(tmp_path), env_set={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 2 and _noise(result.stderr) == [], result.stderr.decode()[-2000:]
    last = result.stderr.decode().strip().splitlines()[-1]
    assert last.startswith("keras-transformer evaluate: error: ") and "is not a Keras model file" in last, last


@only_on("jax", "what the command prints is its own code; each backend's out-of-memory error is recognised in "
                "test_compiled_search, in every suite (provoked here, TensorFlow's allocator retries for 10 s)")
def test_running_out_of_memory_is_one_line_naming_the_flags_that_ask_for_less(demo):
    # A beam of a million asks for 12 GB and more on every backend (115 GB on JAX): each
    # backend's out-of-memory error (XLA's, TensorFlow's, PyTorch's CPU allocator's) was a
    # traceback and "internal error (a bug in keras-transformer)", and on TensorFlow the
    # compiled search's failure made it search again, eagerly, before running out again.
    # (The process itself needs 3-4 GB of address space to start.)
    result = _console("translate", "--run-dir", str(demo / "run"), "--beam-size", "1000000", "seven",
                      env_set={"TF_CPP_MIN_LOG_LEVEL": "2"}, memory=8 << 30)
    err = result.stderr.decode()
    assert result.returncode == 1 and err.count("\n") == 1, err[-3000:]
    assert err.startswith("keras-transformer translate: error: out of memory (") and err.endswith(
        "); give a smaller --batch-size, --beam-size or --max-input-length\n"), err


def _noise(stderr):
    return [line for line in stderr.decode().splitlines()
            if re.match(r"^([IWE]0000|WARNING: All log|To enable the following instructions)", line)]


def test_start_up_lines_follow_the_users_log_level():
    info = "I0000 00:00:1796162158.346437   11380 cudart_stub.cc:31] Could not find cuda drivers on your machine"
    error = "E0000 00:00:1796162158.3 cuda_executor.cc:1228] failed call to cuInit: INTERNAL: CUDA error"
    warning = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
    cpu = "To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow"
    own = ["Epoch 1/3", "keras-transformer train: error: --steps must be >= 1; got 0"]
    lines = [info, error, warning, cpu, *own]

    def kept(level):
        return [line for line in lines if not cli._is_start_up_noise(line, level)]

    assert kept(0) == lines
    assert kept(1) == [error, warning, *own]
    assert kept(2) == kept(3) == own


@only_on("tensorflow", "the checks are the command line's own code, made before a model loads; they read "
                       "the demo's SavedModel")
def test_translate_and_evaluate_refuse_bad_input(demo, tmp_path, monkeypatch, capsys):
    run = str(demo / "run")
    # Standard input is read as bytes (`sys.stdin.buffer`), as from a pipe.
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"one\n\xff\xfe\n")))
    assert cli.main(["translate", "--run-dir", run]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and err.strip().endswith("standard input, line 2: not valid UTF-8 (byte 0: b'\\xff')"), err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"one\ntwo\n\x00")))
    assert cli.main(["translate", "--run-dir", run]) == 2
    assert capsys.readouterr().err.strip().endswith("standard input, line 3: a NUL byte, which text never holds: "
                                                    "binary data, not text")
    # Beam x vocabulary candidates are ranked with int32 indices: a larger beam failed inside
    # JAX, or the process was killed for memory.
    for command in (["translate", "seven"], ["evaluate"], ["export", "--output", str(tmp_path / "sm")]):
        assert cli.main([command[0], "--run-dir", run, "--beam-size", "2147483647", *command[1:]]) == 2
        err = capsys.readouterr().err
        assert re.fullmatch(rf"keras-transformer {command[0]}: error: --beam-size 2147483647 is more than a search "
                            r"over this run's \d+ vocabulary pieces can keep .*: give a --beam-size of at most "
                            r"[\d,]+\n", err), err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert cli.main(["evaluate", "--run-dir", run, "--source-file", str(empty), "--target-file", str(empty)]) == 2
    # A file that cannot be read is named before the model loads (it was, seconds later).
    from keras_transformer.tools.commands import evaluate

    capsys.readouterr()
    with monkeypatch.context() as patch:
        patch.setattr(evaluate, "load_run", lambda args: pytest.fail("the model was loaded"))
        missing = tmp_path / "missing.txt"
        for source, target, says in ((missing, empty, f"--source-file: File not found: {missing}."),
                                     (empty, tmp_path, f"--target-file: {tmp_path} is a directory, not a file.")):
            argv = ["evaluate", "--run-dir", run, "--source-file", str(source), "--target-file", str(target)]
            assert cli.main(argv) == 2
            assert capsys.readouterr().err == f"keras-transformer evaluate: error: {says}\n"
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    assert cli.main(["export", "--run-dir", run, "--output", str(a_file)]) == 2
    assert a_file.read_text() == "mine"
    # The export replaces its directory as a whole: only an earlier SavedModel may be there.
    capsys.readouterr()
    assert cli.main(["export", "--run-dir", run, "--output", str(tmp_path)]) == 2
    assert f"--output {tmp_path} holds files that are not a SavedModel export (a_file, empty.txt)" in capsys.readouterr().err
    assert a_file.read_text() == "mine"
    from keras_transformer.tools.commands import export

    assert export.check(cli.parse(["export", "--run-dir", run, "--output", str(demo / "translator")])) is None
    (tmp_path / "translator").mkdir()
    (tmp_path / "translator" / "notes.txt").write_text("mine")
    assert cli.main(["demo", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err  # named by demo's own flag (it has no --output)
    assert f"--output-dir {tmp_path}: its {tmp_path / 'translator'} holds files that are not a SavedModel export (notes.txt)" in err
    # An --output that is the --input file, under any name, would replace the sentences.
    notes = tmp_path / "notes.txt"
    notes.write_text("one two\n")
    (tmp_path / "link.txt").symlink_to(notes)
    os.link(notes, tmp_path / "hard.txt")
    capsys.readouterr()
    for output in (notes, tmp_path / "sub" / ".." / "notes.txt", tmp_path / "link.txt", tmp_path / "hard.txt"):
        assert cli.main(["translate", "--run-dir", run, "--input", str(notes), "--output", str(output)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is the --input file" in err, (output, err)
    assert notes.read_text() == "one two\n" and not (tmp_path / "sub").exists()
    # So would evaluate's --hypotheses over its --source-file or --target-file.
    (tmp_path / "references.txt").write_text("eins zwei\n")
    for hypotheses, named in ((tmp_path / "link.txt", "--source-file"), (tmp_path / "references.txt", "--target-file")):
        assert cli.main(["evaluate", "--run-dir", run, "--source-file", str(notes), "--target-file",
                         str(tmp_path / "references.txt"), "--hypotheses", str(hypotheses)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--hypotheses {hypotheses} is the {named} file" in err, err
    assert notes.read_text() == "one two\n" and (tmp_path / "references.txt").read_text() == "eins zwei\n"
    # And over the corpus file the run's config names, which --split reads (it overwrote it).
    corpus, tsv_run = tmp_path / "pairs.tsv", tmp_path / "tsv_run"
    corpus.write_text("one\teins\n")
    (tmp_path / "pairs_link.tsv").symlink_to(corpus)
    tsv_run.mkdir()
    shutil.copy(demo / "run" / "model.keras", tsv_run)
    config = json.loads((demo / "run" / "config.json").read_text())
    (tsv_run / "config.json").write_text(json.dumps(dict(config, corpus="tsv", tsv=str(corpus))))
    for hypotheses in (corpus, tmp_path / "pairs_link.tsv"):
        assert cli.main(["evaluate", "--run-dir", str(tsv_run), "--hypotheses", str(hypotheses)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--hypotheses {hypotheses} is the run's --tsv file {corpus}" in err, err
    assert corpus.read_text() == "one\teins\n"
    # "-" is standard output to translate; evaluate's scores go there, and it wrote a file named "-".
    monkeypatch.chdir(tmp_path)
    assert cli.main(["evaluate", "--run-dir", run, "--hypotheses", "-"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--hypotheses -: evaluate writes its scores to standard output" in err, err
    assert not (tmp_path / "-").exists()
    # As a file to read, "-" is standard input, as for translate (it was "File not found: -").
    checked = evaluate.check(cli.parse(["evaluate", "--run-dir", run, "--source-file", "-", "--target-file", str(notes)]))
    assert (checked["source_file"], checked["target_file"]) == ("/dev/stdin", str(notes))
    assert cli.main(["evaluate", "--run-dir", run, "--source-file", "-", "--target-file", "-"]) == 2
    assert "--source-file and --target-file cannot both be standard input (-)" in capsys.readouterr().err
    # --split names the run's own pairs: with files as well, one of the two was ignored.
    assert cli.main(["evaluate", "--run-dir", run, "--split", "validation", "--source-file", str(notes),
                     "--target-file", str(tmp_path / "references.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--split validation picks the run's own held-out pairs" in err, err
    # An output over one of the run's own files (under any name) would destroy the run.
    (tmp_path / "run_link").symlink_to(demo / "run")
    before = {p: p.read_bytes() for p in (demo / "run").rglob("*") if p.is_file() and "tensorboard" not in p.parts}
    for argv in (["translate", "--run-dir", run, "--output", str(demo / "run" / "model.keras"), "x"],
                 ["translate", "--run-dir", run, "--output", str(tmp_path / "run_link" / "config.json"), "x"],
                 ["evaluate", "--run-dir", run, "--hypotheses", str(demo / "run" / "tokenizer" / "vocab.txt")],
                 ["export", "--run-dir", run, "--output", str(demo / "run" / "best")],
                 ["translate", "--run-dir", run, "--output", str(demo / "run" / "config.tmp-1-1.json"), "x"],
                 ["export", "--run-dir", run, "--output", str(demo / "run" / "best.old-1-1")],
                 ["export", "--run-dir", run, "--output", run]):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ("is the run's own" in err or "is the run directory itself" in err), err
    assert {p: p.read_bytes() for p in before} == before


def test_parsing_imports_no_backend():
    code = """
import sys, time
import keras_transformer_cli
from keras_transformer.tools import cli
start = time.perf_counter()
for argv in (["train", "--steps", "3"], ["translate", "x"], ["evaluate"], ["export"], ["demo"]):
    cli.parse(argv)
print(sorted(m for m in ("tensorflow", "jax", "torch", "keras") if m in sys.modules), time.perf_counter() - start)
"""
    # The launcher's way: the package's __init__ (which loads Keras) has not run yet.
    launcher = """
import importlib.util, sys
spec = importlib.util.find_spec("keras_transformer")
sys.modules["keras_transformer"] = importlib.util.module_from_spec(spec)
""" + code
    result = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    modules, seconds = result.stdout.split("]")
    assert modules == "[", modules
    help_run = subprocess.run([sys.executable, "-c", "import sys, keras_transformer_cli; keras_transformer_cli.main(['train', '--help'])"],
                              capture_output=True, text=True, timeout=60)
    assert help_run.returncode == 0 and "--output-dir" in help_run.stdout


def test_checking_a_command_leaves_its_parsed_flags_as_they_were(demo, tmp_path):
    run = str(demo / "run")
    for argv in (["translate", "--run-dir", run, "--output", str(tmp_path / "out.txt"), "seven"],
                 ["evaluate", "--run-dir", run, "--limit", "2"],
                 ["export", "--run-dir", run, "--output", str(tmp_path / "saved")],
                 ["train", "--output-dir", str(tmp_path / "run"), "--steps", "3"],
                 ["launch", "--processes", "2", "--", "train", "--output-dir", str(tmp_path / "run")]):
        args = cli.parse(argv)
        before = dict(vars(args))
        assert cli.check(args) is None, argv
        assert vars(args) == before, argv  # what check derives goes to run, not into the flags


def test_evaluate_names_a_missing_or_damaged_run_config_before_the_model_loads(tmp_path, monkeypatch, capsys):
    # A run's split is read again as its config.json names the corpus. Missing, it was a
    # FileNotFoundError quoted in the line, after the model had loaded.
    from keras_transformer.tools.commands import evaluate

    monkeypatch.setattr(evaluate, "load_run", lambda args: pytest.fail("the model was loaded"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "model.keras").write_bytes(b"")
    config = run / "config.json"
    for text, says in ((None, f"{config} is missing: --split validation reads the run's corpus as it names it. "
                              "Restore it from a copy of the run directory, or give --source-file and --target-file."),
                       ("[]", f"{config} is not a run config (ValueError: JSON [], not an object)."),
                       ('{"steps": 10, "colour": "red"}', f"{config} is not a run config (TypeError: ")):
        if text is not None:
            config.write_text(text)
        assert cli.main(["evaluate", "--run-dir", str(run), "--split", "validation"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"keras-transformer evaluate: error: {says}"), err
