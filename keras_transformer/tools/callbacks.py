"""Training callbacks: Ctrl-C that stops cleanly, training curves, and validation
translations scored every epoch. The checkpoint callbacks (`TrainingState`,
`CheckpointAverager`, `BestCheckpoints`) live in `keras_transformer.tools.checkpoints`
and are importable from here too.
"""

from __future__ import annotations

import contextlib
import csv
import pathlib
import signal
import threading
import time

import keras

from keras_transformer.defaults import VALIDATION_BEAM_SIZE
from keras_transformer.tools import atomic, files
from keras_transformer.tools.checkpoints import (  # noqa: F401 - the callbacks users import from here
    BestCheckpoints,
    CheckpointAverager,
    StepBudget,
    TrainingState,
    average_checkpoints,
    request_stop,
    set_weights,
    weights_of,
)


class Interruptible(keras.callbacks.Callback):
    """Ctrl-C stops `fit` on every backend: a context manager and a callback.

    Keras (3.15) turns each batch's logs into Python floats inside a bare `except:`
    (`keras.src.utils.python_utils.pythonify_logs`). On JAX that conversion is where the
    main thread waits for the device, so the `KeyboardInterrupt` of a Ctrl-C is raised
    there, dropped, and training goes on. Inside `with Interruptible() as guard:`, a
    SIGINT is recorded as well as raised, and the callback raises it again at the next
    batch or epoch end. Outside the main thread, or where the program has its own SIGINT
    handler, nothing is changed.

    Example:

    ```python
    with Interruptible() as guard:
        model.fit(data, callbacks=[guard, ...])
    ```
    """

    def __init__(self):
        super().__init__()
        self.interrupted = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread() and (
            signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            self._previous = signal.signal(signal.SIGINT, self._on_signal)
        return self

    def __exit__(self, *exc_info):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _on_signal(self, signum, frame):
        self.interrupted = True
        raise KeyboardInterrupt

    def _raise_if_interrupted(self, *args, **kwargs):
        if self.interrupted:
            raise KeyboardInterrupt

    on_train_batch_end = on_test_batch_end = on_predict_batch_end = _raise_if_interrupted
    on_epoch_end = on_test_end = _raise_if_interrupted


class TrainingCurves(keras.callbacks.Callback):
    """Draws loss and accuracy against steps from a CSV log into a PNG when training ends.

    Args:
        csv_path: The `keras.callbacks.CSVLogger` file (its rows survive resumption).
        png_path: Where to write the figure.
        steps_per_epoch: Converts the log's epochs into steps on the x axis.
    """

    def __init__(self, csv_path, png_path, steps_per_epoch: int, steps: int | None = None):
        super().__init__()
        self.csv_path = pathlib.Path(csv_path)
        self.png_path = pathlib.Path(png_path)
        self.steps_per_epoch, self.steps = steps_per_epoch, steps

    def on_train_end(self, logs=None):
        plot_training_curves(self.csv_path, self.png_path, self.steps_per_epoch, self.steps)


def read_log(csv_path) -> list[dict]:
    """The rows of a `keras.callbacks.CSVLogger` file: `epoch` an int, every other column a
    float, or None where the row has no value (a metric only some epochs log).

    Raises `files.RunDirError` naming the file, the line and what to do if a row is not
    such a row (a damaged or hand-edited log: a resumed run appends to it)."""
    rows, where = [], ""
    try:
        with open(csv_path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            for row in reader:
                where = f"line {reader.line_num}: "
                if None in row or "epoch" not in row:
                    raise ValueError(f"not the header's columns {reader.fieldnames}")
                rows.append({k: int(v) if k == "epoch" else None if v in ("", None) else float(v)
                             for k, v in row.items()})
    except (OSError, ValueError, TypeError) as e:
        raise files.RunDirError(f"{csv_path} is not a training log ({where}{type(e).__name__}: {e}). "
                                f"Remove {csv_path} to log from the next epoch on, or use another --output-dir.") from None
    return rows


def plot_training_curves(csv_path, png_path, steps_per_epoch: int, steps: int | None = None) -> bool:
    """Write the PNG; return `False` if the log has no rows yet. `steps`, the run's last
    step, places a last epoch that `StepBudget` cut short.

    Drawn on a `matplotlib.figure.Figure` of its own (saved through the Agg canvas), so
    the process's matplotlib backend and pyplot's figures are left alone."""
    from matplotlib.figure import Figure

    rows = read_log(csv_path)
    if not rows:
        return False
    steps = [min((r["epoch"] + 1) * steps_per_epoch, steps or float("inf")) for r in rows]
    panels = [("loss", ("loss", "val_loss")), ("accuracy", ("accuracy", "val_accuracy"))]
    if "val_bleu" in rows[0]:  # written by TranslationScores
        panels.append(("validation translations", ("val_bleu", "val_chrf", "val_exact_match")))
    fig = Figure(figsize=(5 * len(panels), 4))
    axes = fig.subplots(1, len(panels))
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            if key in rows[0]:
                values = [r[key] * (100 if key == "val_exact_match" else 1) for r in rows if r[key] is not None]
                label = "val_exact_match (%)" if key == "val_exact_match" else key
                ax.plot(steps[len(steps) - len(values):], values, "--" if key.startswith("val_") else "-", label=label)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    with atomic.atomic_write(png_path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    return True


class TranslationScores(keras.callbacks.Callback):
    """Translates a fixed validation subset at the end of every epoch and scores it.

    Greedy decoding by default (`beam_size=1`, fast); the scores are sacreBLEU's BLEU and
    chrF and the share of exact matches. They are added to the epoch's logs as
    `val_bleu`, `val_chrf` and `val_exact_match`, so the callbacks after this one
    (`CSVLogger`, `TensorBoard`, `TrainingCurves`) record them. With
    `stop_at_exact_match`, training stops at the end of the first epoch whose exact
    match reaches it, and whose `stop_checks - 1` epochs before it reached it too.

    Args:
        tokenizer: The run's tokenizer.
        pairs: `(source, reference)` strings, translated in this order every epoch.
        beam_size: Defaults to `1` (greedy).
        stop_at_exact_match: Stop once the exact-match share (0-1) reaches this.
            Defaults to `None` (never).
        stop_checks: Epochs in a row that must reach it (counted from the start of
            this `fit`). Defaults to `1`. A check of a few hundred pairs passes by luck
            now and then, at a moment when the model is still swinging: `2` asks for a
            model that stays above the target.
        translator: `translator()` returns a context manager whose value is the model
            to translate with (a one-process copy of a model that several processes
            train). Defaults to `None`: the model being trained.
    """

    def __init__(self, tokenizer, pairs, beam_size: int = VALIDATION_BEAM_SIZE,
                 stop_at_exact_match: float | None = None, stop_checks: int = 1, translator=None):
        super().__init__()
        if stop_checks < 1:
            raise ValueError(f"`stop_checks` must be at least 1. Received: stop_checks={stop_checks}")
        self.tokenizer = tokenizer
        self.sources = [s for s, _ in pairs]
        self.references = [r for _, r in pairs]
        self.beam_size = beam_size
        self.stop_at_exact_match = stop_at_exact_match
        self.stop_checks = stop_checks
        self.translator = translator
        self._passed = 0  # epochs in a row that reached the target

    def on_train_begin(self, logs=None):
        self._passed = 0  # a `fit` (a resumed run's too) counts from its own first epoch

    def on_epoch_end(self, epoch, logs=None):
        from keras_transformer.tools import evaluation

        with contextlib.nullcontext(self.model) if self.translator is None else self.translator() as model:
            # The run's own validation sentences, whole (as long as the corpus holds them).
            hypotheses = evaluation.translate_texts(model, self.tokenizer, self.sources, beam_size=self.beam_size,
                                                    max_input_length=None)
        scores = evaluation.score(hypotheses, self.references, self.tokenizer)
        if logs is not None:
            logs.update({f"val_{k}": scores[k] for k in ("bleu", "chrf", "exact_match")})
        target = self.stop_at_exact_match
        if target is not None:
            self._passed = self._passed + 1 if scores["exact_match"] >= target else 0
            if self._passed >= self.stop_checks:
                times = f" on {self.stop_checks} epochs in a row" if self.stop_checks > 1 else ""
                request_stop(self.model, f"validation exact match reached {round(target * 100, 4):g}%{times}")



class SharedLogs(keras.callbacks.Callback):
    """In a multi-process run, each epoch's logs become their mean over the processes.

    Every process has one, at the same place in its list (each call is a collective),
    before the callbacks that read the logs. On PyTorch each process's metrics are its
    own; on JAX Keras' metrics are already the global batch's and are left as they are.

    Args:
        cluster: The `keras_transformer.tools.cluster.Cluster`.
        average: `average(cluster, logs) -> logs`.
    """

    def __init__(self, cluster, average):
        super().__init__()
        self.cluster, self.average = cluster, average

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update(self.average(self.cluster, logs))


class TimeBudget(keras.callbacks.Callback):
    """Pauses `fit` at the end of an epoch when another epoch as long as that one would end
    past `deadline` (a `clock()` time): `train` with a time limit, on a machine lent for a
    while. Never in the last epoch, nor in one that a callback stopped already. It goes
    after `TrainingState`, which has then saved the epoch as any other (not stopped), so that
    `train` on the same directory continues the run; in a cluster, the chief's alone, before
    `SharedStop`.

    Args:
        deadline: A `clock()` time.
        limit: The limit as the reason names it (`"--max-minutes 30"`).
        clock: Seconds now; `time.time` by default.

    Attributes:
        reason: Why `fit` paused, or `None`.
    """

    def __init__(self, deadline: float, limit: str, clock=time.time):
        super().__init__()
        self.deadline, self.limit, self.clock = deadline, limit, clock
        self.reason, self._began = None, None

    def on_epoch_begin(self, epoch, logs=None):
        self._began = self.clock()

    def on_epoch_end(self, epoch, logs=None):
        now = self.clock()
        seconds = now - self._began  # the epoch's, its callbacks' work included
        last = epoch + 1 >= self.params.get("epochs", float("inf"))
        if last or getattr(self.model, "stop_training", False) or now + seconds <= self.deadline:
            return
        self.model.stop_training = True
        self.reason = f"{self.limit} would pass during another epoch of {seconds:.0f} s"


class SharedStop(keras.callbacks.Callback):
    """In a multi-process run, the chief's decision to stop (a target reached, patience
    exhausted) becomes every process's at the end of each epoch. Every process has one,
    last in its list.

    Args:
        cluster: The `keras_transformer.tools.cluster.Cluster`.
        stop_together: `stop_together(cluster, stop) -> stop`.
    """

    def __init__(self, cluster, stop_together):
        super().__init__()
        self.cluster, self.stop_together = cluster, stop_together

    def on_epoch_end(self, epoch, logs=None):
        self.model.stop_training = self.stop_together(self.cluster, bool(getattr(self.model, "stop_training", False)))
