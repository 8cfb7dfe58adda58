"""`translate` runs the search compiled for the backend (`jax.jit`, XLA, or on PyTorch
recorded loop bodies replayed as TorchScript graphs): same tokens as the eager search,
and always with the weights of the moment. On PyTorch, `compile(jit_compile=True)`
records the training step once per batch shape and replays it."""

import keras
import numpy as np
import pytest

import keras_transformer as kt
from keras_transformer import _compat
from tests.conftest import BACKEND, randomize_weights, to_numpy

torch_only = pytest.mark.skipif(
    BACKEND != "torch",
    reason="recording and replaying is the PyTorch path; JAX and TensorFlow compile the whole search and "
    "their jit_compile=True is Keras' own XLA step",
)
V = 11


def _model(seed):
    model = kt.models.Transformer(vocab_size=V, num_layers=2, d_model=16, num_heads=2, d_ff=32, dropout=0.0)
    model.build()
    randomize_weights(model, seed, scale=0.6)
    return model


SOURCE = np.array([[4, 5, 6, 7, 1], [6, 6, 4, 0, 0], [9, 10, 0, 0, 0]], "int32")


@pytest.mark.parametrize("beam_size", [1, 3])
def test_compiled_search_gives_the_eager_search_tokens(beam_size):
    model = _model(0)
    compiled, compiled_scores = model.translate(SOURCE, beam_size, max_length=7, return_scores=True)
    eager, eager_scores = model.search(SOURCE, 7, beam_size=beam_size)  # no compilation, no recording
    np.testing.assert_array_equal(to_numpy(compiled, "int32"), to_numpy(eager, "int32"))
    np.testing.assert_allclose(to_numpy(compiled_scores), to_numpy(eager_scores), atol=1e-5)
    # A second input of the same shape reuses the compiled search and still follows its input.
    other = SOURCE[::-1].copy()
    np.testing.assert_array_equal(
        to_numpy(model.translate(other, beam_size, max_length=7), "int32"),
        to_numpy(model.search(other, 7, beam_size=beam_size)[0], "int32"),
    )


def test_compiled_search_uses_weights_set_after_compilation():
    model, other = _model(0), _model(1)
    before = to_numpy(model.translate(SOURCE, 2, max_length=7), "int32")
    expected = to_numpy(other.translate(SOURCE, 2, max_length=7), "int32")
    assert not np.array_equal(before, expected)  # the two models differ, so the check can fail
    model.set_weights(other.get_weights())
    np.testing.assert_array_equal(to_numpy(model.translate(SOURCE, 2, max_length=7), "int32"), expected)


@torch_only
def test_fx_record_and_torchscript_replay_agree(monkeypatch):
    model = _model(2)
    scripted = to_numpy(model.translate(SOURCE, 3, max_length=7), "int32")
    monkeypatch.setattr(_compat._Recorder, "use_torchscript", False)
    model = _model(2)
    np.testing.assert_array_equal(to_numpy(model.translate(SOURCE, 3, max_length=7), "int32"), scripted)


@torch_only
def test_recording_keeps_arguments_that_are_one_tensor_apart():
    import torch

    recorder = _compat._Recorder([])
    replay = recorder.replayable(lambda a, b: (a * 2 + b,))
    x, y = torch.ones(3), torch.arange(3.0)
    with recorder:
        first = replay(x, x)  # recorded with one tensor in both places
        second = replay(x, y)  # replayed: b is y, not a second x
    np.testing.assert_allclose(first[0].numpy(), [3.0, 3.0, 3.0])
    np.testing.assert_allclose(second[0].numpy(), [2.0, 3.0, 4.0])
    assert len(recorder.records) == 1


@torch_only
def test_recording_refuses_a_function_that_branches_on_a_tensor_value():
    import torch

    recorder = _compat._Recorder([])
    replay = recorder.replayable(lambda a: a + 1 if bool(keras.ops.all(a > 0)) else a - 1)
    with recorder, pytest.raises(RuntimeError, match="data-dependent"):
        replay(torch.ones(2))


@torch_only
def test_static_arguments_are_part_of_the_signature():
    import torch

    recorder = _compat._Recorder([])
    replay = recorder.replayable(lambda a, n: a * n)
    with recorder:
        np.testing.assert_allclose(replay(torch.ones(2), 2)[0].item(), 2.0)
        np.testing.assert_allclose(replay(torch.ones(2), 5)[0].item(), 5.0)
    assert len(recorder.records) == 2


@torch_only
def test_a_recorded_loop_runs_body_and_condition_as_one_graph():
    import torch

    def cond(i, total, cache):
        return keras.ops.logical_and(i < 6, total < 20.0)

    def body(i, total, cache):
        cache = _compat.update_along(cache, i, keras.ops.reshape(total, (1,)), axis=0)
        return i + 1, total + keras.ops.cast(i, "float32") * 3.0, cache

    def start():
        return (torch.tensor(0, dtype=torch.int32), torch.tensor(1.0), torch.zeros(6))

    expected = keras.ops.while_loop(cond, body, start())  # eager, one op at a time
    recorder = _compat._Recorder([])
    with recorder:
        got = _compat.while_loop(cond, body, start())
        again = _compat.while_loop(cond, body, start())
    for a, b, c in zip(expected, got, again):
        np.testing.assert_allclose(a.numpy(), b.numpy())
        np.testing.assert_allclose(a.numpy(), c.numpy())
    assert int(got[0]) == 5  # stopped by `total`, not by `i`: the condition was replayed
    assert len(recorder.records) == 1  # one record (body then condition), reused


@torch_only
def test_two_loops_of_one_signature_keep_their_own_records():
    import torch

    def cond(i, x):
        return i < 3

    def double(i, x):
        return i + 1, x * 2.0

    def increment(i, x):
        return i + 1, x + 1.0

    recorder = _compat._Recorder([])
    with recorder:
        doubled = _compat.while_loop(cond, double, (torch.tensor(0), torch.ones(2)))[1]
        incremented = _compat.while_loop(cond, increment, (torch.tensor(0), torch.ones(2)))[1]
    np.testing.assert_allclose(doubled.numpy(), [8.0, 8.0])
    np.testing.assert_allclose(incremented.numpy(), [4.0, 4.0])
    assert len(recorder.records) == 2


@torch_only
def test_a_recorded_loop_writes_in_place_into_its_own_copies_only():
    import torch

    def cond(i, cache):
        return i < 4

    def body(i, cache):
        return i + 1, _compat.update_along(cache, i, keras.ops.ones((3, 1)) * keras.ops.cast(i + 1, "float32"), axis=1)

    shared = torch.zeros(1, 4)
    start = (torch.tensor(0), shared.expand(3, 4))  # a broadcast view: one memory location per column
    with _compat._Recorder([]):
        _, cache = _compat.while_loop(cond, body, start)
    np.testing.assert_allclose(cache.numpy(), np.tile([[1.0, 2.0, 3.0, 4.0]], (3, 1)))
    np.testing.assert_allclose(shared.numpy(), np.zeros((1, 4)))  # the caller's tensor is untouched


@torch_only
def test_a_recorded_loop_whose_body_changes_shapes_runs_step_by_step():
    import torch

    def cond(i, x):
        return i < 3

    def body(i, x):
        return i + 1, keras.ops.concatenate([x, x[:1]], axis=0)

    with _compat._Recorder([]):
        i, x = _compat.while_loop(cond, body, (torch.tensor(0), torch.ones(2)))
    assert int(i) == 3 and tuple(x.shape) == (5,)


def _bucketed_batches():
    # Three batch signatures, as token-budget bucketing makes them, then the first again.
    rng = np.random.default_rng(3)
    batches = []
    for batch, source_length, target_length in [(6, 5, 7), (3, 9, 10), (12, 4, 5), (6, 5, 7)]:
        x = {
            "source_ids": rng.integers(4, V, (batch, source_length)).astype("int32"),
            "target_ids": rng.integers(4, V, (batch, target_length)).astype("int32"),
        }
        batches.append((x, rng.integers(4, V, (batch, target_length)).astype("int32")))
    return batches


def _compiled(jit_compile, dropout=0.0):
    keras.utils.set_random_seed(0)
    model = kt.models.Transformer(vocab_size=V, num_layers=2, d_model=16, num_heads=2, d_ff=32, dropout=dropout)
    model.build()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2), loss=kt.losses.LabelSmoothedCrossEntropy(0.1),
        metrics=[kt.metrics.MaskedAccuracy()], jit_compile=jit_compile,
    )
    return model


@torch_only
def test_jit_compile_trains_over_several_batch_shapes_like_the_eager_step_and_decodes():
    batches = _bucketed_batches()
    eager, compiled = _compiled(False), _compiled(True)
    assert compiled.jit_compile is True
    for x, y in batches:
        expected = eager.train_on_batch(x, y, return_dict=True)
        got = compiled.train_on_batch(x, y, return_dict=True)
        np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-4)
        np.testing.assert_allclose(got["accuracy"], expected["accuracy"], rtol=1e-4)
    for a, b in zip(eager.get_weights(), compiled.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-5)
    # Recorded once per signature: three, and the fourth batch replayed the first.
    assert len(compiled._recorded_train_step.records) == 3
    np.testing.assert_array_equal(
        to_numpy(compiled.translate(SOURCE, 2, max_length=6), "int32"),
        to_numpy(eager.translate(SOURCE, 2, max_length=6), "int32"),
    )


@torch_only
def test_jit_compile_with_dropout_learns_and_draws_new_masks():
    import torch

    x, _ = _bucketed_batches()[0]
    y = x["target_ids"]  # learnable: each position may attend to itself
    model = _compiled(True, dropout=0.3)
    losses = [model.train_on_batch(x, y, return_dict=True)["loss"] for _ in range(40)]
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])
    # The same weights and batch give different losses: dropout is drawn anew at every replay.
    graph, _ = next(iter(model._recorded_train_step.records._functions.values()))
    values = [v.value for v in model.trainable_variables] + [
        v.value for v in model.non_trainable_variables + list(model.optimizer.variables)
    ]
    inputs = [keras.ops.convert_to_tensor(t) for t in (x["source_ids"], x["target_ids"], y)]
    with torch.no_grad():
        first, second = (float(graph(*values, *inputs)[0]) for _ in range(2))
    assert first != second


@torch_only
def test_a_recorded_training_step_refuses_a_model_that_updates_non_trainable_variables():
    model = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"jit_compile=True.*non-trainable variables.*moving_mean"):
        _compat.TrainStep(model)((np.ones((4, 3), "float32"), np.ones((4, 1), "float32")))
