"""The same checks for every public layer: config round trip, Functional use,
`.keras` save/load, a `model.fit` step, and mixed precision."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import keras
import numpy as np
import pytest

import keras_transformer as kt
from tests.conftest import to_numpy

D = 8


@dataclasses.dataclass
class Spec:
    name: str
    make: Callable[..., keras.layers.Layer]
    inputs: list  # (shape without batch, dtype)
    call: Callable = lambda layer, *xs: layer(*xs)
    # The output shape the layer declares for `call`, from the input shapes; the plain
    # call's is `compute_output_shape`.
    shape: Callable = lambda layer, *shapes: layer.compute_output_shape(*shapes)

    def arrays(self, batch=2, seed=0):
        rng = np.random.default_rng(seed)
        out = []
        for shape, dtype in self.inputs:
            if dtype == "int32":
                out.append(rng.integers(1, 20, size=(batch,) + shape).astype("int32"))
            else:
                out.append(rng.normal(size=(batch,) + shape).astype("float32"))
        return out


SPECS = [
    Spec("mha", lambda **kw: kt.layers.MultiHeadAttention(2, **kw), [((5, D), "float32"), ((6, D), "float32")]),
    Spec("mha_causal", lambda **kw: kt.layers.MultiHeadAttention(2, **kw), [((5, D), "float32")],
         lambda layer, x: layer(x, x, use_causal_mask=True),
         lambda layer, x: layer.compute_output_shape(x, x)),
    Spec("ffn", lambda **kw: kt.layers.PositionwiseFFN(16, **kw), [((5, D), "float32")]),
    Spec("positional_encoding", lambda **kw: kt.layers.SinusoidalPositionalEncoding(**kw), [((5, D), "float32")]),
    Spec("embedding", lambda **kw: kt.layers.SinusoidalEmbedding(20, D, **kw), [((5,), "int32")]),
    Spec("embedding_logits", lambda **kw: kt.layers.SinusoidalEmbedding(20, D, **kw), [((5,), "int32")],
         lambda layer, ids: layer(layer(ids), reverse=True),
         lambda layer, ids: layer.compute_output_spec(keras.KerasTensor(tuple(ids) + (D,)), reverse=True).shape),
    Spec("encoder_block", lambda **kw: kt.layers.EncoderBlock(2, 16, **kw), [((5, D), "float32")]),
    Spec("decoder_block", lambda **kw: kt.layers.DecoderBlock(2, 16, **kw), [((4, D), "float32"), ((6, D), "float32")]),
    Spec("encoder", lambda **kw: kt.layers.Encoder(2, 2, 16, norm_first=True, **kw), [((5, D), "float32")]),
    Spec("decoder", lambda **kw: kt.layers.Decoder(2, 2, 16, **kw), [((4, D), "float32"), ((6, D), "float32")]),
]
IDS = [s.name for s in SPECS]


def functional(spec, layer):
    inputs = [keras.Input(shape, dtype=dtype) for shape, dtype in spec.inputs]
    return keras.Model(inputs, spec.call(layer, *inputs))


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_config_round_trip(spec):
    layer = spec.make(name="under_test")
    xs = spec.arrays()
    expected = to_numpy(spec.call(layer, *xs))
    config = layer.get_config()
    clone = layer.__class__.from_config(config)
    assert clone.get_config() == config
    spec.call(clone, *xs)  # build
    clone.set_weights(layer.get_weights())
    np.testing.assert_allclose(to_numpy(spec.call(clone, *xs)), expected, atol=1e-6)
    # Registered for serialization: serialize/deserialize finds the class by name.
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(restored) is type(layer)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_functional_model_and_keras_file(spec, tmp_path):
    layer = spec.make()
    model = functional(spec, layer)
    xs = spec.arrays(batch=3)
    out = to_numpy(model(xs))
    symbolic = model.outputs[0]
    assert tuple(symbolic.shape)[1:] == out.shape[1:]
    np.testing.assert_allclose(out, to_numpy(spec.call(layer, *xs)), atol=1e-6)
    path = tmp_path / f"{spec.name}.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(to_numpy(loaded(xs)), out, atol=1e-6)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_compute_output_shape(spec):
    layer = spec.make()
    xs = spec.arrays()
    out = spec.call(layer, *xs)
    assert tuple(spec.shape(layer, *[x.shape for x in xs])) == tuple(out.shape)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_fit_step_updates_weights(spec):
    layer = spec.make()
    model = functional(spec, layer)
    head = keras.layers.Dense(1)
    trainable = keras.Model(model.inputs, head(model.outputs[0]))
    trainable.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    xs = spec.arrays(batch=8)
    y = np.ones((8,) + tuple(trainable.outputs[0].shape[1:]), "float32")
    before = [to_numpy(w) for w in layer.trainable_weights]
    history = trainable.fit(xs, y, batch_size=4, epochs=2, verbose=0)
    losses = history.history["loss"]
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0]
    changed = [not np.allclose(b, to_numpy(w)) for b, w in zip(before, layer.trainable_weights)]
    assert all(changed), [w.path for w, c in zip(layer.trainable_weights, changed) if not c]


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_mixed_precision(spec, policy):
    full = spec.make()
    xs = spec.arrays()
    expected = to_numpy(spec.call(full, *xs))
    mixed = spec.make(dtype=policy)
    spec.call(mixed, *xs)
    mixed.set_weights(full.get_weights())
    for w in mixed.weights:
        assert keras.backend.standardize_dtype(w.dtype) == "float32"  # variables stay float32
    out = spec.call(mixed, *xs)
    assert keras.backend.standardize_dtype(out.dtype) == policy.split("_")[1]
    out = to_numpy(out)
    assert np.isfinite(out).all()
    tolerance = 0.1 if policy == "mixed_bfloat16" else 0.02
    np.testing.assert_allclose(out, expected, atol=tolerance * max(1.0, np.abs(expected).max()))


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_keras_masks_are_read_as_padding_and_passed_on(spec):
    """Inputs with a Keras mask (`keras.layers.Masking`, `mask_zero=True` ids) in a Functional
    model: the padded positions change nothing at the others, and the output carries the
    mask on (a masked pooling after the layer averages the real positions only)."""
    ids = spec.inputs[0][1] == "int32"
    layer = spec.make(mask_zero=True) if ids else spec.make()
    xs = spec.arrays(batch=2)
    keep = [x.shape[1] - 2 for x in xs]  # row 0's last two positions are padding, in every input
    for x, n in zip(xs, keep):
        x[0, n:] = 0
    inputs = [keras.Input(shape, dtype=dtype) for shape, dtype in spec.inputs]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = spec.call(layer, *(inputs if ids else [keras.layers.Masking(0.0)(x) for x in inputs]))
        model = keras.Model(inputs, [out, keras.layers.GlobalAveragePooling1D()(out)])
        got, pooled = (to_numpy(t) for t in model(xs))
    # Keras' "this layer does not support masking and will therefore destroy the mask".
    assert not [w for w in caught if "support masking" in str(w.message)], [str(w.message) for w in caught]
    alone = to_numpy(spec.call(layer, *[x[:1, :n] for x, n in zip(xs, keep)]))[0]  # row 0 without its padding
    np.testing.assert_allclose(got[0, :keep[0]], alone, atol=1e-5)
    np.testing.assert_allclose(pooled[0], alone.mean(axis=0), atol=1e-5)


@pytest.mark.parametrize("stack", [True, False], ids=["stack", "block"])
def test_the_keras_mask_arguments_stand_in_for_padding_masks_not_given(stack):
    """Keras passes a lone tensor's mask as `mask`, and with several tensors each one's as
    `<argument>_mask`; here given by hand, on tensors that carry none. Left padding, which
    causality does not hide."""
    rng = np.random.default_rng(0)
    x, memory = rng.normal(size=(2, 5, D)).astype("float32"), rng.normal(size=(2, 6, D)).astype("float32")
    real, real_memory = np.arange(5) >= np.array([[2], [0]]), np.arange(6) < np.array([[4], [6]])
    encoder = kt.layers.Encoder(1, 2, 16) if stack else kt.layers.EncoderBlock(2, 16)
    decoder, lm = ((kt.layers.Decoder(1, 2, 16), kt.layers.Decoder(1, 2, 16)) if stack
                   else (kt.layers.DecoderBlock(2, 16), kt.layers.DecoderBlock(2, 16)))
    pairs = [(encoder(x, mask=real), encoder(x, padding_mask=real)),
             (decoder(x, memory, decoder_sequence_mask=real, encoder_sequence_mask=real_memory),
              decoder(x, memory, decoder_padding_mask=real, encoder_padding_mask=real_memory)),
             (lm(x, mask=real), lm(x, decoder_padding_mask=real))]
    for by_keras, explicit in pairs:
        np.testing.assert_allclose(to_numpy(by_keras), to_numpy(explicit), atol=1e-6)
    unmasked = to_numpy(lm(x))
    assert not np.allclose(to_numpy(pairs[2][0])[0, 2:], unmasked[0, 2:], atol=1e-3)  # the mask changed something
    # A padding mask given as an argument takes precedence.
    np.testing.assert_allclose(to_numpy(lm(x, decoder_padding_mask=np.ones((2, 5), bool), mask=real)), unmasked,
                               atol=1e-6)


def test_every_public_layer_has_a_spec_in_this_harness():
    # A new layer in `kt.layers` must come with a spec above: this is what checks it.
    public = {name for name in kt.layers.__all__ if isinstance(getattr(kt.layers, name), type)
              and issubclass(getattr(kt.layers, name), keras.layers.Layer)}
    covered = {type(spec.make()).__name__ for spec in SPECS}
    assert public and public <= covered, sorted(public - covered)
