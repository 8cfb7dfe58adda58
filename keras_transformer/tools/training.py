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
import pathlib
import time

import keras

from keras_transformer.losses import LabelSmoothedCrossEntropy
from keras_transformer.metrics import MaskedAccuracy, Perplexity
from keras_transformer.models.transformer import Transformer
from keras_transformer.schedules import transformer_optimizer
from keras_transformer.tools import callbacks as kt_callbacks
from keras_transformer.tools import cluster as cluster_lib
from keras_transformer.tools import atomic, collectives, distributed_fit, files, run_setup
from keras_transformer.tools.config import RunError, TrainConfig, busy_error

__all__ = ["RunError", "TrainConfig", "build_model", "train"]


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
          join_timeout: float | None = None, max_minutes: float | None = None) -> dict:
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

    `max_minutes` pauses the run at the end of an epoch once another epoch as long would end
    more than `max_minutes` after this call (at least one epoch is trained): the models and
    the test metrics are written as at the run's end, the metrics with `"paused"` (the
    reason), and `train` on the same directory continues the run.
    """
    pause = None if max_minutes is None else kt_callbacks.TimeBudget(time.time() + 60 * max_minutes,
                                                                      f"--max-minutes {max_minutes:g}")
    # Everything that can be wrong with the input is found before the directory is touched.
    config.validate()
    if cluster is None:
        cluster = cluster_lib.from_environment(keras.backend.backend())
    collectives.join(cluster, cluster_lib.JOIN_TIMEOUT if join_timeout is None else join_timeout)
    with collectives.stop_if_lost(cluster):
        return _train(config, pathlib.Path(output_dir), corpus, callbacks, cluster, verbose, pause)


def _train(config, output_dir, corpus, callbacks, cluster, verbose, pause) -> dict:
    """`train` once this process has joined its cluster."""
    busy = busy_error(output_dir)

    finished, error = None, None
    try:
        run_setup.check_mixed_precision(config.mixed_precision)
        resuming = run_setup.check_output_dir(output_dir, config) if cluster.chief else True
        if resuming and cluster.chief:
            with files.lock(output_dir / "train.lock", busy):
                finished = run_setup.finished_metrics(config, output_dir)
                if finished is None:
                    run_setup.check_saved_progress(output_dir)
    except (RunError, files.RunDirError) as e:
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
        corpus = run_setup.load_corpus(config) if corpus is None else corpus
    except RunError as e:
        error = e
    collectives.agree(cluster, error)
    collectives.check_same(cluster, _facts(config, corpus, cluster))
    tokenizer = None
    if cluster.chief:
        try:
            tokenizer, data = run_setup.prepare(config, output_dir, corpus, resuming)
        except RunError as e:
            error = e
    collectives.agree(cluster, error)
    with contextlib.ExitStack() as held:
        if cluster.chief:
            output_dir.mkdir(parents=True, exist_ok=True)
            held.enter_context(files.lock(output_dir / "train.lock", busy))
            if not resuming:
                atomic.write_json(output_dir / "config.json", dataclasses.asdict(config))
                print(f"a new run in {output_dir}: stopped or killed, the same command resumes it", flush=True)
            if not (output_dir / "tokenizer").is_dir() or not resuming:
                tokenizer.save(output_dir / "tokenizer")
            atomic.write_json(output_dir / "data.json", data)
        collectives.barrier(cluster, "run directory written")
        if tokenizer is None:  # the chief's vocabulary
            tokenizer = files.load_run_tokenizer(output_dir / "tokenizer")
        return _fit(config, output_dir, corpus, tokenizer, verbose, list(callbacks), cluster, pause)


def _facts(config: TrainConfig, corpus, cluster: cluster_lib.Cluster) -> dict:
    """What every process of a run must share (`cluster.check_same`). The number of processes
    too: JAX's coordinator counts the processes as process 0 was told, and a process told
    another number would read the wrong share of every batch."""
    import sys

    settings = {f"--{k.replace('_', '-')}": v for k, v in dataclasses.asdict(config).items()}
    versions = {"python": sys.version.split()[0], "keras": keras.__version__, "backend": keras.backend.backend()}
    return {"the number of processes": cluster.num_processes, **settings, "the corpus": corpus.digest(),
            "the backend and versions": versions}


def _datasets(config, corpus, tokenizer, cluster, trained_batches: int):
    """`(train, validation)`: this process's slice of every global batch. A resumed run reads
    on from the batch where it stopped, as if it had never stopped: the shuffled stream is the
    same at every start (one seed), and the `trained_batches` already trained are read past."""
    from keras_transformer.tools.text.datasets import make_dataset

    shards = dict(num_shards=cluster.num_processes, shard_index=cluster.process_id,
                  devices_per_shard=distributed_fit.devices_per_process(cluster))
    train_data = make_dataset(
        corpus.train, tokenizer, config.batch_tokens, config.max_length,
        shuffle=True, repeat=True, drop_remainder=True, seed=config.seed, **shards,
    )
    train_data = train_data.skip(trained_batches)
    validation_data = make_dataset(
        corpus.validation, tokenizer, config.batch_tokens, config.max_length, shuffle=False, **shards,
    ) if corpus.validation else None
    return train_data, validation_data


def _fit(config, output_dir, corpus, tokenizer, verbose, extra_callbacks, cluster, pause) -> dict:
    keras.utils.set_random_seed(config.seed)
    distributed_fit.set_data_parallel(cluster)
    with distributed_fit.scope(cluster):
        model = build_model(config, tokenizer)
        try:
            initial_epoch = kt_callbacks.TrainingState.restore(model, output_dir / "state")
        except ValueError as e:
            raise run_setup.state_error(e, output_dir) from None
    distributed_fit.wrap_model(cluster, model)
    epochs = config.epochs()
    if kt_callbacks.TrainingState.stopped(output_dir / "state"):
        epochs = initial_epoch  # the run had reached its target: finish without training
    # An epoch is `steps_per_epoch` updates, each made of `accumulate_steps` batches. A run
    # that stopped trains no further: it reads no batch, so none is read past.
    batches_per_epoch = config.batches_per_epoch()
    trained_batches = initial_epoch * batches_per_epoch if epochs > initial_epoch else 0
    if initial_epoch and cluster.chief:
        print(f"resuming {output_dir} after step {config.steps_after(initial_epoch)}"
              + (" (reading past the batches trained already first)" if trained_batches else ""), flush=True)

    train_data, validation_data = _datasets(config, corpus, tokenizer, cluster, trained_batches)

    local_model = distributed_fit.LocalCopy(cluster, model, lambda: build_model(config, tokenizer))  # the chief's, alone

    @contextlib.contextmanager
    def translator():
        with distributed_fit.alone(cluster):
            yield local_model()

    interruptible, best, last, callbacks = _callbacks(
        config, output_dir, corpus, tokenizer, extra_callbacks, cluster, translator, pause)
    fit = dict(steps_per_epoch=batches_per_epoch, epochs=epochs,
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
        progress = {"steps": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
                    "train_seconds_this_session": round(train_seconds, 1)}
        if pause is not None and pause.reason:
            progress["paused"] = pause.reason
        with distributed_fit.alone(cluster):
            metrics = _finish(local_model(optimizer=True), config, output_dir, corpus, tokenizer, best, last,
                              interruptible, progress)
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
    atomic.write_json(output_dir / "metrics.json", metrics)
    print(f"the run is in {output_dir}: evaluate, translate or export it with --run-dir {output_dir}; its metrics:",
          flush=True)
    print(json.dumps(metrics), flush=True)
    return metrics


def _callbacks(config, output_dir, corpus, tokenizer, extra_callbacks, cluster, translator, pause):
    """`(interruptible, best, last, callbacks)`: the run's callbacks in the order they must run.

    In a cluster, the other processes get only what keeps them in step with the chief:
    metrics averaged over the processes (PyTorch) and the chief's decision to stop."""
    # First, so that a Ctrl-C stops the run before any other callback saves a half epoch.
    interruptible = kt_callbacks.Interruptible()
    # Then the end of the run's steps, in every process: the last epoch may be cut short.
    budget = kt_callbacks.StepBudget(config.steps * config.accumulate_steps, config.batches_per_epoch())
    callbacks, best, last = [interruptible, budget], None, None
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
        kt_callbacks.TrainingCurves(output_dir / "log.csv", output_dir / "curves.png", config.steps_per_epoch,
                                    config.steps),
        *extra_callbacks,
        # Last, so that a saved state means every other callback has finished the epoch.
        kt_callbacks.TrainingState(output_dir / "state"),
        *([pause] if pause is not None else []),  # after the state, saved as not stopped
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
        with atomic.atomic_write(output_dir / "best" / "model.keras") as tmp:
            model.save(tmp)
        if config.average_from == "best":
            kt_callbacks.average_checkpoints(model, best.checkpoints())
        else:
            kt_callbacks.set_weights(model, final)
    with atomic.atomic_write(output_dir / "model.keras") as tmp:
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
    elif "paused" in progress:
        print(f"paused after step {steps} of {config.steps}: {progress['paused']}; the same command continues "
              "the run", flush=True)
    return metrics
