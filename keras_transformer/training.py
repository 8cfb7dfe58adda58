"""A training run as the paper did it, driven by `keras-transformer train`.

A run lives in one output directory:

    config.json        the run's settings; a different config in the same directory is refused
    tokenizer/         the shared WordPiece vocabulary
    state/state.npz    weights + optimizer state at the last finished epoch (resumption)
    checkpoints/       the last k epoch checkpoints, averaged into the final model
    model.keras        the final (averaged) model
    log.csv            loss, accuracy, perplexity per epoch (train and validation)
    tensorboard/       TensorBoard logs
    curves.png         loss and accuracy against steps
    metrics.json       teacher-forced accuracy and perplexity on the test split
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import time

import keras

from keras_transformer import callbacks as kt_callbacks
from keras_transformer.losses import LabelSmoothedCrossEntropy
from keras_transformer.metrics import MaskedAccuracy, Perplexity
from keras_transformer.models.transformer import PRESETS, Transformer
from keras_transformer.schedules import transformer_optimizer


class RunError(Exception):
    """A problem found before training starts; the CLI prints it and exits with status 2."""


@dataclasses.dataclass
class TrainConfig:
    """Everything that defines a run. Two runs with equal configs are the same run."""

    corpus: str = "numbers"  # "numbers", "files" or "tsv"
    source_file: str | None = None
    target_file: str | None = None
    tsv: str | None = None
    holdout: int = 500  # pairs held out for validation and for test (files / tsv)
    train_size: int = 50_000  # numbers corpus
    preset: str = "tiny"
    num_layers: int | None = None
    d_model: int | None = None
    num_heads: int | None = None
    d_ff: int | None = None
    dropout: float | None = None
    vocab_size: int = 2000
    min_frequency: int = 20  # fewest occurrences of a pair to become a vocabulary piece
    lower_case: bool = False
    max_length: int = 64
    batch_tokens: int = 4096
    steps: int = 1250
    steps_per_epoch: int = 125  # also the checkpoint interval
    warmup_steps: int | None = None  # None: 4000 (the paper) for base/big, 400 for tiny
    learning_rate_scale: float = 1.0
    label_smoothing: float = 0.1
    average_checkpoints: int = 5
    seed: int = 0

    def validate(self) -> None:
        if self.corpus not in ("numbers", "files", "tsv"):
            raise RunError(f"Unknown corpus {self.corpus!r}; expected numbers, files or tsv.")
        if self.corpus == "files" and not (self.source_file and self.target_file):
            raise RunError("--source-file and --target-file must be given together.")
        if self.preset not in PRESETS:
            raise RunError(f"Unknown preset {self.preset!r}; expected one of {sorted(PRESETS)}.")
        if self.vocab_size < 5:
            raise RunError(
                f"--vocab-size {self.vocab_size} is too small: the 4 reserved tokens "
                "[PAD] [UNK] [START] [END] need ids 0..3, and at least one more token is needed."
            )
        for name in ("steps", "steps_per_epoch", "batch_tokens", "max_length", "average_checkpoints"):
            if getattr(self, name) < 1:
                raise RunError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(self, name)}.")
        if self.batch_tokens < self.max_length:
            raise RunError(f"--batch-tokens ({self.batch_tokens}) must be >= --max-length ({self.max_length}).")

    def model_config(self) -> dict:
        config = dict(PRESETS[self.preset])
        for key in ("num_layers", "d_model", "num_heads", "d_ff", "dropout"):
            if getattr(self, key) is not None:
                config[key] = getattr(self, key)
        return config

    def effective_warmup(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return 400 if self.preset == "tiny" else 4000


def load_corpus(config: TrainConfig):
    from keras_transformer.text import corpora

    try:
        if config.corpus == "numbers":
            return corpora.numbers_corpus(train_size=config.train_size, seed=config.seed)
        if config.corpus == "tsv":
            return corpora.corpus_from_files(tsv=config.tsv, holdout=config.holdout)
        return corpora.corpus_from_files(config.source_file, config.target_file, holdout=config.holdout)
    except corpora.CorpusError as e:
        raise RunError(str(e)) from None


def check_output_dir(directory: pathlib.Path, config: TrainConfig) -> bool:
    """Refuse a directory that holds a different run; return whether one is there to resume."""
    config_file = directory / "config.json"
    if not config_file.exists():
        return False
    try:
        saved = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunError(f"{config_file} is not a run config ({e}); choose another --output-dir.") from None
    current = dataclasses.asdict(config)
    differences = [
        f"{key}: saved {saved.get(key)!r}, now {current.get(key)!r}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    ]
    if differences:
        raise RunError(
            f"{directory} holds a run with a different config ({'; '.join(differences)}). "
            "Use another --output-dir, or the same flags to resume that run."
        )
    return True


def build_model(config: TrainConfig, vocab_size: int) -> Transformer:
    model = Transformer(vocab_size=vocab_size, **config.model_config())
    model.compile(
        optimizer=transformer_optimizer(
            model.d_model, config.effective_warmup(), config.learning_rate_scale
        ),
        loss=LabelSmoothedCrossEntropy(epsilon=config.label_smoothing),
        metrics=[MaskedAccuracy(), Perplexity()],
    )
    model.build()
    return model


def train(config: TrainConfig, output_dir, verbose="auto", corpus=None) -> dict:
    """Run (or resume) training; return the test metrics. Raises `RunError` on bad input.

    `corpus` is the config's corpus when the caller has already loaded it.
    """
    from keras_transformer.text.datasets import make_dataset
    from keras_transformer.text.tokenizer import Tokenizer

    config.validate()
    output_dir = pathlib.Path(output_dir)
    resuming = check_output_dir(output_dir, config)
    if corpus is None:
        corpus = load_corpus(config)  # all input errors surface before anything is written
    print(corpus.summary(), flush=True)

    output_dir.mkdir(parents=True, exist_ok=True)
    for stale in output_dir.rglob("*.tmp*"):  # what a killed run was writing; never read
        stale.unlink()
    if not resuming:
        kt_callbacks.write_json(output_dir / "config.json", dataclasses.asdict(config))
    tokenizer_dir = output_dir / "tokenizer"
    if (tokenizer_dir / "vocab.txt").exists():
        tokenizer = Tokenizer.load(tokenizer_dir)
    else:
        texts = [s for s, _ in corpus.train] + [t for _, t in corpus.train]
        tokenizer = Tokenizer.build(
            texts, config.vocab_size, lower_case=config.lower_case, min_frequency=config.min_frequency
        )
        tokenizer.save(tokenizer_dir)
    print(f"vocabulary: {tokenizer.vocab_size} tokens (asked for at most {config.vocab_size})", flush=True)

    keras.utils.set_random_seed(config.seed)
    model = build_model(config, tokenizer.vocab_size)
    initial_epoch = kt_callbacks.TrainingState.restore(model, output_dir / "state")
    epochs = math.ceil(config.steps / config.steps_per_epoch)
    if initial_epoch:
        print(f"resuming {output_dir} after step {initial_epoch * config.steps_per_epoch}", flush=True)

    train_data = make_dataset(
        corpus.train, tokenizer, config.batch_tokens, config.max_length,
        shuffle=True, repeat=True, drop_remainder=True, seed=config.seed,
    )
    validation_data = make_dataset(
        corpus.validation, tokenizer, config.batch_tokens, config.max_length, shuffle=False
    ) if corpus.validation else None
    callbacks = [
        keras.callbacks.CSVLogger(str(output_dir / "log.csv"), append=True),
        keras.callbacks.TensorBoard(str(output_dir / "tensorboard"), write_graph=False),
        kt_callbacks.CheckpointAverager(output_dir / "checkpoints", config.average_checkpoints),
        kt_callbacks.TrainingCurves(output_dir / "log.csv", output_dir / "curves.png", config.steps_per_epoch),
        # Last, so that a saved state means every other callback has finished the epoch.
        kt_callbacks.TrainingState(output_dir / "state"),
    ]
    start = time.time()
    model.fit(
        train_data,
        steps_per_epoch=config.steps_per_epoch,
        epochs=epochs,
        initial_epoch=initial_epoch,
        validation_data=validation_data,
        callbacks=callbacks,
        verbose=verbose,
        shuffle=False,  # the dataset shuffles itself
    )
    train_seconds = time.time() - start
    tmp = output_dir / "model.tmp.keras"
    model.save(tmp)
    os.replace(tmp, output_dir / "model.keras")

    metrics = {"steps": int(keras.ops.convert_to_numpy(model.optimizer.iterations)), "backend": keras.backend.backend(),
               "train_seconds_this_session": round(train_seconds, 1)}
    if corpus.test:
        test_data = make_dataset(corpus.test, tokenizer, config.batch_tokens, config.max_length, shuffle=False)
        results = model.evaluate(test_data, return_dict=True, verbose=0)
        metrics.update({f"test_{k}": float(v) for k, v in results.items()})
    kt_callbacks.write_json(output_dir / "metrics.json", metrics)
    print(json.dumps(metrics), flush=True)
    return metrics
