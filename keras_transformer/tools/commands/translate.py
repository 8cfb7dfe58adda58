"""`keras-transformer translate`: sentences from arguments, a file or standard input."""

from __future__ import annotations

import itertools
import os
import pathlib
import stat
import sys
import warnings

from keras_transformer.tools.commands.common import (COMPILE_MODES, add_command, at_least, check_not_an_input,
                                                      check_writable, decoding_flags, fit_verbosity, load_run,
                                                      path, quantize_flag, run_dir_flag)
from keras_transformer.tools.config import RunError, say
from keras_transformer.tools.files import input_problem, run_model_file


def add_parser(sub) -> None:
    p = add_command(
        sub,
        "translate",
        help="Translate sentences given as arguments or on standard input.",
        description="Translate each TEXT argument, each line of --input FILE, or each line of standard "
                    "input; one translation per line, in input order, on standard output or in --output FILE. "
                    "Standard input is translated as it comes, in chunks; from a terminal, line by line.",
    )
    p.add_argument("texts", nargs="*", metavar="TEXT")
    p.add_argument("--input", type=path, metavar="FILE",
                   help="Translate the lines of this file (plain or .gz, or a pipe such as <(command), read as "
                        "it comes; '-': standard input).")
    p.add_argument("--output", type=path, metavar="FILE",
                   help="Write the translations to this file (in place once all are done; gzip-compressed for a "
                        "name ending in .gz) and show progress ('-': standard output, as without --output).")
    p.add_argument("--n-best", type=at_least(1), metavar="K",
                   help="Print the K best hypotheses of the beam per sentence (K <= --beam-size), as "
                        "'LINE ||| TRANSLATION ||| SCORE' lines (Moses n-best format; LINE counts from 0, "
                        "SCORE is log P / length penalty).")
    run_dir_flag(p)
    decoding_flags(p)
    quantize_flag(p, "translating")
    p.set_defaults(handler=run, check=check)


def check(args) -> dict:
    if args.input and args.texts:
        raise RunError("give TEXT arguments or --input FILE, not both")
    if args.n_best and args.n_best > args.beam_size:
        raise RunError(f"--n-best {args.n_best} is more than the --beam-size {args.beam_size} hypotheses the "
                       "search keeps; raise --beam-size or lower --n-best")
    # '-' is standard input or output, as without the flag.
    source = None if args.input == "-" else args.input
    problem = source and input_problem(source, streams=True)  # before the model loads
    if problem:
        raise RunError(f"--input: {problem}")
    output = None if args.output in (None, "-") else pathlib.Path(args.output)
    if output is not None:
        if output.is_dir():
            raise RunError(f"--output {output} is a directory, not a file")
        check_writable("--output", output, args.run_dir)
        check_not_an_input("--output", output, {"--input": source})
    run_model_file(args.run_dir, args.model)
    return {"input": source, "output": output}


def run(args) -> int:
    from keras_transformer.tools import evaluation, files

    output = args.output
    named = next((text for text in args.texts if not text.split()[1:] and os.path.isfile(text)), None)
    if named is not None:  # `translate notes.txt`, meant as `translate --input notes.txt`
        warnings.warn(f"TEXT {named!r} is the name of a file and is translated as a sentence; "
                      f"--input {named} translates the lines of the file", stacklevel=1)
    # Sentences are sorted by length within a chunk (fewer pads, fewer shapes); a file
    # gets larger chunks, standard output smaller ones so that lines appear sooner.
    chunk_size = (args.batch_size or 64) * (16 if output else 4)
    interactive = not (args.texts or args.input) and sys.stdin.isatty()
    chunks, total = _input(args, chunk_size, interactive)
    if interactive:  # the model first, then the user types
        model, tokenizer = load_run(args)
        say("keras-transformer translate: type a sentence and press Enter to translate it; Ctrl-D ends.")
    else:  # a mistake at the start of the input is found before the model loads
        chunks = itertools.chain([next(chunks, [])], chunks)
        model, tokenizer = load_run(args)
    progress = None
    if output is not None:
        import keras

        progress = keras.utils.Progbar(total, unit_name="sentence", verbose=fit_verbosity(args))
    translations, done = [], 0
    trained_length = files.run_setting(args.run_dir, "max_length")  # for a warning: None if not an int
    trained_length = trained_length if type(trained_length) is int and trained_length > 0 else None
    # The LongTextWarnings of a file's or the arguments' chunks, shown as one line per kind at
    # the end; a stream's (standard input, a pipe: it may never end) as each chunk is done.
    long_texts = []
    for chunk in chunks:
        with warnings.catch_warnings(record=total is not None) as caught:
            lines = evaluation.translate_texts(model, tokenizer, chunk, args.beam_size, args.length_penalty,
                                               args.batch_size, n_best=args.n_best or 0,
                                               max_input_length=args.max_input_length,
                                               compile=COMPILE_MODES[args.compile], trained_length=trained_length)
        for caught_warning in caught or ():
            if isinstance(caught_warning.message, evaluation.LongTextWarning):
                long_texts.append(caught_warning.message)
            else:
                warnings.showwarning(caught_warning.message, caught_warning.category, caught_warning.filename,
                                     caught_warning.lineno)
        if args.n_best:
            lines = [f"{done + i} ||| {text} ||| {score:.4f}"
                     for i, hypotheses in enumerate(lines) for text, score in hypotheses]
        done += len(chunk)
        if output is None:
            for line in lines:
                print(line, flush=True)
        else:
            translations += lines
            progress.add(len(chunk))
    for combined in evaluation.LongTextWarning.combined(long_texts, done):
        warnings.warn(combined, stacklevel=1)
    if output is not None:
        evaluation.write_lines(output, translations)  # gzip-compressed for a name ending in .gz
        per_sentence = f" ({args.n_best} per sentence)" if args.n_best else ""
        print(f"{done} translation{'' if done == 1 else 's'} in {output}{per_sentence}", flush=True)
    return 0


def _input(args, chunk_size: int, interactive: bool):
    """The sentences in chunks of `chunk_size`, and how many there are (`None` for a stream:
    standard input, a pipe or a device given as --input, read as it comes: it may never
    end, and a terminal's lines are translated one by one as they are typed)."""
    from keras_transformer.tools.text import corpora

    if args.texts:
        texts = args.texts
    elif args.input and not _a_stream(args.input):
        texts = corpora.read_lines(args.input, streams=True)  # a regular file, or a .gz one from a pipe
    else:
        return _stream_chunks(args.input, chunk_size, interactive), None
    return (texts[i:i + chunk_size] for i in range(0, len(texts), chunk_size)), len(texts)


def _a_stream(path: str) -> bool:
    """Whether `path` is a pipe or a device (`<(command)`, `/dev/stdin`) of plain text."""
    try:
        mode = os.stat(path).st_mode
    except OSError:  # missing, a name too long: `corpora.read_lines` says which
        return False
    return (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISSOCK(mode)) and not path.endswith(".gz")


def _stream_chunks(path, chunk_size: int, interactive: bool):
    from keras_transformer.tools.text import streams

    if path is None:
        yield from streams.line_chunks(sys.stdin.buffer, "standard input", chunk_size, interactive)
        return
    with open(path, "rb") as stream:
        yield from streams.line_chunks(stream, path, chunk_size)
