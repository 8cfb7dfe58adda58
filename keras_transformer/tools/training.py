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
import pathlib
import time

import keras

from keras_transformer.losses import LabelSmoothedCrossEntropy
from keras_transformer.metrics import MaskedAccuracy, Perplexity
from keras_transformer.models.transformer import Transformer
from keras_transformer.schedules import transformer_optimizer
from keras_transformer.tools import callbacks as kt_callbacks
from keras_transformer.tools import files
from keras_transformer.tools.config import RunError, TrainConfig

__all__ = ["RunError", "TrainConfig", "build_model", "check_output_dir", "load_corpus", "train"]


def load_corpus(config: TrainConfig):
    from keras_transformer.tools.text import corpora

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


def build_model(config: TrainConfig, tokenizer) -> Transformer:
    """The compiled model of a run, with the tokenizer's vocabulary size and special ids."""
    model = Transformer(
        vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id, start_id=tokenizer.start_id,
        end_id=tokenizer.end_id, **config.model_config(),
    )
    model.compile(
        optimizer=transformer_optimizer(
            model.d_model, config.effective_warmup(), config.learning_rate_scale
        ),
        loss=LabelSmoothedCrossEntropy(epsilon=config.label_smoothing, pad_id=model.pad_id),
        metrics=[MaskedAccuracy(pad_id=model.pad_id), Perplexity(pad_id=model.pad_id)],
    )
    model.build()
    return model


def train(config: TrainConfig, output_dir, verbose="auto", corpus=None) -> dict:
    """Run (or resume) training; return the test metrics. Raises `RunError` on bad input.

    `corpus` is the config's corpus when the caller has already loaded it.
    """
    from keras_transformer.tools.text.datasets import make_dataset
    from keras_transformer.tools.text.tokenizer import Tokenizer

    config.validate()
    output_dir = pathlib.Path(output_dir)
    resuming = check_output_dir(output_dir, config)
    if corpus is None:
        corpus = load_corpus(config)  # all input errors surface before anything is written
    print(corpus.summary(), flush=True)

    output_dir.mkdir(parents=True, exist_ok=True)
    if not resuming:
        files.write_json(output_dir / "config.json", dataclasses.asdict(config))
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
    model = build_model(config, tokenizer)
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
    with files.atomic_write(output_dir / "model.keras") as tmp:
        model.save(tmp)

    metrics = {"steps": int(keras.ops.convert_to_numpy(model.optimizer.iterations)), "backend": keras.backend.backend(),
               "train_seconds_this_session": round(train_seconds, 1)}
    if corpus.test:
        test_data = make_dataset(corpus.test, tokenizer, config.batch_tokens, config.max_length, shuffle=False)
        results = model.evaluate(test_data, return_dict=True, verbose=0)
        metrics.update({f"test_{k}": float(v) for k, v in results.items()})
    files.write_json(output_dir / "metrics.json", metrics)
    print(json.dumps(metrics), flush=True)
    return metrics
