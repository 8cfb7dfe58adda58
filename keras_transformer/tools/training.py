"""A training run as the paper did it, driven by `keras-transformer train`.

A run lives in one output directory:

    config.json        the run's settings; a different config in the same directory is refused
    tokenizer/         the shared SentencePiece (or WordPiece) vocabulary (written as one unit)
    data.json          pairs kept and dropped per split and why, the [UNK] rate
    train.lock         held while `train` runs: a second `train` on the directory is refused
    state/state.npz    weights + optimizer state at the last finished epoch (resumption)
    checkpoints/       the last k epoch checkpoints, averaged into the final model
    best/              with --validate-translations: the best epochs by validation BLEU,
                       best.json (every epoch's scores) and model.keras (the best epoch)
    model.keras        the final (averaged) model
    log.csv            loss, accuracy, perplexity per epoch (train and validation)
    tensorboard/       TensorBoard logs
    curves.png         loss and accuracy against steps
    metrics.json       teacher-forced accuracy and perplexity on the test split
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import time

import keras

from keras_transformer.losses import LabelSmoothedCrossEntropy
from keras_transformer.metrics import MaskedAccuracy, Perplexity
from keras_transformer.models.transformer import Transformer
from keras_transformer.schedules import transformer_optimizer
from keras_transformer.tools import callbacks as kt_callbacks
from keras_transformer.tools import cluster as cluster_lib
from keras_transformer.tools import collectives, distributed_fit, files
from keras_transformer.tools.config import RunError, TrainConfig, busy_error

__all__ = ["RunError", "TrainConfig", "build_model", "check_output_dir", "load_corpus", "train"]


def load_corpus(config: TrainConfig):
    from keras_transformer.tools.text import corpora

    from keras_transformer.tools.config import CORPORA

    try:
        corpus = CORPORA[config.corpus].load(config)
    except corpora.CorpusError as e:
        raise RunError(str(e)) from None
    return corpus.reversed() if config.reverse else corpus


# The names `train` writes in its output directory (and their temporary names): it
# touches nothing else there.
RUN_FILES = (
    "config.json", "tokenizer", "data.json", "state", "checkpoints", "best", "model.keras", "log.csv",
    "tensorboard", "curves.png", "metrics.json", "train.lock",
)
# Fewest training pairs a run accepts after filtering.
MIN_TRAIN_PAIRS = 100
# Share of [UNK] in the tokenized training text above which the vocabulary is reported.
UNK_WARNING = 0.02


def _own_names() -> set[str]:
    names = set(RUN_FILES)
    names |= {files.temporary_path(n).name for n in RUN_FILES} | {n + ".old" for n in RUN_FILES}
    return names


def check_output_dir(directory: pathlib.Path, config: TrainConfig) -> bool:
    """Refuse an output path that is a file, a directory that holds something other than
    a run, or a run with a different config; return whether a run is there to resume."""
    if directory.exists() and not directory.is_dir():
        raise RunError(f"--output-dir {directory} is a file, not a directory.")
    config_file = directory / "config.json"
    if not config_file.exists():
        foreign = sorted(set(os.listdir(directory)) - _own_names()) if directory.is_dir() else []
        if foreign:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise RunError(
                f"--output-dir {directory} is not empty and holds no run ({shown}); "
                "choose a new or empty directory."
            )
        return False
    try:
        saved = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunError(f"{config_file} is not a run config ({e}); choose another --output-dir.") from None
    current = dataclasses.asdict(config)
    # A setting added after the run was written has its default there.
    saved = {**dataclasses.asdict(TrainConfig()), **saved}
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


def check_mixed_precision(precision: str | None) -> None:
    """Refuse a mixed precision the running backend cannot compute, naming the reason."""
    if precision == "float16" and keras.backend.backend() == "jax":
        import jax

        if jax.default_backend() == "cpu":
            # XLA's CPU dot_general has no float16 x float16 -> float32 kernel, which Keras'
            # JAX matmul asks for ("The precision 'F16_F16_F32' is not supported").
            raise RunError(
                "--mixed-precision float16 cannot run on JAX on a CPU (XLA has no float16 matrix product "
                "with float32 accumulation there); use --mixed-precision bfloat16, or a GPU."
            )


def build_model(config: TrainConfig, tokenizer) -> Transformer:
    """The compiled model of a run, with the tokenizer's vocabulary size and special ids.

    With `config.mixed_precision`, every layer is built under Keras' `mixed_bfloat16` or
    `mixed_float16` policy (float32 weights, half-precision compute; the policy is
    saved in `model.keras`), and `compile` wraps the optimizer in a
    `LossScaleOptimizer` for float16.
    """
    previous = keras.config.dtype_policy()
    if config.mixed_precision:
        keras.config.set_dtype_policy(f"mixed_{config.mixed_precision}")
    try:
        model = Transformer(
            vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id, start_id=tokenizer.start_id,
            end_id=tokenizer.end_id, **config.model_config(),
        )
    finally:
        keras.config.set_dtype_policy(previous)
    model.compile(
        optimizer=transformer_optimizer(
            model.d_model, config.effective_warmup(), config.learning_rate_scale,
            # Keras' own accumulation: `iterations` (and the schedule) count updates.
            gradient_accumulation_steps=config.accumulate_steps if config.accumulate_steps > 1 else None,
        ),
        loss=LabelSmoothedCrossEntropy(epsilon=config.label_smoothing, pad_id=model.pad_id),
        metrics=[MaskedAccuracy(pad_id=model.pad_id), Perplexity(pad_id=model.pad_id)],
    )
    model.build()
    return model


def train(config: TrainConfig, output_dir, verbose="auto", corpus=None, callbacks=(), cluster=None,
          join_timeout: float | None = None) -> dict:
    """Run (or resume) training; return the test metrics. Raises `RunError` on bad input.

    A run that has already finished in `output_dir` is not loaded again: its saved test
    metrics are returned at once.

    `corpus` is the config's corpus when the caller has already loaded it. `callbacks`
    are more Keras callbacks, run after the run's own loggers and checkpoints and before
    the resumption state is saved (a stop they ask for is saved with it).

    `cluster` (a `keras_transformer.tools.cluster.Cluster`; default: the one the
    environment describes, see that module) makes this process one of several that train
    together: every process reads its corpus, they check that they agree, process 0 (the
    chief) learns the vocabulary and writes the run directory, and each process trains on
    its slice of every global batch. `output_dir` must be one directory that every
    process can read. `join_timeout` bounds the wait for the other processes.
    """
    # Everything that can be wrong with the input is found before the directory is touched.
    config.validate()
    if cluster is None:
        cluster = cluster_lib.from_environment(keras.backend.backend())
    collectives.join(cluster, cluster_lib.JOIN_TIMEOUT if join_timeout is None else join_timeout)
    with collectives.stop_if_lost(cluster):
        return _train(config, pathlib.Path(output_dir), corpus, callbacks, cluster, verbose)


def _train(config, output_dir, corpus, callbacks, cluster, verbose) -> dict:
    """`train` once this process has joined its cluster."""
    busy = busy_error(output_dir)

    finished, error = None, None
    try:
        check_mixed_precision(config.mixed_precision)
        resuming = check_output_dir(output_dir, config) if cluster.chief else True
        if resuming and cluster.chief:
            with files.lock(output_dir / "train.lock", busy):
                finished = _finished_metrics(config, output_dir)
    except RunError as e:
        error = e
    collectives.agree(cluster, error)
    if collectives.stop_together(cluster, finished is not None):
        if cluster.chief:
            print(f"{output_dir} holds this run, finished at step {finished['steps']} of {config.steps}: "
                  "nothing left to train. Its test metrics:", flush=True)
            print(json.dumps(finished), flush=True)
            return finished
        return json.loads((output_dir / "metrics.json").read_text(encoding="utf-8"))

    try:
        corpus = load_corpus(config) if corpus is None else corpus
    except RunError as e:
        error = e
    collectives.agree(cluster, error)
    collectives.check_same(cluster, _facts(config, corpus))
    tokenizer = None
    if cluster.chief:
        try:
            tokenizer, data = _prepare(config, output_dir, corpus, resuming)
        except RunError as e:
            error = e
    collectives.agree(cluster, error)
    with contextlib.ExitStack() as held:
        if cluster.chief:
            output_dir.mkdir(parents=True, exist_ok=True)
            held.enter_context(files.lock(output_dir / "train.lock", busy))
            if not resuming:
                files.write_json(output_dir / "config.json", dataclasses.asdict(config))
            if not (output_dir / "tokenizer").is_dir() or not resuming:
                tokenizer.save(output_dir / "tokenizer")
            files.write_json(output_dir / "data.json", data)
        collectives.barrier(cluster, "run directory written")
        if tokenizer is None:  # the chief's vocabulary
            tokenizer = _load_tokenizer(output_dir / "tokenizer")
        return _fit(config, output_dir, corpus, tokenizer, verbose, list(callbacks), cluster)


def _facts(config: TrainConfig, corpus) -> dict:
    """What every process of a run must share (`cluster.check_same`)."""
    import sys

    settings = {f"--{k.replace('_', '-')}": v for k, v in dataclasses.asdict(config).items()}
    versions = {"python": sys.version.split()[0], "keras": keras.__version__, "backend": keras.backend.backend()}
    return {**settings, "the corpus": cluster_lib.data_digest([*corpus.train, *corpus.validation, *corpus.test]),
            "the backend and versions": versions}


def _load_tokenizer(directory):
    from keras_transformer.tools.text.tokenizer import Tokenizer, TokenizerError

    try:
        return Tokenizer.load(directory)
    except TokenizerError as e:
        raise RunError(str(e)) from None


def _prepare(config, output_dir, corpus, resuming):
    """The chief's share before training: `(tokenizer, data statistics)`, printed."""
    from keras_transformer.tools.text.tokenizer import Tokenizer

    print(corpus.summary(), flush=True)
    tokenizer_dir = output_dir / "tokenizer"
    if resuming and tokenizer_dir.is_dir():
        tokenizer = _load_tokenizer(tokenizer_dir)
    else:
        texts = [s for s, _ in corpus.train] + [t for _, t in corpus.train]
        try:
            tokenizer = Tokenizer.build(
                texts, config.vocab_size, kind=config.tokenizer, lower_case=config.lower_case,
                min_frequency=config.min_frequency,
            )
        except ValueError as e:  # e.g. a vocabulary too small for the corpus's characters
            raise RunError(f"--vocab-size {config.vocab_size}: {e}") from None
    print(f"vocabulary: {tokenizer.vocab_size} {tokenizer.kind} tokens (asked for at most {config.vocab_size})",
          flush=True)
    data = data_statistics(corpus, tokenizer, config.max_length)
    print(data["summary"], flush=True)
    return tokenizer, data


def _finished_metrics(config: TrainConfig, output_dir) -> dict | None:
    """The test metrics of a run in `output_dir` that has nothing left to do, else None.

    A run is finished when its saved state has done every epoch (or was stopped by a
    callback) and `metrics.json` is there: it is written last, after `model.keras`, so a
    run killed while finishing is not finished and resumes to write the rest.
    """
    output_dir = pathlib.Path(output_dir)
    epochs = math.ceil(config.steps / config.steps_per_epoch)
    try:
        done, stopped = kt_callbacks.TrainingState.progress(output_dir / "state")
    except ValueError:
        return None  # a state file that is not one: resuming reports it
    if (done < epochs and not stopped) or not (output_dir / "model.keras").is_file():
        return None
    try:
        metrics = json.loads((output_dir / "metrics.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # missing, not UTF-8 or not JSON: the run writes it again
        return None
    return metrics if isinstance(metrics, dict) and isinstance(metrics.get("steps"), int) else None


def data_statistics(corpus, tokenizer, max_length: int) -> dict:
    """What the input pipeline will keep and drop, and how much of the text is `[UNK]`.

    Raises `RunError` when fewer than `MIN_TRAIN_PAIRS` training pairs fit `max_length`.
    """
    import numpy as np

    counts = {"empty_skipped": corpus.skipped_empty, "duplicates_dropped": corpus.duplicates_dropped,
              "split": corpus.description}
    for split in ("train", "validation", "test"):
        pairs = getattr(corpus, split)
        if not pairs:
            counts[f"{split}_pairs"] = counts[f"{split}_too_long"] = 0
            continue
        source = tokenizer.tokenize_dense([s for s, _ in pairs]).numpy()
        target = tokenizer.tokenize_dense([t for _, t in pairs]).numpy()
        source_length = (source != tokenizer.pad_id).sum(1)
        target_length = (target != tokenizer.pad_id).sum(1)
        # The pipeline's rule: source <= max_length, target + [END] <= max_length.
        too_long = int(np.sum((source_length > max_length) | (target_length + 1 > max_length)))
        counts[f"{split}_pairs"] = len(pairs) - too_long
        counts[f"{split}_too_long"] = too_long
        if split == "train":
            tokens = int(source_length.sum() + target_length.sum())
            unknown = int((source == tokenizer.unk_id).sum() + (target == tokenizer.unk_id).sum())
            counts["train_unk_rate"] = round(unknown / max(tokens, 1), 5)
    kept, dropped = counts["train_pairs"], counts["train_too_long"]
    summary = (
        f"training pairs: {kept} kept, {dropped} longer than --max-length {max_length} dropped, "
        f"{corpus.skipped_empty} empty skipped; [UNK] is {counts['train_unk_rate']:.2%} of the training tokens"
    )
    if counts["train_unk_rate"] > UNK_WARNING:
        summary += (
            f"\nwarning: {counts['train_unk_rate']:.1%} of the training tokens are [UNK]; a larger "
            "--vocab-size or a smaller --min-frequency covers more of the text"
        )
    if kept < MIN_TRAIN_PAIRS:
        raise RunError(
            f"only {kept} training pairs are left ({dropped} longer than --max-length {max_length} dropped, "
            f"{corpus.skipped_empty} empty skipped); at least {MIN_TRAIN_PAIRS} are needed. "
            "Raise --max-length or give a larger corpus."
        )
    return {**counts, "summary": summary}


def _fit(config, output_dir, corpus, tokenizer, verbose, extra_callbacks, cluster) -> dict:
    from keras_transformer.tools.text.datasets import make_dataset

    keras.utils.set_random_seed(config.seed)
    distributed_fit.set_data_parallel(cluster)
    with distributed_fit.scope(cluster):
        model = build_model(config, tokenizer)
        try:
            initial_epoch = kt_callbacks.TrainingState.restore(model, output_dir / "state")
        except ValueError as e:
            raise RunError(f"{e}. Remove {output_dir / 'state'} to train the run from its start, or use another "
                           "--output-dir.") from None
    distributed_fit.wrap_model(cluster, model)
    epochs = math.ceil(config.steps / config.steps_per_epoch)
    if kt_callbacks.TrainingState.stopped(output_dir / "state"):
        epochs = initial_epoch  # the run had reached its target: finish without training
    if initial_epoch and cluster.chief:
        print(f"resuming {output_dir} after step {initial_epoch * config.steps_per_epoch}", flush=True)

    shards = dict(num_shards=cluster.num_processes, shard_index=cluster.process_id,
                  devices_per_shard=distributed_fit.devices_per_process(cluster))
    train_data = make_dataset(
        corpus.train, tokenizer, config.batch_tokens, config.max_length,
        shuffle=True, repeat=True, drop_remainder=True, seed=config.seed, **shards,
    )
    validation_data = make_dataset(
        corpus.validation, tokenizer, config.batch_tokens, config.max_length, shuffle=False, **shards,
    ) if corpus.validation else None

    local_model = distributed_fit.LocalCopy(cluster, model, lambda: build_model(config, tokenizer))  # the chief's, alone

    @contextlib.contextmanager
    def translator():
        with distributed_fit.alone(cluster):
            yield local_model()

    interruptible, best, last, callbacks = _callbacks(
        config, output_dir, corpus, tokenizer, extra_callbacks, cluster, translator)
    # An epoch is `steps_per_epoch` updates, each made of `accumulate_steps` batches.
    fit = dict(steps_per_epoch=config.steps_per_epoch * config.accumulate_steps, epochs=epochs,
               initial_epoch=initial_epoch, validation_data=validation_data, callbacks=callbacks,
               verbose=verbose if cluster.chief else 0)
    start = time.time()
    with interruptible:
        if cluster.distributed and cluster.backend == "tensorflow":
            distributed_fit.fit_with_strategy(model, cluster, train_data, **fit)
        else:
            model.fit(train_data, shuffle=False, **fit)  # the dataset shuffles itself
    train_seconds = time.time() - start
    distributed_fit.unwrap_model(model)
    if cluster.chief:
        steps = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
        with distributed_fit.alone(cluster):
            metrics = _finish(local_model(), config, output_dir, corpus, tokenizer, best, last, interruptible,
                          {"steps": steps, "train_seconds_this_session": round(train_seconds, 1)})
    collectives.barrier(cluster, "run finished")
    if not cluster.chief:
        metrics = json.loads((output_dir / "metrics.json").read_text(encoding="utf-8"))
    return metrics


def _finish(model, config, output_dir, corpus, tokenizer, best, last, interruptible, progress) -> dict:
    """Write the models and the test metrics (the chief, on a one-process model); `progress`
    holds the steps done and this session's training time."""
    from keras_transformer.tools.text.datasets import make_dataset

    _save_models(model, config, output_dir, best, last)
    metrics = _run_metrics(config, output_dir, best, progress)
    if corpus.test:
        test_data = make_dataset(corpus.test, tokenizer, config.batch_tokens, config.max_length, shuffle=False)
        with interruptible:
            results = model.evaluate(test_data, return_dict=True, verbose=0, callbacks=[interruptible])
        metrics.update({f"test_{k}": float(v) for k, v in results.items()})
    files.write_json(output_dir / "metrics.json", metrics)
    print(json.dumps(metrics), flush=True)
    return metrics


def _callbacks(config, output_dir, corpus, tokenizer, extra_callbacks, cluster, translator):
    """`(interruptible, best, last, callbacks)`: the run's callbacks in the order they must run.

    In a cluster, the other processes get only what keeps them in step with the chief:
    metrics averaged over the processes (PyTorch) and the chief's decision to stop."""
    # First, so that a Ctrl-C stops the run before any other callback saves a half epoch.
    interruptible = kt_callbacks.Interruptible()
    callbacks, best, last = [interruptible], None, None
    shared = [kt_callbacks.SharedStop(cluster, collectives.stop_together)] if cluster.distributed else []
    if cluster.distributed:
        callbacks.append(kt_callbacks.SharedLogs(cluster, collectives.average))
    if not cluster.chief:
        return interruptible, best, last, callbacks + shared
    if config.validate_translations and corpus.validation:
        # Before the loggers, which record what they add to the epoch's logs.
        callbacks.append(kt_callbacks.TranslationScores(
            tokenizer, corpus.validation[: config.validate_translations], beam_size=config.validation_beam_size,
            stop_at_exact_match=config.stop_at_exact_match, stop_checks=config.stop_checks,
            translator=translator if cluster.distributed else None,
        ))
        best = kt_callbacks.BestCheckpoints(
            output_dir / "best", config.average_checkpoints if config.average_from == "best" else 1,
            patience=config.early_stopping, metric=config.best_metric(),
        )
        callbacks.append(best)
    # Averaged by `_save_models`, on the model that is saved.
    last = kt_callbacks.CheckpointAverager(output_dir / "checkpoints", config.average_checkpoints,
                                           average_at_end=False)
    callbacks += [
        keras.callbacks.CSVLogger(str(output_dir / "log.csv"), append=True),
        keras.callbacks.TensorBoard(str(output_dir / "tensorboard"), write_graph=False),
        last,
        kt_callbacks.TrainingCurves(output_dir / "log.csv", output_dir / "curves.png", config.steps_per_epoch),
        *extra_callbacks,
        # Last, so that a saved state means every other callback has finished the epoch.
        kt_callbacks.TrainingState(output_dir / "state"),
        *shared,
    ]
    return interruptible, best, last, callbacks


def _save_models(model, config, output_dir, best, last) -> None:
    """Write `best/model.keras` (the best epoch) and `model.keras` (the averaged checkpoints)."""
    final = kt_callbacks.weights_of(model)
    if config.average_from == "last" and last.checkpoints():
        kt_callbacks.average_checkpoints(model, last.checkpoints()[-config.average_checkpoints:])
        final = kt_callbacks.weights_of(model)
    if best is not None and best.checkpoints():
        # best/model.keras: the single epoch with the best validation BLEU.
        kt_callbacks.average_checkpoints(model, best.checkpoints()[:1])
        with files.atomic_write(output_dir / "best" / "model.keras") as tmp:
            model.save(tmp)
        if config.average_from == "best":
            kt_callbacks.average_checkpoints(model, best.checkpoints())
        else:
            kt_callbacks.set_weights(model, final)
    with files.atomic_write(output_dir / "model.keras") as tmp:
        model.save(tmp)


def _run_metrics(config, output_dir, best, progress) -> dict:
    """The run's steps, best epoch and stop reason (the test metrics are added after)."""
    steps = progress["steps"]
    metrics = {"steps": steps, "backend": keras.backend.backend(), **progress}
    if best is not None and best.scores():
        best_epoch = best.ranked()[0]
        # A run stopped mid-epoch by a callback ends at `steps`, not at the epoch's end.
        metrics.update({"best_epoch": best_epoch, "best_step": min(best_epoch * config.steps_per_epoch, steps),
                        f"best_val_{best.metric}": best.scores()[best_epoch][0]})
    if kt_callbacks.TrainingState.stopped(output_dir / "state"):
        metrics["stopped_early"] = True
        reason = kt_callbacks.TrainingState.stop_reason(output_dir / "state")
        print(f"stopped after step {steps} of {config.steps}: {reason}", flush=True)
    return metrics
