"""`keras-transformer evaluate`: BLEU, chrF and exact match of a run on a split or on files."""

from __future__ import annotations

import os
import pathlib

from keras_transformer.tools.commands.common import (COMPILE_MODES, add_command, at_least, check_not_an_input,
                                                      check_writable, decoding_flags, load_run, quantize_flag,
                                                      path, run_dir_flag)
from keras_transformer.tools.config import RunError, TrainConfig
from keras_transformer.tools.corpus_kinds import CORPUS_FILES
from keras_transformer.tools.files import input_problem, json_object, run_model_file


def add_parser(sub) -> None:
    p = add_command(
        sub,
        "evaluate",
        help="BLEU, chrF and exact match of a trained run on held-out data.",
        description="Translate a held-out split with beam search and score it with sacreBLEU "
                    "(corpus BLEU and chrF, signatures printed) and exact match.",
    )
    run_dir_flag(p)
    p.add_argument("--split", choices=["test", "validation"],
                   help="Which split of the run's corpus to translate. [default: test]")
    p.add_argument("--source-file", type=path, help="Evaluate on these sources instead of the run's split "
                                                    "(- reads standard input) ...")
    p.add_argument("--target-file", type=path, help="... with these references.")
    p.add_argument("--limit", type=at_least(1), help="Only the first N sentences.")
    p.add_argument("--hypotheses", type=path,
                   help="Where to write the translations (gzip-compressed for a name ending in .gz). "
                        "[default: RUN_DIR/hypotheses.SPLIT.txt]")
    decoding_flags(p)
    quantize_flag(p, "translating")
    p.set_defaults(handler=run, check=check)


def check(args) -> dict:
    if bool(args.source_file) != bool(args.target_file):
        raise RunError("--source-file and --target-file must be given together.")
    if args.source_file and args.split:
        raise RunError(f"--split {args.split} picks the run's own held-out pairs; --source-file and --target-file "
                       "give others: give one or the other.")
    if args.source_file == args.target_file == "-":
        raise RunError("--source-file and --target-file cannot both be standard input (-): give one of them a file.")
    # "-" is standard input, as for translate's --input.
    files = {flag: "/dev/stdin" if path == "-" else path
             for flag, path in (("--source-file", args.source_file), ("--target-file", args.target_file))}
    for flag, path in files.items():
        problem = path and input_problem(path, streams=True)  # before the model loads
        if problem:
            raise RunError(f"{flag}: {problem}.")
    if args.hypotheses == "-":  # translate's name for standard output; a file named "-" here
        raise RunError("--hypotheses -: evaluate writes its scores to standard output, so the translations need a "
                       "file; give a file name (translate --input FILE --output - prints translations)")
    split = args.split or "test"
    hypotheses = pathlib.Path(args.hypotheses or os.path.join(
        args.run_dir, f"hypotheses.{'files' if args.source_file else split}.txt"))
    if hypotheses.is_dir():
        raise RunError(f"--hypotheses {hypotheses} is a directory; give a file name.")
    check_writable("--hypotheses", hypotheses, args.run_dir)
    run_model_file(args.run_dir, args.model)
    config = None if args.source_file else _run_config(pathlib.Path(args.run_dir) / "config.json", split)
    # The files the pairs are read from: those given, or the corpus files the run's config names.
    inputs = (files if config is None else
              {f"run's --{name.replace('_', '-')}": getattr(config, name) for name in CORPUS_FILES})
    check_not_an_input("--hypotheses", hypotheses, inputs)
    return {"hypotheses": hypotheses, "split": split, "config": config,
            "source_file": files["--source-file"], "target_file": files["--target-file"]}


def _run_config(config_file: pathlib.Path, split: str) -> TrainConfig:
    """The run's settings, which name the corpus whose `split` is evaluated."""
    try:
        return TrainConfig(**json_object(config_file))
    except FileNotFoundError:
        raise RunError(f"{config_file} is missing: --split {split} reads the run's corpus as it names it. "
                       "Restore it from a copy of the run directory, or give --source-file and --target-file."
                       ) from None
    except (OSError, ValueError, TypeError) as e:
        raise RunError(f"{config_file} is not a run config ({type(e).__name__}: {e}).") from None


def run(args) -> int:
    from keras_transformer.tools import evaluation
    from keras_transformer.tools.text import corpora
    from keras_transformer.tools.run_setup import check_corpus_unchanged, load_corpus

    out = args.hypotheses
    model, tokenizer = load_run(args)
    if args.source_file:
        pairs, _ = corpora.read_parallel_files(args.source_file, args.target_file, streams=True)
        name = "files"
    else:
        config, config_file = args.config, pathlib.Path(args.run_dir) / "config.json"
        try:
            corpus = load_corpus(config)
        except RunError as e:  # a corpus file moved, or a relative path read from another directory
            raise RunError(f"--split {args.split} reads the run's corpus again, as {config_file} names it: {e}. "
                           "Run evaluate where train ran, or give --source-file and --target-file") from None
        check_corpus_unchanged(pathlib.Path(args.run_dir), corpus)  # the same held-out pairs as in training
        pairs, name = getattr(corpus, args.split), args.split
    pairs = pairs[: args.limit] if args.limit else pairs
    if not pairs:
        raise RunError(f"No sentence pairs to evaluate in the {name} split (empty files?).")
    hypotheses = evaluation.translate_texts(model, tokenizer, [s for s, _ in pairs], args.beam_size,
                                            args.length_penalty, args.batch_size, max_input_length=args.max_input_length,
                                            compile=COMPILE_MODES[args.compile])
    scores = evaluation.score(hypotheses, [t for _, t in pairs], tokenizer)
    evaluation.write_lines(out, hypotheses)
    print(f"sacreBLEU {scores['bleu_signature']}  |  {scores['bleu_char_signature']}  |  {scores['chrf_signature']}")
    print(f"BLEU {scores['bleu']:.2f}  char BLEU {scores['bleu_char']:.2f}  chrF {scores['chrf']:.2f}  "
          f"exact match {scores['exact_match']:.2%} on {scores['sentences']} sentences ({name}); hypotheses in {out}")
    print(evaluation.dumps(scores))
    return 0

