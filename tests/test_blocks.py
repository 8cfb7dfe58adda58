import numpy as np
import pytest
import keras

import keras_transformer as kt
from tests import reference as ref
from tests.conftest import block_weights, norm_weights, randomize_weights, to_numpy


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, 6, 8)).astype("float32")
    y = rng.normal(size=(2, 5, 8)).astype("float32")
    src_mask = np.array([[1] * 6, [1, 1, 1, 1, 0, 0]], bool)
    tgt_mask = np.array([[1] * 5, [1, 1, 1, 0, 0]], bool)
    return x, y, src_mask, tgt_mask


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_block_matches_reference(norm_first):
    block = kt.layers.EncoderBlock(num_heads=2, d_ff=16, dropout=0.1, norm_first=norm_first)
    block.build((None, None, 8))
    randomize_weights(block)
    x, _, src_mask, _ = _inputs()
    out = to_numpy(block(x, padding_mask=src_mask))
    expected = ref.encoder_block(x, block_weights(block), 2, src_mask, norm_first)
    np.testing.assert_allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_block_matches_reference(norm_first):
    block = kt.layers.DecoderBlock(num_heads=2, d_ff=16, norm_first=norm_first)
    block.build((None, None, 8), (None, None, 8))
    randomize_weights(block)
    x, y, src_mask, tgt_mask = _inputs(1)
    out = to_numpy(block(y, x, decoder_padding_mask=tgt_mask, encoder_padding_mask=src_mask))
    expected = ref.decoder_block(y, x, block_weights(block), 2, tgt_mask, src_mask, norm_first)
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_residual_dropout_is_active_only_in_training():
    block = kt.layers.EncoderBlock(num_heads=2, d_ff=16, dropout=0.5)
    x, *_ = _inputs(2)
    a, b = to_numpy(block(x)), to_numpy(block(x, training=False))
    np.testing.assert_allclose(a, b)
    assert not np.allclose(to_numpy(block(x, training=True)), a, atol=1e-3)


def test_decoder_only_block_has_no_cross_attention():
    block = kt.layers.DecoderBlock(num_heads=2, d_ff=16)
    _, y, _, _ = _inputs(3)
    out = to_numpy(block(y))
    assert block.cross_attention is None
    assert not any("cross_attention" in w.path for w in block.weights)
    np.testing.assert_allclose(out, ref.decoder_block(y, None, block_weights(block), 2), atol=1e-5)
    with pytest.raises(ValueError, match="no cross-attention"):
        block(y, y)


def test_decoder_block_cache_equals_full_pass():
    block = kt.layers.DecoderBlock(num_heads=2, d_ff=16)
    block.build((None, None, 8), (None, None, 8))
    randomize_weights(block, scale=0.3)
    x, y, src_mask, _ = _inputs(4)
    full = to_numpy(block(y, x, encoder_padding_mask=src_mask))
    cache = block.init_cache(2, 7, x)
    assert sorted(cache) == ["cross_attention", "self_attention"]
    steps = []
    for i in range(5):
        out, cache = block(y[:, i : i + 1], None, encoder_padding_mask=src_mask, cache=cache, cache_index=i)
        steps.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_stacks_match_reference(norm_first):
    encoder = kt.layers.Encoder(num_layers=2, num_heads=2, d_ff=16, norm_first=norm_first)
    decoder = kt.layers.Decoder(num_layers=2, num_heads=2, d_ff=16, norm_first=norm_first)
    encoder.build((None, None, 8))
    decoder.build((None, None, 8), (None, None, 8))
    randomize_weights(encoder, 1, scale=0.3)
    randomize_weights(decoder, 2, scale=0.3)
    assert (encoder.final_norm is not None) == norm_first
    x, y, src_mask, tgt_mask = _inputs(5)
    enc = to_numpy(encoder(x, padding_mask=src_mask))
    expected = x.astype("float64")
    for block in encoder.blocks:
        expected = ref.encoder_block(expected, block_weights(block), 2, src_mask, norm_first)
    if norm_first:
        expected = ref.layer_norm(expected, *norm_weights(encoder.final_norm), 1e-6)
    np.testing.assert_allclose(enc, expected, atol=1e-4)
    dec = to_numpy(decoder(y, enc, decoder_padding_mask=tgt_mask, encoder_padding_mask=src_mask))
    expected = y.astype("float64")
    for block in decoder.blocks:
        expected = ref.decoder_block(expected, enc, block_weights(block), 2, tgt_mask, src_mask, norm_first)
    if norm_first:
        expected = ref.layer_norm(expected, *norm_weights(decoder.final_norm), 1e-6)
    np.testing.assert_allclose(dec, expected, atol=1e-4)


def test_decoder_stack_cache_equals_full_pass():
    decoder = kt.layers.Decoder(num_layers=2, num_heads=2, d_ff=16, norm_first=True)
    x, y, src_mask, _ = _inputs(6)
    full = to_numpy(decoder(y, x, encoder_padding_mask=src_mask))
    caches = decoder.init_cache(2, 5, x)
    assert [tuple(c.shape) for c in caches[0]["self_attention"]] == [(2, 2, 5, 4)] * 2  # keys, values: (B, h, L, d)
    assert [tuple(c.shape) for c in caches[0]["cross_attention"]] == [(2, 2, x.shape[1], 4)] * 2
    steps = []
    for i in range(5):
        out, caches = decoder(y[:, i : i + 1], None, encoder_padding_mask=src_mask, cache=caches, cache_index=i)
        steps.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=1e-5)


def test_block_rejects_rank_2_input():
    with pytest.raises(ValueError, match=r"Layer 'enc'.*inputs.shape=\(2, 8\)"):
        kt.layers.EncoderBlock(2, 16, name="enc")(np.zeros((2, 8), "float32"))


def test_symbolic_decoder_cache_call_specs():
    """A Functional graph through the cached decoder path: output and cache specs."""
    decoder = kt.layers.Decoder(num_layers=2, num_heads=2, d_ff=16)
    decoder.build((None, None, 8), (None, None, 8))
    y = keras.Input((1, 8))
    cache = [
        {"self_attention": keras.Input((5, 2, 8)), "cross_attention": keras.Input((3, 2, 8))} for _ in range(2)
    ]
    out, new_cache = decoder(y, None, cache=cache, cache_index=1)
    assert tuple(out.shape) == (None, 1, 8)
    assert [tuple(c["self_attention"].shape) for c in new_cache] == [(None, 5, 2, 8)] * 2
    assert [tuple(c["cross_attention"].shape) for c in new_cache] == [(None, 3, 2, 8)] * 2


def test_cache_without_index_is_refused():
    block = kt.layers.DecoderBlock(num_heads=2, d_ff=16)
    block.build((None, None, 8))
    cache = block.init_cache(1, 4)
    with pytest.raises(ValueError, match="requires `cache_index`"):
        block(np.zeros((1, 1, 8), "float32"), cache=cache)


def test_a_cache_position_that_is_not_an_integer_or_leaves_the_cache_is_refused():
    # JAX clamped a write at -1, or past the cache's end, into the cache without a word;
    # PyTorch wrote at 2.5's integer part; the positional encoding computed position -3.
    block = kt.layers.DecoderBlock(num_heads=2, d_ff=16)
    block.build((None, None, 8))
    cache = block.init_cache(1, 4)
    one, two = np.ones((1, 1, 8), "float32"), np.ones((1, 2, 8), "float32")
    room = r"`cache_index` must leave room for the {} new position\(s\) in a cache of 4 positions"
    for x, index, message in ((one, -1, room.format(1)), (one, 4, room.format(1)), (two, 3, room.format(2)),
                              (one, 2.5, "`cache_index` must be an integer"), (one, True, "must be an integer"),
                              (one, np.float32(1), "must be an integer. Received: dtype=float32")):
        with pytest.raises(ValueError, match=message):
            block(x, cache=cache, cache_index=index)
    # The last positions that fit are written, and only they.
    for x, index in ((one, 3), (two, 2), (one, keras.ops.convert_to_tensor(3, "int32"))):
        _, written = block(x, cache=cache, cache_index=index)
        keys = keras.ops.convert_to_numpy(written["self_attention"][0])  # (B, h, L, d_k)
        filled = np.abs(keys).sum(axis=(0, 1, 3)) > 0
        assert filled.tolist() == [i >= 4 - x.shape[1] for i in range(4)], (index, filled)
    with pytest.raises(ValueError, match="`start_index` must be an integer >= 0"):
        kt.layers.SinusoidalPositionalEncoding()(one, start_index=-3)


@pytest.mark.parametrize("make, message", [
    (lambda: kt.layers.EncoderBlock(2, 8, layer_norm_epsilon=-1.0), "`layer_norm_epsilon` must be a finite number > 0"),
    (lambda: kt.layers.DecoderBlock(2, 8, attention_dropout=2.0), r"`attention_dropout` must be in \[0, 1\)"),
    (lambda: kt.layers.EncoderBlock(2, 8, key_dim=0), "`key_dim` must be a positive integer or None"),
    (lambda: kt.layers.Encoder(1, 0, 8), "`num_heads` must be a positive integer"),
    (lambda: kt.layers.PositionwiseFFN(8, dropout=1.0), r"`dropout` must be in \[0, 1\)"),
    (lambda: kt.layers.SinusoidalEmbedding(10, 8, dropout=-0.1), r"`dropout` must be in \[0, 1\)"),
    (lambda: kt.layers.SinusoidalPositionalEncoding(float("nan")), "`max_wavelength` must be a finite number"),
])
def test_layer_arguments_are_checked_when_the_layer_is_made(make, message):
    # Each was accepted when made (and failed at build, inside Keras, or gave NaN).
    with pytest.raises(ValueError, match=message):
        make()
