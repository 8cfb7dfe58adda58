import math

import keras
import numpy as np
import pytest

import keras_transformer as kt
from tests import reference as ref
from tests.conftest import ffn_weights, randomize_weights, to_numpy


def test_ffn_matches_reference_and_is_position_wise():
    ffn = kt.layers.PositionwiseFFN(d_ff=32)
    ffn.build((None, None, 8))
    randomize_weights(ffn)
    assert tuple(ffn.inner_dense.kernel.shape) == (8, 32)
    assert tuple(ffn.outer_dense.kernel.shape) == (32, 8)
    x = np.random.default_rng(0).normal(size=(2, 6, 8)).astype("float32")
    out = to_numpy(ffn(x))
    np.testing.assert_allclose(out, ref.feed_forward(x, *ffn_weights(ffn)), atol=1e-5)
    # Same weights at every position: permuting positions permutes outputs.
    perm = np.array([3, 0, 5, 1, 4, 2])
    np.testing.assert_allclose(to_numpy(ffn(x[:, perm])), out[:, perm], atol=1e-5)


def test_ffn_activation_is_configurable():
    ffn = kt.layers.PositionwiseFFN(d_ff=16, activation="gelu")
    x = np.random.default_rng(1).normal(size=(1, 3, 4)).astype("float32")
    out = to_numpy(ffn(x))
    w1, b1, w2, b2 = ffn_weights(ffn)
    h = x @ w1 + b1
    gelu = 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
    np.testing.assert_allclose(out, gelu @ w2 + b2, atol=1e-4)


@pytest.mark.parametrize("d_model, start", [(8, 0), (7, 3), (64, 100)])
def test_positional_encoding_matches_paper_formula(d_model, start):
    layer = kt.layers.SinusoidalPositionalEncoding()
    out = to_numpy(layer(np.zeros((2, 11, d_model), "float32"), start_index=start))
    expected = ref.positional_encoding(11, d_model, start)
    np.testing.assert_allclose(out[0], expected, atol=2e-5)
    np.testing.assert_allclose(out[1], expected, atol=2e-5)


def test_positional_encoding_relative_position_is_a_linear_map():
    """Section 3.5: for any fixed offset k, PE[pos + k] is a linear function of PE[pos].

    The map is block-diagonal: for each sin/cos pair it is the rotation by k * omega_i,
    the same matrix for every position.
    """
    d_model, k = 16, 5
    pe = to_numpy(kt.layers.SinusoidalPositionalEncoding()(np.zeros((1, 200, d_model), "float32")))[0]
    rotation = np.zeros((d_model, d_model))
    for i in range(d_model // 2):
        w = k / 10000 ** (2 * i / d_model)
        # [sin(p+k), cos(p+k)] = [sin p, cos p] @ [[cos, -sin], [sin, cos]]
        rotation[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = [[np.cos(w), -np.sin(w)], [np.sin(w), np.cos(w)]]
    np.testing.assert_allclose(pe[:195] @ rotation, pe[k : 195 + k], atol=1e-4)


def test_embedding_scales_adds_encoding_and_ties_logits():
    emb = kt.layers.SinusoidalEmbedding(vocab_size=12, d_model=8)
    ids = np.array([[4, 5, 11, 0], [1, 2, 3, 9]], "int32")
    out = to_numpy(emb(ids, start_index=2))
    E = to_numpy(emb.embeddings)
    np.testing.assert_allclose(out, ref.embed(ids, E, start=2), atol=1e-5)
    np.testing.assert_allclose(to_numpy(emb.logits(out)), out @ E.T, atol=1e-4)
    # Initialised so that E * sqrt(d_model) has about unit variance.
    big = kt.layers.SinusoidalEmbedding(vocab_size=2000, d_model=64)
    big.build()
    assert abs(np.std(to_numpy(big.embeddings)) * 8.0 - 1.0) < 0.05


def test_embedding_without_scale_and_dropout_in_training():
    emb = kt.layers.SinusoidalEmbedding(vocab_size=12, d_model=8, scale=False, dropout=0.5)
    ids = np.array([[4, 5, 6]], "int32")
    out = to_numpy(emb(ids))
    E = to_numpy(emb.embeddings)
    np.testing.assert_allclose(out, E[ids] + ref.positional_encoding(3, 8), atol=1e-5)
    dropped = to_numpy(emb(ids, training=True))
    assert np.isclose(dropped, 0).sum() > 0
    kept = ~np.isclose(dropped, 0)
    np.testing.assert_allclose(dropped[kept], 2 * out[kept], rtol=1e-5)


def test_embedding_rejects_float_and_out_of_range_ids():
    emb = kt.layers.SinusoidalEmbedding(vocab_size=10, d_model=4, name="tok")
    with pytest.raises(ValueError, match=r"Layer 'tok'.*integer.*float32"):
        emb(np.array([[1.0, 2.0]], "float32"))
    with pytest.raises(ValueError, match=r"Layer 'tok'.*\[0, 10\).*max=10"):
        emb(keras.ops.convert_to_tensor(np.array([[1, 10]], "int32")))
    with pytest.raises(ValueError, match=r"min=-2"):
        emb(np.array([[-2, 3]], "int32"))
