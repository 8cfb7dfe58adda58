"""Restricted self-attention (paper, Table 1): block-wise, equal to full attention under
the band mask, with padding, causal masking, a cache, and model.fit."""

import keras
import numpy as np
import pytest

import keras_transformer as kt
from tests.conftest import randomize_weights, to_numpy


@pytest.mark.parametrize("length, window", [(10, 3), (7, 1), (16, 4), (5, 9)])
@pytest.mark.parametrize("causal", [False, True])
def test_windowed_equals_full_attention_under_band_mask(length, window, causal):
    rng = np.random.default_rng(length * window)
    q, k, v = (rng.normal(size=(2, length, 3, 4)).astype("float32") for _ in range(3))
    key_mask = np.ones((2, length), bool)
    key_mask[1, length - 2 :] = False
    band = to_numpy(kt.ops.band_mask(length, length, window, causal=causal)).astype(bool)
    mask = band[None, None] & key_mask[:, None, None, :]
    expected = to_numpy(kt.ops.scaled_dot_product_attention(q, k, v, mask=mask))
    result = to_numpy(kt.ops.windowed_attention(q, k, v, window, key_mask=key_mask, causal=causal))
    # A query whose allowed keys are all padding gets a finite, meaningless mean in both
    # paths (over different sets of keys); compare the queries that have a key.
    has_key = mask[:, 0].any(-1)  # (B, T)
    assert has_key.sum() >= length
    np.testing.assert_allclose(result[has_key], expected[has_key], atol=1e-5)


def _largest_intermediate(fn, *args):
    """The most elements of any tensor `fn` forms, called symbolically on `args`: every
    op's output is a `keras.KerasTensor`, whose shapes are recorded as they are made."""
    shapes = []
    made = keras.KerasTensor.__init__

    def record(self, shape, *rest, **kwargs):
        shapes.append(tuple(shape))
        made(self, shape, *rest, **kwargs)

    keras.KerasTensor.__init__ = record
    try:
        fn(*args)
    finally:
        keras.KerasTensor.__init__ = made
    return max(int(np.prod(s)) for s in shapes)


def test_no_quadratic_tensor_is_formed():
    """The largest intermediates are the scores (B, h, n/r, r, 3r) = 3 n r per head and the
    key windows (B, n/r, 3r, h, d_k) = 3 n d_k per head: linear in n, never n^2."""
    n, r, h, d_k = 64, 4, 2, 8
    x = keras.KerasTensor((1, n, h, d_k))
    windowed = _largest_intermediate(lambda: kt.ops.windowed_attention(x, x, x, window=r))
    assert windowed <= h * n * 3 * max(r, d_k) < h * n * n, windowed
    # The same count sees the n x n weights of full attention (asked for, so formed): it could fail.
    full = _largest_intermediate(lambda: kt.ops.scaled_dot_product_attention(x, x, x, return_attention_scores=True))
    assert full >= h * n * n, full


def test_layer_and_blocks_with_window_match_band_masked_full_attention():
    full = kt.layers.MultiHeadAttention(2)
    restricted = kt.layers.MultiHeadAttention(2, window=2)
    x = np.random.default_rng(0).normal(size=(2, 9, 8)).astype("float32")
    full(x, x)
    restricted(x, x)
    randomize_weights(full)
    restricted.set_weights(full.get_weights())
    pad = np.ones((2, 9), bool)
    pad[0, 7:] = False
    band = to_numpy(kt.ops.band_mask(9, 9, 2)).astype(bool)
    expected = to_numpy(full(x, x, attention_mask=np.broadcast_to(band, (2, 9, 9)), value_mask=pad))
    np.testing.assert_allclose(to_numpy(restricted(x, x, value_mask=pad)), expected, atol=1e-5)
    # EncoderBlock and (causal) DecoderBlock pass the window to self-attention only.
    encoder = kt.layers.EncoderBlock(2, 16, window=3)
    decoder = kt.layers.DecoderBlock(2, 16, window=3)
    encoder(x)
    decoder(x, x)
    assert encoder.self_attention.window == 3 and decoder.self_attention.window == 3
    assert decoder.cross_attention.window is None


def test_cached_decoding_with_window_equals_full_pass():
    block = kt.layers.DecoderBlock(2, 16, window=2)
    rng = np.random.default_rng(1)
    y, x = rng.normal(size=(1, 7, 8)).astype("float32"), rng.normal(size=(1, 5, 8)).astype("float32")
    full = to_numpy(block(y, x))
    cache = block.init_cache(1, 7, x)
    steps = []
    for i in range(7):
        out, cache = block(y[:, i : i + 1], None, cache=cache, cache_index=i)
        steps.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=1e-5)


def test_fit_and_serialization_with_window(tmp_path):
    ids = keras.Input((None,), dtype="int32")
    h = kt.layers.SinusoidalEmbedding(20, 16)(ids)
    h = kt.layers.Encoder(2, 2, 32, window=2)(h)
    model = keras.Model(ids, keras.layers.Dense(1)(h))
    model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(0).integers(1, 20, (16, 12)).astype("int32")
    history = model.fit(x, np.ones((16, 12, 1), "float32"), epochs=3, batch_size=8, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(to_numpy(loaded(x)), to_numpy(model(x)), atol=1e-5)


@pytest.mark.parametrize("window", [0, -1, 2.5, "3", True, 2**31])
def test_bad_window_is_refused(window):
    with pytest.raises(ValueError, match="window"):
        kt.layers.MultiHeadAttention(2, window=window)
    with pytest.raises(ValueError, match="window"):
        kt.layers.EncoderBlock(2, 16, window=window)
    with pytest.raises(ValueError, match="window"):
        kt.ops.windowed_attention(np.zeros((1, 4, 1, 2), "float32"), np.zeros((1, 4, 1, 2), "float32"),
                                  np.zeros((1, 4, 1, 2), "float32"), window=window)


def test_window_on_cross_attention_is_refused():
    layer = kt.layers.MultiHeadAttention(2, window=2, name="restricted")
    y, x = np.zeros((1, 3, 8), "float32"), np.zeros((1, 5, 8), "float32")
    with pytest.raises(ValueError, match=r"Layer 'restricted'.*cross-attention"):
        layer(y, x)
    with pytest.raises(ValueError, match="return_attention_scores"):
        layer(x, x, return_attention_scores=True)
