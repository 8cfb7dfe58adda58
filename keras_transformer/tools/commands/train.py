"""`keras-transformer train`: its flags are `TrainConfig`'s fields (see `config._setting`)."""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib

from keras_transformer.tools.cluster import JOIN_TIMEOUT, from_environment
from keras_transformer.tools.commands.common import add_command, at_least, check_writable, fit_verbosity, integer, path
from keras_transformer.tools.commands.launch import end_with_launcher
from keras_transformer.tools.config import TrainConfig, busy_error
from keras_transformer.tools.corpus_kinds import implied_corpus
from keras_transformer.tools.files import lock_held


def add_parser(sub) -> None:
    p = add_command(
        sub,
        "train",
        help="Train a Transformer with the paper's recipe.",
        description=(
            "Train a Transformer with the paper's recipe: shared SentencePiece vocabulary, "
            "token-budget batches, label smoothing, Adam with warm-up, checkpoint averaging. "
            "Killed at any moment, the same command resumes from the last checkpoint. "
            "The backend is KERAS_BACKEND (tensorflow, jax or torch)."
        ),
    )
    groups, steps_or_epochs = {}, None
    for field in dataclasses.fields(TrainConfig):  # one flag per setting, from its metadata
        group = field.metadata["group"]
        if group not in groups:
            groups[group] = p.add_argument_group(group)
        if field.name == "steps":  # --epochs says the same another way: one or the other
            steps_or_epochs = groups[group].add_mutually_exclusive_group()
        _add_setting_flag(steps_or_epochs if field.name == "steps" else groups[group], field)
    steps_or_epochs.add_argument("--epochs", type=at_least(1),
                                 help="Instead of --steps: this many epochs of --steps-per-epoch steps.")
    p.add_argument("--output-dir", type=path,
                   help="Where the vocabulary, config, checkpoints, model.keras, logs and curves.png go. "
                        "[default: runs/CORPUS-PRESET: runs/numbers-tiny; runs/deu-small for --tsv deu.txt "
                        "--preset small; runs/train.en-de-reverse-base for --source-file train.en --target-file "
                        "train.de --reverse --preset base]")
    p.add_argument("--quiet", action="store_true", help="One line per epoch instead of a progress bar.")
    p.add_argument("--max-minutes", type=at_least(0.001, float), metavar="M",
                   help="Pause at the end of an epoch once another epoch as long would end more than M minutes after "
                        "training starts (at least one epoch is trained): the models and test metrics are written "
                        "as at the end, and the same command continues the run. For a machine lent for a while.")
    p.add_argument("--cluster-timeout", type=at_least(1.0, float), default=JOIN_TIMEOUT,
                   help="In a multi-process run (see `keras-transformer launch`): seconds to wait for every "
                        "process to join before giving up.")
    p.set_defaults(handler=run, check=check)


def _add_setting_flag(group, field) -> None:
    """`--field-name` for one `TrainConfig` field, from its metadata (see `config._setting`)."""
    meta = dict(field.metadata)
    help_text, shown = meta.pop("help"), meta.pop("shown_default", None)
    meta.pop("group")
    own_range = meta.pop("own_range", False)
    flag = f"--{field.name.replace('_', '-')}"
    if isinstance(field.default, bool):
        group.add_argument(flag, action="store_true", help=help_text)
        return
    if meta.pop("implied", False):  # the default is worked out from other flags
        group.add_argument(flag, default=None, help=f"{help_text} [default: {field.default}]", **meta)
        return
    if shown is not None:
        help_text = f"{help_text} [default: {shown}]"
    kind = meta.pop("type", None) or type(field.default)
    if kind is int:  # ASCII digits, at most MAX_INT, but for a setting whose whole range the config checks
        kind = functools.partial(integer, maximum=None) if own_range else integer
    elif kind is str and "choices" not in meta:
        kind = path  # a file: not empty
    group.add_argument(flag, type=kind, default=field.default, help=help_text, **meta)


def check(args) -> dict:
    """The run's settings, checked (`RunError` names each wrong flag): its `TrainConfig`
    (`config`), its directory (`output_dir`) and this process's place among the run's
    processes (`cluster`)."""
    end_with_launcher()  # in a process `launch` started: it ends with `launch`
    config, output_dir = settings(args)
    # A process of a multi-process run: its settings, from its launcher's variables.
    cluster = from_environment(os.environ.get("KERAS_BACKEND", "tensorflow"))
    if cluster.chief:  # the directory it writes: said before a backend loads (train checks it again)
        check_run_dir(output_dir, config)
    return {"config": config, "output_dir": output_dir, "cluster": cluster}


def settings(args) -> tuple[TrainConfig, str]:
    """The flags as a checked `TrainConfig`, and the run's directory (`--output-dir`, or
    `runs/` and the config's `run_name`), which can be written: what every process of a
    run checks alike (`launch` checks it once, before it starts them)."""
    corpus = args.corpus or implied_corpus(vars(args))
    steps = args.steps if args.epochs is None else args.epochs * args.steps_per_epoch
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    values.update(corpus=corpus, steps=steps)
    config = TrainConfig(**values)
    config.validate()
    output_dir = os.path.join("runs", config.run_name()) if args.output_dir is None else args.output_dir
    check_writable("--output-dir", output_dir)
    return config, output_dir


def check_not_busy(output_dir) -> None:
    """Refuse an `--output-dir` another `train` holds (its `train.lock`)."""
    if lock_held(pathlib.Path(output_dir) / "train.lock"):
        raise busy_error(output_dir)


def check_run_dir(output_dir, config: TrainConfig) -> None:
    """What `train` checks of its `--output-dir` once it runs, checked before a backend
    loads (by `train` itself on the chief, `launch` and `demo`): not held by another
    `train`, not a file or a directory of other files, no run of other settings
    (`run_setup.check_output_dir`, which reads only config.json)."""
    from keras_transformer.tools import run_setup

    check_not_busy(output_dir)
    run_setup.check_output_dir(pathlib.Path(output_dir), config)


def run(args) -> int:
    from keras_transformer.tools.training import train

    from keras_transformer.tools.collectives import leave

    try:
        train(args.config, args.output_dir, verbose=fit_verbosity(args), join_timeout=args.cluster_timeout,
              max_minutes=args.max_minutes)
    finally:
        leave(args.cluster)
    return 0

