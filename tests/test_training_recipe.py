"""Loss, metrics, schedule and checkpoint callbacks of the paper's recipe."""

import re

import keras
import numpy as np
import pytest

import keras_transformer as kt
from keras_transformer.tools import callbacks as kt_callbacks
from tests.conftest import BACKEND, only_on, to_numpy


def _logits_and_labels(seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(3, 5, 7)).astype("float32") * 2
    labels = rng.integers(1, 7, size=(3, 5)).astype("int32")
    labels[0, 3:] = 0
    labels[2, 1:] = 0
    return logits, labels


@pytest.mark.parametrize("epsilon", [0.0, 0.1, 0.3])
def test_loss_equals_keras_smoothed_crossentropy_on_real_tokens(epsilon):
    logits, labels = _logits_and_labels()
    ours = float(to_numpy(kt.losses.LabelSmoothedCrossEntropy(epsilon=epsilon)(labels, logits)))
    real = labels != 0
    keras_loss = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=epsilon)
    expected = float(to_numpy(keras_loss(np.eye(7, dtype="float32")[labels[real]], logits[real])))
    assert ours == pytest.approx(expected, rel=1e-5)
    # Padding never matters: change the logits there and nothing moves.
    changed = logits.copy()
    changed[~real] = 100.0
    assert float(to_numpy(kt.losses.LabelSmoothedCrossEntropy(epsilon=epsilon)(labels, changed))) == pytest.approx(ours, rel=1e-6)


def test_the_loss_and_the_metrics_refuse_a_pad_id_that_is_not_an_id():
    for bad in (True, 1.5, -1):
        with pytest.raises(ValueError, match=f"Loss 'label_smoothed_cross_entropy': `pad_id` must be an integer >= 0. "
                                             f"Received: pad_id={bad}"):
            kt.losses.LabelSmoothedCrossEntropy(pad_id=bad)
        for metric in (kt.metrics.MaskedAccuracy, kt.metrics.Perplexity):
            with pytest.raises(ValueError, match=f"Metric '.*': `pad_id` must be an integer >= 0"):
                metric(pad_id=bad)
    with pytest.raises(ValueError, match=r"Loss 'label_smoothed_cross_entropy': `epsilon` must be in \[0, 1\)"):
        kt.losses.LabelSmoothedCrossEntropy(epsilon=1.0)


def test_the_loss_and_the_metrics_refuse_labels_not_shaped_like_the_logits():
    # Targets one position longer than the logits (not shifted), and labels one-hot
    # encoded: before, each backend's own error about broadcasting or dimensions.
    logits, labels = _logits_and_labels()
    for bad in (np.concatenate([labels, labels[:, :1]], axis=1), np.eye(7, dtype="int32")[labels]):
        message = rf"the labels must be shaped like the logits less their last axis .*y_true.shape={re.escape(str(bad.shape))}"
        with pytest.raises(ValueError, match=f"Loss 'label_smoothed_cross_entropy': {message}"):
            kt.losses.LabelSmoothedCrossEntropy()(bad, logits)
        for metric in (kt.metrics.MaskedAccuracy(), kt.metrics.Perplexity()):
            with pytest.raises(ValueError, match=f"Metric '{metric.name}': {message}"):
                metric.update_state(bad, logits)


def test_labels_that_are_not_token_ids_are_refused_where_read_and_nan_where_not():
    # A model's vocabulary smaller than the labels': PyTorch's loss read such a label's
    # log-probability modulo V (a plausible loss), JAX's was NaN.
    logits, labels = _logits_and_labels()
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    for bad in (7, -1):
        wrong = labels.copy()
        wrong[1, 2] = bad
        message = (r"the labels must be token ids in \[0, 7\) \(the logits' last axis\). "
                   rf"Received: min={min(bad, 0)}, max=")
        with pytest.raises(ValueError, match=f"Loss 'label_smoothed_cross_entropy': {message}"):
            kt.losses.LabelSmoothedCrossEntropy()(wrong, logits)
        for metric in (kt.metrics.MaskedAccuracy(), kt.metrics.Perplexity()):
            with pytest.raises(ValueError, match=f"Metric '{metric.name}': {message}"):
                metric.update_state(wrong.astype("float32"), logits)
        # What a compiled step computes, where the labels cannot be read: NaN at that label.
        if BACKEND == "tensorflow" and bad == 7:  # its gather refuses a label past the last class itself
            with pytest.raises(Exception, match=r"indices\[.*\] = -?[0-9]+ is not in \[0, 7\)"):
                kt.losses.label_log_probs(log_probs, wrong)
            continue
        read = to_numpy(kt.losses.label_log_probs(log_probs, wrong))
        assert np.isnan(read[1, 2]) and np.isnan(read).sum() == 1
        inside = wrong != bad
        expected = np.take_along_axis(log_probs, wrong[..., None] % 7, -1)[..., 0]
        np.testing.assert_allclose(read[inside], expected[inside], rtol=1e-6)


def test_masked_accuracy_and_perplexity():
    logits, labels = _logits_and_labels(1)
    real = labels != 0
    acc = kt.metrics.MaskedAccuracy()
    acc.update_state(labels, logits)
    assert float(to_numpy(acc.result())) == pytest.approx((logits.argmax(-1) == labels)[real].mean())
    ppl = kt.metrics.Perplexity()
    ppl.update_state(labels, logits)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, labels[..., None], -1)[..., 0][real].mean()
    assert float(to_numpy(ppl.result())) == pytest.approx(np.exp(nll), rel=1e-5)


def test_schedule_formula_and_peak():
    d_model, warmup = 512, 4000
    schedule = kt.schedules.TransformerSchedule(d_model, warmup)
    steps = np.arange(0, 20000, 7)
    rates = to_numpy(schedule(steps))
    paper_steps = steps + 1
    expected = d_model**-0.5 * np.minimum(paper_steps**-0.5, paper_steps * warmup**-1.5)
    np.testing.assert_allclose(rates, expected, rtol=1e-5)
    dense = to_numpy(schedule(np.arange(0, 8000)))
    assert int(dense.argmax()) + 1 == warmup  # peaks at paper step = warmup_steps
    restored = kt.schedules.TransformerSchedule.from_config(schedule.get_config())
    assert float(to_numpy(restored(123))) == pytest.approx(float(to_numpy(schedule(123))))
    # A width of 0 would make every rate infinite; a scale of 0, NaN or below, no training.
    for settings, message in ((dict(d_model=0), "`d_model` must be a positive integer"),
                              (dict(warmup_steps=0), "`warmup_steps` must be a positive integer"),
                              (dict(scale=float("nan")), "`scale` must be a finite number > 0"),
                              (dict(scale=0.0), "`scale` must be a finite number > 0")):
        with pytest.raises(ValueError, match=message):
            kt.schedules.TransformerSchedule(**{"d_model": 512, **settings})


def test_paper_optimizer():
    opt = kt.schedules.transformer_optimizer(256, warmup_steps=100)
    assert (opt.beta_1, opt.beta_2, opt.epsilon) == (0.9, 0.98, 1e-9)
    schedule = opt.get_config()["learning_rate"]
    assert schedule["config"] == {"d_model": 256, "warmup_steps": 100, "scale": 1.0}


def _compiled_model():
    model = kt.models.Transformer(vocab_size=11, num_layers=1, d_model=8, num_heads=2, d_ff=16)
    model.compile(optimizer=kt.schedules.transformer_optimizer(8, 10), loss=kt.losses.LabelSmoothedCrossEntropy())
    model.build()
    return model


def _data():
    rng = np.random.default_rng(0)
    x = {"source_ids": rng.integers(4, 11, (16, 5)).astype("int32"), "target_ids": rng.integers(4, 11, (16, 5)).astype("int32")}
    return x, rng.integers(4, 11, (16, 5)).astype("int32")


@only_on("torch", "the average is NumPy over the checkpoint files; saving and restoring each backend's "
                  "state is test_training_state_restores_weights_optimizer_and_epoch, in every suite")
def test_checkpoint_averager_averages_the_last_k(tmp_path):
    model = _compiled_model()
    averager = kt_callbacks.CheckpointAverager(tmp_path, num_checkpoints=3)
    snapshots = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            snapshots.append([to_numpy(w) for w in self.model.weights])

    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=5, verbose=0, callbacks=[Record(), averager])
    assert [p.name for p in averager.checkpoints()] == [f"checkpoint_{i:06d}.npz" for i in (3, 4, 5)]
    for w, a, b, c in zip(model.weights, *snapshots[-3:]):
        np.testing.assert_allclose(to_numpy(w), (a + b + c) / 3, atol=1e-6)


@pytest.mark.parametrize("metric, best_epoch", [("bleu", 1), ("exact_match", 2), ("chrf", 2)])
def test_best_checkpoints_rank_epochs_by_the_chosen_score(tmp_path, metric, best_epoch):
    # Epoch 1: wrong translations of several words (some BLEU); epoch 2: nearly every
    # one-word reference exact (word BLEU 0, as sacreBLEU scores a one-word sentence).
    logs = [dict(val_bleu=12.0, val_chrf=30.0, val_exact_match=0.0),
            dict(val_bleu=0.0, val_chrf=95.0, val_exact_match=0.9)]
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    best = kt_callbacks.BestCheckpoints(tmp_path, metric=metric)
    best.set_model(model)
    for epoch, epoch_logs in enumerate(logs):
        best.on_epoch_end(epoch, epoch_logs)
    assert best.ranked()[0] == best_epoch
    assert [p.name for p in best.checkpoints()] == [f"checkpoint_{best_epoch:06d}.npz"]
    assert best.scores()[2][0] == logs[1][f"val_{metric}"]
    with pytest.raises(ValueError, match="`val_exact_match` in the logs"):
        kt_callbacks.BestCheckpoints(tmp_path / "x", metric="exact_match").on_epoch_end(0, {"val_bleu": 1.0})
    with pytest.raises(ValueError, match="`metric` must be one of"):
        kt_callbacks.BestCheckpoints(tmp_path / "y", metric="loss")


def test_training_state_restores_weights_optimizer_and_epoch(tmp_path):
    model = _compiled_model()
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[kt_callbacks.TrainingState(tmp_path)])
    assert not list(tmp_path.glob("*.tmp"))
    fresh = _compiled_model()
    assert kt_callbacks.TrainingState.restore(fresh, tmp_path) == 2
    assert int(to_numpy(fresh.optimizer.iterations)) == 4
    for a, b in zip(model.weights + model.optimizer.variables, fresh.weights + fresh.optimizer.variables):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b))


def _old_writer(variables):
    # The format before weights were named: arrays by position in `model.weights`.
    return {f"v{i:05d}": to_numpy(v) for i, v in enumerate(variables)}


def test_state_and_checkpoints_by_name_and_in_the_older_positional_format(tmp_path):
    model = _compiled_model()
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    names = kt_callbacks.weights_of(model)
    assert "embedding/embeddings" in names and "encoder/encoder_block_0/self_attention/query_dense/kernel" in names
    # A state written by the older release: model and optimizer variables by position.
    old = {f"model_{k}": v for k, v in _old_writer(model.weights).items()}
    old.update({f"optimizer_{k}": v for k, v in _old_writer(model.optimizer.variables).items()})
    np.savez(tmp_path / "state.npz", epochs_done=np.array(2), **old)
    fresh = _compiled_model()  # another Keras name ("transformer_1"): names are relative to the model
    assert kt_callbacks.TrainingState.restore(fresh, tmp_path) == 2
    for a, b in zip(model.weights + model.optimizer.variables, fresh.weights + fresh.optimizer.variables):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
    # A checkpoint of either format loads.
    np.savez(tmp_path / "old.npz", **_old_writer(model.weights))
    np.savez(tmp_path / "new.npz", **kt_callbacks.weights_of(model))
    for checkpoint in ("old.npz", "new.npz"):
        other = _compiled_model()
        assert kt_callbacks.average_checkpoints(other, [tmp_path / checkpoint]) == 1
        for a, b in zip(model.weights, other.weights):
            np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-6)
    # A named checkpoint that lacks a weight, or an old one of other shapes, is refused by name.
    renamed = dict(names)
    renamed["embedding/renamed"] = renamed.pop("embedding/embeddings")
    with pytest.raises(ValueError, match=r"no array for \['embedding/embeddings'\]"):
        kt_callbacks.set_weights(_compiled_model(), renamed)
    wider = kt.models.Transformer(vocab_size=11, num_layers=1, d_model=12, num_heads=2, d_ff=16)
    wider.build()
    with pytest.raises(ValueError, match=r"the array for .*embeddings has shape \(11, 8\), the weight \(11, 12\)"):
        kt_callbacks.set_weights(wider, _old_writer(model.weights))


def test_a_ctrl_c_that_keras_drops_still_stops_fit_at_the_next_batch():
    # Keras' `pythonify_logs` converts each batch's logs inside a bare `except:`; on JAX
    # the SIGINT lands there and its KeyboardInterrupt is dropped. Recreate that drop on
    # every backend: the signal arrives inside a callback that swallows everything.
    import os
    import signal

    class SwallowedCtrlC(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches = 0

        def on_train_batch_end(self, batch, logs=None):
            self.batches += 1
            if self.batches == 2:
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                    signal.sigtimedwait([], 0)  # give the handler its chance to run here
                except:  # noqa: E722 - what Keras does
                    pass

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.zeros((40, 3), "float32"), np.zeros((40, 1), "float32")
    swallow = SwallowedCtrlC()
    # The guard acts only where SIGINT has Python's default handler (a program's own handler
    # is left alone); start from it whatever an earlier test in this worker left.
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        guard = kt_callbacks.Interruptible()
        with pytest.raises(KeyboardInterrupt):
            with guard:
                model.fit(x, y, batch_size=4, epochs=3, callbacks=[guard, swallow], verbose=0)
        assert guard.interrupted
        # The guard raises it at the end of the next batch: batch 3 trained, batch 4 did not.
        assert int(to_numpy(model.optimizer.iterations)) == 3
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)


@pytest.mark.parametrize("stop_checks, stopped_after", [(1, 2), (2, 5), (3, None)])
def test_the_exact_match_target_can_be_asked_for_several_epochs_in_a_row(monkeypatch, stop_checks, stopped_after):
    from keras_transformer.tools import evaluation

    pairs = [("a", "A"), ("b", "B")]
    shares = iter([0.5, 1.0, 0.5, 1.0, 1.0, 0.5])  # the exact match of epochs 1-6

    def translate(model, tokenizer, texts, **kwargs):
        # The run's validation sentences are translated whole, never cut to the command
        # line's --max-input-length (a run may train on longer ones).
        assert kwargs["max_input_length"] is None
        return ["A", "B"] if next(shares) == 1.0 else ["A", "wrong"]

    monkeypatch.setattr(evaluation, "translate_texts", translate)
    scores = kt_callbacks.TranslationScores(None, pairs, stop_at_exact_match=1.0, stop_checks=stop_checks)
    model = keras.Model()
    scores.set_model(model)
    model.stop_training = False
    stops = []
    scores.on_train_begin()
    for epoch in range(6):
        logs = {}
        scores.on_epoch_end(epoch, logs)
        if model.stop_training:
            stops.append(epoch + 1)
            model.stop_training = False
    assert logs["val_exact_match"] == 0.5
    assert (stops[0] if stops else None) == stopped_after, stops
    # A new fit (a resumed run) counts from its own first epoch: two epochs at the target,
    # one in each fit, are not two in a row.
    shares = iter([1.0, 1.0])
    twice = kt_callbacks.TranslationScores(None, pairs, stop_at_exact_match=1.0, stop_checks=2)
    twice.set_model(model)
    for _ in range(2):
        twice.on_train_begin()
        twice.on_epoch_end(0, {})
    assert not model.stop_training
    with pytest.raises(ValueError, match="stop_checks"):
        kt_callbacks.TranslationScores(None, pairs, stop_at_exact_match=1.0, stop_checks=0)


@only_on("torch", "the reason is the callbacks' own record; `stop_training` ending `fit` is Keras' rule on "
                  "every backend")
@pytest.mark.parametrize("how, reason", [("request_stop", "the budget is spent"),
                                         ("stop_training", "a callback asked to stop"), (None, "")])
def test_the_reason_a_run_stopped_is_saved_when_it_is_decided(tmp_path, how, reason):
    class Stop(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0 and how == "request_stop":
                kt_callbacks.request_stop(self.model, "the budget is spent")
            elif epoch == 0 and how == "stop_training":
                self.model.stop_training = True

    model = _compiled_model()
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[Stop(), kt_callbacks.TrainingState(tmp_path)])
    assert kt_callbacks.TrainingState.stop_reason(tmp_path) == reason
    assert kt_callbacks.TrainingState.progress(tmp_path) == ((1, True) if how else (3, False))
