"""`keras-transformer`: command-line entry point.

The Keras backend is whatever `KERAS_BACKEND` says (TensorFlow when unset). Errors in
the input (missing or misaligned files, bad flags, a conflicting output directory) print
one message and exit with status 2 before any training starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _train_parser(sub) -> None:
    from keras_transformer.training import TrainConfig

    d = TrainConfig()
    p = sub.add_parser(
        "train",
        help="Train a Transformer with the paper's recipe.",
        description=(
            "Train a Transformer with the paper's recipe: shared WordPiece vocabulary, "
            "token-budget batches, label smoothing, Adam with warm-up, checkpoint averaging. "
            "Killed at any moment, the same command resumes from the last checkpoint. "
            "The backend is KERAS_BACKEND (tensorflow, jax or torch)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("corpus")
    g.add_argument("--corpus", choices=["numbers", "files", "tsv"], default=None,
                   help="numbers: built-in English->German number words (no download). "
                        "Implied by --source-file/--target-file or --tsv. [default: numbers]")
    g.add_argument("--source-file", help="Source side, one sentence per line (plain or .gz).")
    g.add_argument("--target-file", help="Target side, aligned line by line with --source-file.")
    g.add_argument("--tsv", help="Tab-separated 'source<TAB>target' pairs (Tatoeba / Anki format).")
    g.add_argument("--holdout", type=int, default=d.holdout,
                   help="Pairs held out for validation and again for test (files / tsv).")
    g.add_argument("--train-size", type=int, default=d.train_size, help="Training pairs of the numbers corpus.")
    g.add_argument("--vocab-size", type=int, default=d.vocab_size, help="Largest shared vocabulary size.")
    g.add_argument("--min-frequency", type=int, default=d.min_frequency,
                   help="Fewest occurrences of a pair of pieces to merge it into a vocabulary piece.")
    g.add_argument("--lower-case", action="store_true", help="Lower-case text before tokenizing.")
    g.add_argument("--max-length", type=int, default=d.max_length, help="Longest sentence in tokens; longer pairs are dropped.")
    m = p.add_argument_group("model")
    m.add_argument("--preset", choices=["tiny", "base", "big"], default=d.preset, help="Model sizes (paper Table 3 for base/big).")
    m.add_argument("--num-layers", type=int, help="Override the preset's N.")
    m.add_argument("--d-model", type=int, help="Override the preset's d_model.")
    m.add_argument("--num-heads", type=int, help="Override the preset's h.")
    m.add_argument("--d-ff", type=int, help="Override the preset's d_ff.")
    m.add_argument("--dropout", type=float, help="Override the preset's P_drop.")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=d.steps, help="Total optimizer steps.")
    t.add_argument("--epochs", type=int, help="Instead of --steps: this many epochs of --steps-per-epoch steps.")
    t.add_argument("--steps-per-epoch", type=int, default=d.steps_per_epoch,
                   help="Steps between evaluations, checkpoints and log rows.")
    t.add_argument("--batch-tokens", type=int, default=d.batch_tokens,
                   help="Token budget per batch and side (the paper used about 25000).")
    t.add_argument("--warmup-steps", type=int, help="Warm-up steps. [default: 4000 (the paper) for base/big, 400 for tiny]")
    t.add_argument("--learning-rate-scale", type=float, default=d.learning_rate_scale,
                   help="Factor on the paper's learning-rate formula.")
    t.add_argument("--label-smoothing", type=float, default=d.label_smoothing, help="eps_ls.")
    t.add_argument("--average-checkpoints", type=int, default=d.average_checkpoints,
                   help="Average the last k epoch checkpoints into the final model (paper 6.1).")
    t.add_argument("--seed", type=int, default=d.seed, help="Random seed (data order, initialisation).")
    p.add_argument("--output-dir", default="runs/numbers-tiny",
                   help="Where the vocabulary, config, checkpoints, model.keras, logs and curves.png go.")
    p.add_argument("--quiet", action="store_true", help="One line per epoch instead of a progress bar.")
    p.set_defaults(handler=_run_train)


def _run_train(args) -> int:
    from keras_transformer.training import TrainConfig, train

    corpus = args.corpus or ("tsv" if args.tsv else "files" if (args.source_file or args.target_file) else "numbers")
    steps = args.steps if args.epochs is None else args.epochs * args.steps_per_epoch
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    values.update(corpus=corpus, steps=steps)
    config = TrainConfig(**values)
    train(config, args.output_dir, verbose=2 if args.quiet else "auto")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-transformer",
        description="The Transformer of 'Attention Is All You Need' on TensorFlow, JAX or PyTorch "
                    "(set KERAS_BACKEND).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _train_parser(sub)
    return parser


def main(argv=None) -> int:
    from keras_transformer.training import RunError

    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except RunError as e:
        print(f"keras-transformer {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
