"""Checkpoints: the file format, the resumption state, and which epochs are kept.

A checkpoint is a NumPy `.npz` file that names each weight by its path relative to the
model (`encoder/encoder_block_0/self_attention/query_dense/kernel`; optimizer slots by the
path of their weight), so it is the same whatever backend wrote it and a change in the
order of a model's layers still loads every array into its own weight. Files written
before weights were named (`v00000`, ... in the order of `model.weights`) still load,
every shape checked. Every file is written with `atomic.atomic_write`, so a process killed
at any moment leaves either the previous file or the new one, never a half-written one.
"""

from __future__ import annotations

import json
import pathlib
import zipfile

import keras
import numpy as np

from keras_transformer.tools import atomic, files


def _save_npz(path: pathlib.Path, **arrays) -> None:
    with atomic.atomic_write(path) as tmp:
        np.savez(tmp, **arrays)


def _names(variables, *prefixes: str) -> list[str]:
    """Each variable's path without the leading `prefixes` (the model's or the
    optimizer's own name, which Keras numbers per process: `transformer_1/...`)."""
    names = []
    for v in variables:
        name = v.path
        for prefix in prefixes:
            name = name[len(prefix):] if name.startswith(prefix) else name
        names.append(name)
    if len(set(names)) != len(names):
        raise ValueError("two variables share a path; a checkpoint cannot tell them apart")
    return names


def _model_names(model) -> list[str]:
    return _names(model.weights, f"{model.name}/")


def _optimizer_names(model) -> list[str]:
    # Keras names a slot after the path of its weight: "adam/transformer_encoder_..._momentum".
    return _names(model.optimizer.variables, f"{model.optimizer.name}/", f"{model.name}_")


def _weights_dict(variables, names) -> dict[str, np.ndarray]:
    """`{name: array}`: a checkpoint names every weight, so a model whose layers were
    reordered still loads each array into the weight it belongs to."""
    return {name: keras.ops.convert_to_numpy(v) for name, v in zip(names, variables)}


def _positional(arrays: dict) -> bool:
    """Whether `arrays` is the format before weights were named: `v00000`, `v00001`, ...
    in the order of `model.weights`."""
    return bool(arrays) and all(k[:1] == "v" and k[1:].isdigit() for k in arrays)


def weights_of(model: keras.Model) -> dict[str, np.ndarray]:
    """The model's weights as NumPy arrays by name, as checkpoints hold them."""
    return _weights_dict(model.weights, _model_names(model))


def set_weights(model: keras.Model, arrays: dict) -> None:
    """Assign what `weights_of` returned."""
    _assign(model.weights, _model_names(model), arrays, "weights")


def _assign(variables, names, arrays: dict, what: str) -> None:
    """Assign `arrays` (by name, or by position in the older format), checking that every
    variable gets one array of its shape; else a `ValueError` naming `what`."""
    variables = list(variables)
    if _positional(arrays):
        if len(arrays) != len(variables):
            raise ValueError(f"{what} holds {len(arrays)} arrays; the model has {len(variables)} variables.")
        pairs = [(v, arrays[f"v{i:05d}"]) for i, v in enumerate(variables)]
    else:
        missing = [n for n in names if n not in arrays]
        unknown = sorted(set(arrays) - set(names))
        if missing or unknown:
            raise ValueError(f"{what} does not match the model: no array for {missing[:3]}, arrays for no "
                             f"weight {unknown[:3]}.")
        pairs = [(v, arrays[n]) for v, n in zip(variables, names)]
    for v, array in pairs:
        if tuple(array.shape) != tuple(v.shape):
            raise ValueError(f"{what}: the array for {v.path} has shape {tuple(array.shape)}, the weight "
                             f"{tuple(v.shape)}.")
    for v, array in pairs:
        v.assign(array)


def request_stop(model: keras.Model, reason: str) -> None:
    """Stop `model.fit` after this batch or epoch, and say why: `model.stop_training` (Keras'
    own switch) and `model.stop_reason`, which `TrainingState` saves with the run."""
    model.stop_training = True
    model.stop_reason = reason


class StepBudget(keras.callbacks.Callback):
    """Ends `model.fit` after its `batches`-th batch, counted from the first epoch
    (`initial_epoch` included), so that a run of `--steps` that are not a whole number of
    epochs trains exactly that many: the last epoch is cut short, and its end (checkpoint,
    resumption state, log row) is written as every epoch's is. Counts in Python; reads no
    device value.

    Args:
        batches: The run's batches in all: its updates times the batches of each update.
        batches_per_epoch: `fit`'s `steps_per_epoch`.
    """

    def __init__(self, batches: int, batches_per_epoch: int):
        super().__init__()
        self.batches, self.batches_per_epoch = batches, batches_per_epoch
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self._epoch * self.batches_per_epoch + batch + 1 >= self.batches:
            self.model.stop_training = True  # the budget's end: no reason, not an early stop


class TrainingState(keras.callbacks.Callback):
    """Saves everything needed to resume at the end of every epoch: `state.npz`.

    The file holds the model's weights, the optimizer's variables (its step counter,
    and so the learning-rate schedule, included) and the number of epochs done. Train
    by steps with `model.fit(dataset.repeat(), steps_per_epoch=k, epochs=n,
    initial_epoch=TrainingState.restore(model, directory))`: after a kill the same
    command continues from the last finished epoch and stops at step `n * k`.

    Args:
        directory: Where `state.npz` lives.
    """

    FILENAME = "state.npz"

    def __init__(self, directory):
        super().__init__()
        self.path = pathlib.Path(directory) / self.FILENAME
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def on_train_begin(self, logs=None):
        self.model.stop_reason = None  # a reason is this fit's, never an earlier one's

    def on_epoch_end(self, epoch, logs=None):
        arrays = {f"model_{k}": v for k, v in weights_of(self.model).items()}
        optimizer = _weights_dict(self.model.optimizer.variables, _optimizer_names(self.model))
        arrays.update({f"optimizer_{k}": v for k, v in optimizer.items()})
        # A stop asked for by a callback (a target reached) is part of the state: a
        # resumed run does not train past it. In the last epoch, a stop with no reason is
        # the end of the run's steps (`StepBudget`), not an early one.
        reason = getattr(self.model, "stop_reason", None)
        last_epoch = epoch + 1 >= self.params.get("epochs", float("inf"))
        stopped = bool(getattr(self.model, "stop_training", False)) and (reason is not None or not last_epoch)
        reason = reason or "a callback asked to stop"
        _save_npz(self.path, epochs_done=np.array(epoch + 1), stopped=np.array(stopped),
                  stop_reason=np.array(reason if stopped else ""), **arrays)

    @classmethod
    def _read(cls, directory, read):
        """`read(data)` on the saved `state.npz`, or None if there is none.

        Raises `ValueError` if the file is not a state `TrainingState` wrote.
        """
        path = pathlib.Path(directory) / cls.FILENAME
        if not path.is_file():
            return None
        try:
            with files.load_npz(path) as data:
                return read(data)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
            raise ValueError(f"{path} is not a resumption state ({type(e).__name__}: {e})") from None

    @classmethod
    def progress(cls, directory) -> tuple[int, bool]:
        """The epochs the saved state has finished, and whether a callback stopped the run
        there; `(0, False)` if there is no state."""
        return cls._read(directory, lambda data: (int(data["epochs_done"]),
                                                  "stopped" in data.files and bool(data["stopped"]))) or (0, False)

    @classmethod
    def stopped(cls, directory) -> bool:
        """Whether the saved run was stopped by a callback before its last epoch."""
        return cls.progress(directory)[1]

    @classmethod
    def stop_reason(cls, directory) -> str:
        """Why the saved run stopped, as the callback that stopped it said when it decided
        (`request_stop`); empty if it did not stop early."""
        def read(data):
            if not ("stopped" in data.files and bool(data["stopped"])):
                return ""
            return str(data["stop_reason"]) if "stop_reason" in data.files else "a callback asked to stop"

        return cls._read(directory, read) or ""

    @classmethod
    def restore(cls, model: keras.Model, directory) -> int:
        """Load the saved state into a built, compiled `model`; return the epochs done (0 if none).

        Raises `ValueError` if the file is not a state `TrainingState` wrote.
        """
        def read(data):
            return ({k[len("model_"):]: data[k] for k in data.files if k.startswith("model_")},
                    {k[len("optimizer_"):]: data[k] for k in data.files if k.startswith("optimizer_")},
                    int(data["epochs_done"]))

        saved = cls._read(directory, read)
        if saved is None:
            return 0
        model_part, optimizer_part, epochs_done = saved
        path = pathlib.Path(directory) / cls.FILENAME
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        _assign(model.weights, _model_names(model), model_part, f"{path} (model)")
        _assign(model.optimizer.variables, _optimizer_names(model), optimizer_part, f"{path} (optimizer)")
        return epochs_done


class _CheckpointKeeper(keras.callbacks.Callback):
    """Writes epoch checkpoints `checkpoint_{epoch:06d}.npz` into a directory and keeps `num_checkpoints`."""

    def __init__(self, directory, num_checkpoints: int):
        super().__init__()
        if num_checkpoints < 1:
            raise ValueError(f"`num_checkpoints` must be >= 1. Received: {num_checkpoints!r}")
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.num_checkpoints = num_checkpoints

    def _path(self, epoch_number: int) -> pathlib.Path:
        return self.directory / f"checkpoint_{epoch_number:06d}.npz"

    def _save(self, epoch_number: int) -> None:
        _save_npz(self._path(epoch_number), **weights_of(self.model))


class CheckpointAverager(_CheckpointKeeper):
    """Keeps the weights of the last `num_checkpoints` epochs and averages them at the end.

    Paper, section 6.1: "For the base models, we used a single model obtained by
    averaging the last 5 checkpoints". A checkpoint is written at the end of every
    epoch (`checkpoint_{epoch:06d}.npz`); older ones are deleted. When training ends,
    the model's weights become the element-wise mean of the kept checkpoints.

    Args:
        directory: Where the checkpoints live.
        num_checkpoints: k, how many to keep and average. Defaults to `5`.
        average_at_end: Average them into the model when training ends. Defaults to
            `True`; `False` only keeps them (another choice of checkpoints is averaged).
    """

    def __init__(self, directory, num_checkpoints: int = 5, average_at_end: bool = True):
        super().__init__(directory, num_checkpoints)
        self.average_at_end = average_at_end

    def checkpoints(self) -> list[pathlib.Path]:
        return sorted(self.directory.glob("checkpoint_*.npz"))

    def on_epoch_end(self, epoch, logs=None):
        self._save(epoch + 1)
        for old in self.checkpoints()[: -self.num_checkpoints]:
            old.unlink()

    def on_train_end(self, logs=None):
        if self.average_at_end:
            average_checkpoints(self.model, self.checkpoints()[-self.num_checkpoints :])


class BestCheckpoints(_CheckpointKeeper):
    """Keeps the `num_checkpoints` best epochs by a validation score, and stops early.

    Reads `val_{metric}` (ties broken by `val_chrf`) from the epoch's logs, so it must
    come after `TranslationScores` in the callback list. The best epochs' weights are
    kept as `checkpoint_{epoch:06d}.npz` in `directory`, with `best.json` holding every
    epoch's scores; with `patience`, training stops after `patience` epochs in a row
    without a new best. Everything it needs lives in `directory`, so a resumed run
    goes on counting where the killed one was.

    Args:
        directory: Where the best checkpoints and `best.json` live.
        num_checkpoints: How many of the best to keep. Defaults to `1`.
        patience: Epochs without improvement before stopping. Defaults to `None` (never).
        metric: `"bleu"` (the paper's choice, the default), `"chrf"` or `"exact_match"`.
            Word BLEU says nothing about one-word references (it is 0 for a perfect
            one-word translation, and above 0 for a wrong translation of several words):
            rank a task like that by exact match.
    """

    RECORD = "best.json"
    METRICS = ("bleu", "chrf", "exact_match")

    def __init__(self, directory, num_checkpoints: int = 1, patience: int | None = None, metric: str = "bleu"):
        super().__init__(directory, num_checkpoints)
        if metric not in self.METRICS:
            raise ValueError(f"`metric` must be one of {self.METRICS}. Received: metric={metric!r}")
        self.patience = patience
        self.metric = metric

    def scores(self) -> dict[int, tuple[float, float]]:
        """`{epoch: (val_{metric}, val_chrf)}` for every epoch scored so far (epochs count from 1)."""
        return read_scores(self.directory)

    def ranked(self, scores: dict | None = None) -> list[int]:
        """Scored epochs, best first (the earlier epoch first among equals)."""
        scores = self.scores() if scores is None else scores
        return sorted(scores, key=lambda e: (-scores[e][0], -scores[e][1], e))

    def checkpoints(self) -> list[pathlib.Path]:
        """The kept checkpoints, best first."""
        paths = [self._path(e) for e in self.ranked()[: self.num_checkpoints]]
        return [p for p in paths if p.is_file()]

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        name = f"val_{self.metric}"
        if name not in logs:
            raise ValueError(f"BestCheckpoints needs `{name}` in the logs: put TranslationScores before it.")
        scores = self.scores()
        scores[epoch + 1] = (float(logs[name]), float(logs.get("val_chrf", 0.0)))
        keep = self.ranked(scores)[: self.num_checkpoints]
        if epoch + 1 in keep:
            self._save(epoch + 1)
        atomic.write_json(self.directory / self.RECORD, {"scores": {str(e): list(v) for e, v in sorted(scores.items())},
                                                        "best_epoch": keep[0], "metric": self.metric})
        for path in self.directory.glob("checkpoint_*.npz"):
            if int(path.stem.split("_")[1]) not in keep:
                path.unlink()
        if self.patience_exhausted():
            name = {"bleu": "BLEU", "chrf": "chrF", "exact_match": "exact match"}[self.metric]
            request_stop(self.model, f"validation {name} did not improve for {self.patience} epochs")

    def patience_exhausted(self) -> bool:
        """Whether `patience` epochs have passed since the best one."""
        scores = self.scores()
        return self.patience is not None and bool(scores) and max(scores) - self.ranked(scores)[0] >= self.patience


def average_checkpoints(model: keras.Model, paths) -> int:
    """Set `model`'s weights to the mean of the checkpoints at `paths`; return how many."""
    paths = list(paths)
    if not paths:
        return 0
    total = None
    for path in paths:
        try:
            with files.load_npz(path) as data:
                arrays = {k: data[k].astype("float64") for k in data.files}
        except (OSError, ValueError, zipfile.BadZipFile) as e:
            raise _unreadable_checkpoint(path, e) from None
        if total is not None and set(arrays) != set(total):
            raise ValueError(f"{path} holds other weights than {paths[0]}; they cannot be averaged.")
        total = arrays if total is None else {k: t + arrays[k] for k, t in total.items()}
    _assign(model.weights, _model_names(model), {k: t / len(paths) for k, t in total.items()},
            f"the average of {paths[0].parent}")
    return len(paths)


def check_checkpoint(path) -> None:
    """Raise `files.RunDirError` naming `path` and what to do if it cannot be opened as a
    checkpoint (a damaged or truncated archive). Reads the archive's index, not the weights:
    `average_checkpoints` reports what only reading them finds."""
    try:
        with zipfile.ZipFile(path) as archive:
            if not archive.namelist():
                raise ValueError("it holds no weights")
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise _unreadable_checkpoint(path, e) from None


def _unreadable_checkpoint(path, error: Exception) -> files.RunDirError:
    return files.RunDirError(
        f"{path} is not a readable checkpoint ({type(error).__name__}: {error}). Remove it (the run's final "
        "model then leaves that epoch out), or use another --output-dir.")


def read_scores(directory) -> dict[int, tuple[float, float]]:
    """The validation scores `BestCheckpoints` recorded in `directory` (`{}` if none).

    Raises `files.RunDirError` naming the record and what to do if it cannot be read."""
    path = pathlib.Path(directory) / BestCheckpoints.RECORD
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return {int(k): (float(v[0]), float(v[1])) for k, v in record["scores"].items()}
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise files.RunDirError(
            f"{path} is not a record of validation scores ({type(e).__name__}: {e}). Remove {path.parent} to "
            "rank the epochs from the next one on, or use another --output-dir.") from None
