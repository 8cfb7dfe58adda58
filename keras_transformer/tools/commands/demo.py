"""`keras-transformer demo`: train, evaluate, export and serve on the numbers corpus."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys

from keras_transformer.tools.commands.common import add_command, at_least, check_writable, fit_verbosity, integer, path
from keras_transformer.tools.commands.export import serving_instructions
from keras_transformer.tools.commands.train import check_run_dir
from keras_transformer.tools.config import RunError, TrainConfig
from keras_transformer.tools.files import replacement_problem


def add_parser(sub) -> None:
    p = add_command(
        sub,
        "demo",
        help="The whole job on the built-in numbers corpus: train, evaluate, export, serve.",
        description="Build the numbers corpus (English -> German), train the tiny preset (no dropout), report "
                    "held-out BLEU and exact match with beam search, export the SavedModel, reload "
                    "it with plain tf.saved_model.load and translate held-out numbers.",
    )
    p.add_argument("--output-dir", type=path, default="artifacts",
                   help="Run directory, SavedModel and demo.json go here.")
    p.add_argument("--eval-size", type=at_least(1), default=1000, help="Held-out numbers to translate and score, "
                        "and validation numbers checked during training (at most 1,000 each).")
    p.add_argument("--steps", type=at_least(1), help="Training steps, for a quick look. [default: as `train`]")
    p.add_argument("--train-size", type=integer, help="Training pairs, for a quick look. [default: as `train`]")
    p.add_argument("--quiet", action="store_true", help="One line per epoch instead of a progress bar.")
    p.set_defaults(handler=run, check=check)


# The numbers corpus's validation and test pairs (`corpora.numbers_corpus`'s sizes, which
# the demo does not change); `--eval-size` takes at most this many of each.
HELD_OUT = 1_000


def check(args) -> dict:
    if args.eval_size > HELD_OUT:
        raise RunError(f"--eval-size {args.eval_size} is more than the numbers corpus's {HELD_OUT:,} held-out pairs; "
                       f"give at most {HELD_OUT}")
    run_dir = os.path.join(args.output_dir, "run")  # train's run directory goes in it
    check_writable("--output-dir", args.output_dir)
    check_writable("--output-dir", run_dir)
    translator = os.path.join(args.output_dir, "translator")
    problem = replacement_problem(translator, "savedmodel")  # the export replaces it as a whole
    if problem:
        raise RunError(f"--output-dir {args.output_dir}: its {translator} {problem}")
    config = _config(args)
    config.validate()  # --train-size and --steps as train checks them
    check_run_dir(run_dir, config)  # a run of other settings there (an earlier --steps)
    return {"config": config}


DEMO_TARGET = 0.995  # validation exact match (greedy, 1,000 numbers) at which the demo stops training
DEMO_CHECKS = 2  # ... when reached on this many checks in a row


def run(args) -> int:
    import time

    import keras

    from keras_transformer.tools import atomic, evaluation, export
    from keras_transformer.tools.run_setup import load_corpus
    from keras_transformer.tools.training import train

    start = time.time()
    out = pathlib.Path(args.output_dir)
    config = args.config
    print(f"== 1/4 train the tiny preset (no dropout) on the numbers corpus ({keras.backend.backend()} backend) until "
          f"{round(DEMO_TARGET * 100, 4):g}% of {config.validate_translations} validation numbers translate exactly "
          f"on {DEMO_CHECKS} checks in a row (at most {config.steps} steps)", flush=True)
    # With --eval-size below 1,000 (a quick look), fewer held-out numbers are checked and
    # scored; the training pairs are the same either way.
    corpus = load_corpus(config)
    corpus = dataclasses.replace(corpus, validation=corpus.validation[: args.eval_size],
                                 test=corpus.test[: args.eval_size])
    t = time.time()
    metrics = train(config, out / "run", verbose=fit_verbosity(args), corpus=corpus)
    train_seconds = time.time() - t
    model, tokenizer = evaluation.load_run(out / "run")
    test = corpus.test
    print(f"== 2/4 translate {len(test)} held-out numbers with beam search (beam 4, alpha 0.6)", flush=True)
    t = time.time()
    hypotheses = evaluation.translate_texts(model, tokenizer, [s for s, _ in test])
    decode_seconds = time.time() - t
    scores = evaluation.score(hypotheses, [r for _, r in test], tokenizer)
    evaluation.write_lines(out / "hypotheses.test.txt", hypotheses)
    print(f"sacreBLEU {scores['bleu_signature']}  |  {scores['bleu_char_signature']}")
    print(f"BLEU {scores['bleu']:.2f} (one-word references have no 2-4-grams)  char BLEU {scores['bleu_char']:.2f}  "
          f"chrF {scores['chrf']:.2f}  exact match {scores['exact_match']:.2%} ({decode_seconds:.0f} s)", flush=True)
    print(f"== 3/4 export the SavedModel to {out / 'translator'}", flush=True)
    export.export_translator(model, tokenizer, out / "translator")
    print("== 4/4 reload it with plain tf.saved_model.load (no keras_transformer) and translate", flush=True)
    if not _serve(out / "translator", test[:5]):
        return 1
    summary = dict(scores, backend=keras.backend.backend(), wall_seconds=round(time.time() - start, 1),
                   train_steps=metrics["steps"], train_seconds=round(train_seconds, 1),
                   decode_seconds=round(decode_seconds, 1))
    atomic.write_json(out / "demo.json", summary)
    print(serving_instructions(out / "translator"))
    print(f"done in {summary['wall_seconds']:.0f} s; summary in {out / 'demo.json'}")
    return 0


def _config(args) -> TrainConfig:
    """The demo's run. Train only as long as the task needs: check the validation numbers
    (greedy, 2 s for 1,000) every 50 steps and stop at 99.5% exact match on two checks in
    a row (one check can pass by luck). WordPiece, no dropout (a fixed mapping of 50,000
    numbers leaves nothing to regularize) and a quarter of the paper's learning rate,
    peaking at step 100: the settings that reached the target soonest and most steadily
    in the measured runs (the commit messages of this module report them)."""
    config = TrainConfig(steps_per_epoch=50, validate_translations=args.eval_size,
                         stop_at_exact_match=DEMO_TARGET, stop_checks=DEMO_CHECKS, average_checkpoints=1,
                         tokenizer="wordpiece", learning_rate_scale=0.25, warmup_steps=100, dropout=0.0)
    if args.steps:
        config.steps = args.steps
        config.steps_per_epoch = min(config.steps_per_epoch, args.steps)
    if args.train_size:
        config.train_size = args.train_size
    return config


def _serve(saved_model, samples) -> bool:
    """Translate `samples` with the SavedModel in a process of plain TensorFlow and print
    them beside their references; False (and its error output) if that process failed."""
    import json
    import subprocess

    from keras_transformer.tools import saved_model_client

    result = subprocess.run(  # the client as a script: a process with TensorFlow only
        [sys.executable, saved_model_client.__file__, str(saved_model), json.dumps([s for s, _ in samples])],
        capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    if result.returncode != 0:
        print(result.stderr[-3000:], file=sys.stderr)
        return False
    served = json.loads(result.stdout.strip().splitlines()[-1])["translate"]
    for (source, reference), translation in zip(samples, served):
        mark = "ok" if translation == reference else f"expected {reference}"
        print(f"  {source}  ->  {translation}   [{mark}]")
    return True
