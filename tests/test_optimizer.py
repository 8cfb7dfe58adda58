"""`keras_transformer.optimizers.Adam`: Keras' Adam, updated by PyTorch's fused Adam on
PyTorch with the same results; the paper's schedule counts updates under accumulation."""

import warnings

import keras
import numpy as np
import pytest

import keras_transformer as kt
from tests.conftest import BACKEND, to_numpy

torch_only = pytest.mark.skipif(
    BACKEND != "torch",
    reason="on TensorFlow and JAX kt.optimizers.Adam updates with Keras' own Adam: there is nothing to compare",
)


def _updated(optimizer, steps=10):
    """`steps` updates by `optimizer` of three variables; returns the variables."""
    rng = np.random.default_rng(0)
    variables = [keras.Variable(rng.normal(size=shape).astype("float32")) for shape in ((4, 3), (5,), (2, 3, 2))]
    optimizer.build(variables)
    for step in range(steps):
        # Gradients of very different sizes, as in a real model.
        grads = [rng.normal(size=v.shape).astype("float32") * 10.0 ** -(step % 4) for v in variables]
        optimizer.apply([keras.ops.convert_to_tensor(g) for g in grads], variables)
    return variables


def _apply(optimizer, steps=10):
    variables = _updated(optimizer, steps)
    return [to_numpy(v) for v in variables] + [to_numpy(v) for v in optimizer.variables]


@torch_only
def test_the_pytorch_update_runs_in_torch_optim_adam(monkeypatch):
    # Fails if Keras stops calling the hook (`_backend_update_step`) or renames Adam's slots.
    import torch.optim.adam as torch_adam

    calls = []
    real = torch_adam.adam
    monkeypatch.setattr(torch_adam, "adam", lambda *a, **k: calls.append(k) or real(*a, **k))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _updated(kt.schedules.transformer_optimizer(16, warmup_steps=4), steps=3)
    assert len(calls) == 3
    # The step count and the rate read as floats, not through NumPy (which warned).
    assert [str(w.message) for w in caught] == []
    assert calls[0]["fused"] is True  # CPU float32: PyTorch's fused kernel


@torch_only
def test_fused_adam_matches_keras_adam_over_ten_steps():
    schedule = kt.schedules.TransformerSchedule(16, warmup_steps=4)
    ours = _apply(kt.schedules.transformer_optimizer(16, warmup_steps=4))
    reference = _apply(keras.optimizers.Adam(schedule, beta_1=0.9, beta_2=0.98, epsilon=1e-9))
    assert len(ours) == len(reference)
    for a, b in zip(ours, reference):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)


def _train(optimizer):
    keras.utils.set_random_seed(3)
    model = kt.models.Transformer(vocab_size=30, num_layers=1, d_model=16, num_heads=2, d_ff=32, dropout=0.0)
    model.compile(optimizer=optimizer, loss=kt.losses.LabelSmoothedCrossEntropy())
    rng = np.random.default_rng(0)
    source = rng.integers(4, 30, size=(16, 7)).astype("int32")
    batch = {"source_ids": source, "target_ids": np.concatenate([np.full((16, 1), 2, "int32"), source[:, :-1]], 1)}
    model.fit(batch, source, batch_size=8, epochs=5, verbose=0, shuffle=False)
    return model, batch


@torch_only
def test_a_model_trains_the_same_with_either_adam():
    ours, batch = _train(kt.schedules.transformer_optimizer(16, warmup_steps=50))
    schedule = kt.schedules.TransformerSchedule(16, warmup_steps=50)
    reference, _ = _train(keras.optimizers.Adam(schedule, beta_1=0.9, beta_2=0.98, epsilon=1e-9))
    assert int(to_numpy(ours.optimizer.iterations)) == 10
    np.testing.assert_allclose(to_numpy(ours(batch)), to_numpy(reference(batch)), atol=1e-5)
    for a, b in zip(ours.trainable_weights, reference.trainable_weights):
        if a.path.endswith("key_dense/bias"):
            # Softmax ignores a shift shared by all keys, so these gradients are zero up to
            # rounding, which Adam scales to full-size steps: equal only where rounding is.
            continue
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), atol=1e-5, err_msg=a.path)


def test_the_optimizer_round_trips_through_its_config():
    optimizer = kt.schedules.transformer_optimizer(64, warmup_steps=10)
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert type(restored) is type(optimizer)
    assert restored.get_config() == optimizer.get_config()


def test_accumulated_batches_make_the_update_of_one_batch_that_holds_them_all():
    # N steps of a batch with gradient accumulation = one step of the N-times batch:
    # the loss is a mean over tokens, and the N copies hold the same number of tokens.
    n = 3
    keras.utils.set_random_seed(5)
    rng = np.random.default_rng(1)
    source = rng.integers(4, 30, size=(4, 6)).astype("int32")
    x = {"source_ids": source, "target_ids": np.concatenate([np.full((4, 1), 2, "int32"), source[:, :-1]], 1)}
    big = {k: np.concatenate([v] * n) for k, v in x.items()}
    models = []
    for accumulation in (n, None):
        model = kt.models.Transformer(vocab_size=30, num_layers=1, d_model=16, num_heads=2, d_ff=32, dropout=0.0)
        model.build()
        if models:
            model.set_weights(models[0].get_weights())
        model.compile(optimizer=kt.schedules.transformer_optimizer(16, warmup_steps=4,
                                                                   gradient_accumulation_steps=accumulation),
                      loss=kt.losses.LabelSmoothedCrossEntropy())
        models.append(model)
    accumulating, whole = models
    initial = [to_numpy(w) for w in accumulating.trainable_weights]
    for update in range(2):
        for micro in range(n):
            accumulating.train_on_batch(x, source)
            if update == 0 and micro < n - 1:  # nothing is applied before the N-th batch
                for w, w0 in zip(accumulating.trainable_weights, initial):
                    np.testing.assert_array_equal(to_numpy(w), w0)
        whole.train_on_batch(big, np.concatenate([source] * n))
        assert int(to_numpy(accumulating.optimizer.iterations)) == int(to_numpy(whole.optimizer.iterations)) == update + 1
        for a, b in zip(accumulating.trainable_weights, whole.trainable_weights):
            if a.path.endswith("key_dense/bias"):
                continue  # zero gradients up to rounding, scaled to full steps by Adam (see above)
            np.testing.assert_allclose(to_numpy(a), to_numpy(b), atol=1e-5, err_msg=a.path)
