"""What the commands share: the help format, the run-directory and decoding flags, checks
of flag values, Keras' verbosity. Imports no backend."""

from __future__ import annotations

import argparse
import math
import os
import sys

from keras_transformer.defaults import (BEAM_SIZE, DECODE_BATCH_TOKENS, DECODE_MAX_BATCH, LENGTH_PENALTY,
                                        MAX_INPUT_LENGTH, MAX_INT, MAX_LENGTH_PENALTY, QUANTIZE_MODES)


# `--compile`'s choices, as `Transformer.translate`'s `compile` argument.
COMPILE_MODES = {"true": True, "false": False, "torch.compile": "torch.compile"}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default once: argparse's `(default: ...)`, except where there is none to
    show (`None`, an off switch) or the help already says it (`[default: ...]`)."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "[default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def check_writable(flag: str, path, run_dir=None) -> None:
    """Refuse an output path this process cannot write, or one of the files of the run in
    `run_dir` (`files.creation_problem`), before anything is loaded."""
    from keras_transformer.tools.config import RunError
    from keras_transformer.tools.files import creation_problem

    problem = creation_problem(path, run_dir)
    if problem:
        raise RunError(f"{flag} {path}: {problem}; give another {flag}")


def check_not_an_input(flag: str, output, inputs: dict) -> None:
    """Refuse an output path that names one of the command's input files (`{flag: path}`),
    under any name (a link, a hard link, another spelling): writing the output there would
    replace what the command reads."""
    from keras_transformer.tools.config import RunError

    for input_flag, path in inputs.items():
        if path is not None and _same_file(path, output):
            raise RunError(f"{flag} {output} is the {input_flag} file {path}; writing there would replace what "
                           f"it holds. Give another {flag}")


def load_run(args):
    """The run's `(model, tokenizer)` for a command that searches (`--run-dir`, `--model`,
    `--quantize`), refusing `--compile torch.compile` off PyTorch (`check_compile`) and a
    `--beam-size` larger than the search can keep for this vocabulary
    (`_checks.largest_beam`: a larger top-k failed inside JAX, or ran out of memory)."""
    from keras_transformer._checks import largest_beam
    from keras_transformer.tools import evaluation
    from keras_transformer.tools.config import RunError

    check_compile(args)  # before the model loads
    model, tokenizer = evaluation.load_run(args.run_dir, args.model, quantize=args.quantize)
    largest = largest_beam(model.vocab_size)
    if args.beam_size > largest:
        raise RunError(f"--beam-size {args.beam_size} is more than a search over this run's {model.vocab_size:,} "
                       f"vocabulary pieces can keep (beam x vocabulary candidates are ranked with int32 indices): "
                       f"give a --beam-size of at most {largest:,}")
    return model, tokenizer


def check_compile(args) -> None:
    """Refuse `--compile torch.compile` (of `translate` and `evaluate`) on a backend other
    than PyTorch. Loads the backend (Keras reads it from `KERAS_BACKEND` or its config file)."""
    import keras

    from keras_transformer.tools.config import RunError

    if getattr(args, "compile", None) == "torch.compile" and keras.backend.backend() != "torch":  # export has none
        raise RunError(f"--compile torch.compile runs on the PyTorch backend (KERAS_BACKEND=torch), not on "
                       f"{keras.backend.backend()}: give --compile true or false, or set KERAS_BACKEND=torch")


def _same_file(a, b) -> bool:
    """Whether two paths name one file (also through links or another spelling)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): compare where they lead
        return os.path.realpath(a) == os.path.realpath(b)


def add_command(sub, name: str, help: str, description: str) -> argparse.ArgumentParser:
    """A sub-command's parser, its defaults shown in --help, its flags written out whole (an
    abbreviation is refused, with the flag it may mean)."""
    return sub.add_parser(name, help=help, description=description, formatter_class=_HelpFormatter,
                          allow_abbrev=False)


def run_dir_flag(p) -> None:
    p.add_argument("--run-dir", type=path, default="runs/numbers-tiny",
                   help="A directory written by `train` (its --output-dir, which it prints when it starts and ends).")
    p.add_argument("--model", choices=["final", "best"], default="final",
                   help="final: RUN_DIR/model.keras (checkpoints averaged). best: RUN_DIR/best/model.keras, the "
                        "epoch with the best validation BLEU (runs trained with --validate-translations).")


def quantize_flag(p, what: str) -> None:
    p.add_argument("--quantize", choices=QUANTIZE_MODES,
                   help=f"Quantize the model's Dense layers to int8 with Keras' model.quantize before {what} "
                        "(the embedding and layer norms stay float); see docs/guides/export.md for what it costs "
                        "in BLEU and gains in size and speed on each backend.")


def _parse_integer(text: str) -> int:
    """`text` as an integer written in ASCII digits (`int` also reads other scripts' digits,
    `٣`); `ValueError` otherwise."""
    stripped = text.strip()
    digits = stripped[1:] if stripped[:1] in ("+", "-") else stripped
    if not (digits.isascii() and digits.isdigit()):
        raise ValueError(text)
    return int(stripped)


def path(text: str) -> str:
    """An argparse type: a file or folder name, refused when empty (`--tsv "$CORPUS"` with
    the variable unset read as no flag at all, or as the current folder)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file or folder name, got ''")
    return text


def integer(text: str, maximum: int | None = MAX_INT) -> int:
    """An argparse type: an integer in ASCII digits, at most `maximum` (each flag's own
    range is checked where the flag is; `maximum=None` for one whose check covers every
    integer)."""
    try:
        value = _parse_integer(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if maximum is not None and value > maximum:
        raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {text}")
    return value


def at_least(minimum, kind=int, maximum=None):
    """An argparse type: a `kind` number >= `minimum` and <= `maximum` (an integer: at most
    `MAX_INT` where no `maximum` is given)."""
    if kind is int and maximum is None:
        maximum = MAX_INT

    def convert(text):
        try:
            value = _parse_integer(text) if kind is int else kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__} >= {minimum}, got {text!r}") from None
        finite = "a finite number " if kind is float else ""
        # "nan" and "inf" parse as floats; an int past float's range is not tested as one (OverflowError)
        if (kind is float and not math.isfinite(value)) or value < minimum:
            raise argparse.ArgumentTypeError(f"must be {finite}>= {minimum}, got {text}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be {finite}in [{minimum}, {maximum}], got {text}")
        return value

    return convert


def decoding_flags(p, batch=True) -> None:
    p.add_argument("--beam-size", type=at_least(1), default=BEAM_SIZE, help="Beam size (1: greedy).")
    p.add_argument("--length-penalty", type=at_least(0.0, float, MAX_LENGTH_PENALTY), default=LENGTH_PENALTY,
                   help=f"alpha of ((5 + |Y|) / 6)^alpha, at most {MAX_LENGTH_PENALTY:g} (beyond, the penalty of a "
                        "long output overflows float32).")
    p.add_argument("--max-input-length", type=at_least(1), default=MAX_INPUT_LENGTH,
                   help="A longer input is cut to its first this many tokens (self-attention's memory grows with "
                        "the square of the length)" + (", with a warning." if batch else "."))
    if batch:
        p.add_argument("--batch-size", type=at_least(1), default=None,
                       help="Sentences decoded together. [default: as many as keep sentences x beam x longest "
                            f"output within {DECODE_BATCH_TOKENS:,} tokens, at most {DECODE_MAX_BATCH:,}]")
        p.add_argument("--compile", choices=list(COMPILE_MODES), default="true",
                       help="true: the backend's compiled search (XLA on TensorFlow and JAX, exported programs on "
                            "PyTorch; a search that cannot be compiled runs eagerly, with a warning). false: the "
                            "same search eagerly, op by op: the same tokens, slower. torch.compile: PyTorch only, "
                            "the exported programs also compiled by torch.compile: faster steps for a long job, "
                            "after tens of seconds of compilation per input shape on a CPU.")


def fit_verbosity(args) -> int:
    """Keras' `verbose`: a progress bar in a terminal, one line per epoch otherwise (a
    log file, a pipe, CI) or with `--quiet`."""
    return 1 if sys.stdout.isatty() and not getattr(args, "quiet", False) else 2

