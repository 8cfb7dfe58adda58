"""Encoder and decoder layers (paper, section 3.1): residual + norm around sub-layers."""

from __future__ import annotations

import keras

from keras_transformer import _checks
from keras_transformer import ops as kt_ops
from keras_transformer.layers.attention import MultiHeadAttention
from keras_transformer.layers.feed_forward import PositionwiseFFN


# The arguments every block and stack shares (the stacks pass them to their blocks).
BLOCK_ARGUMENTS = (
    "num_heads", "d_ff", "dropout", "norm_first", "activation", "key_dim",
    "attention_dropout", "layer_norm_epsilon", "window",
)


def block_config(layer) -> dict:
    """The shared block arguments of `layer` as a serializable config."""
    config = {name: getattr(layer, name) for name in BLOCK_ARGUMENTS}
    config["activation"] = keras.activations.serialize(layer.activation)
    return config


class _Block(keras.layers.Layer):
    """What both blocks share: arguments, config and the residual connection."""

    def __init__(
        self,
        num_heads: int,
        d_ff: int,
        dropout: float = 0.1,
        norm_first: bool = False,
        activation="relu",
        key_dim: int | None = None,
        attention_dropout: float = 0.0,
        layer_norm_epsilon: float = 1e-6,
        window: int | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        where = f"Layer '{self.name}': "
        num_heads, d_ff = _checks.positive_ints(where, num_heads=num_heads, d_ff=d_ff)
        key_dim = _checks.positive_ints(where, optional=True, key_dim=key_dim)
        dropout, attention_dropout = _checks.rates(where, dropout=dropout, attention_dropout=attention_dropout)
        layer_norm_epsilon = _checks.positive_numbers(where, layer_norm_epsilon=layer_norm_epsilon)
        self.num_heads = num_heads
        self.d_ff = d_ff
        self.dropout = dropout
        self.norm_first = _checks.flags(where, norm_first=norm_first)
        self.activation = keras.activations.get(activation)
        self.key_dim = key_dim
        self.attention_dropout = attention_dropout
        self.layer_norm_epsilon = layer_norm_epsilon
        self.window = kt_ops.check_window(window, f"Layer '{self.name}'")
        self.supports_masking = True  # the output keeps the (first) input's Keras mask

    def _check_input_shape(self, arg, shape):
        shape = tuple(shape)
        if len(shape) != 3 or shape[-1] is None:
            raise ValueError(
                f"Layer '{self.name}': `{arg}` must have shape (batch, positions, d_model) "
                f"with a known d_model. Received: {arg}.shape={shape}"
            )
        return shape

    def _sublayer(self, prefix, sublayer, input_shape, **sublayer_build):
        """Create the norm and dropout that wrap a sub-layer, and build all three."""
        sublayer.build(input_shape, **sublayer_build)
        norm = keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, name=f"{prefix}_norm", dtype=self.dtype_policy
        )
        norm.build(input_shape)
        drop = keras.layers.Dropout(self.dropout, name=f"{prefix}_dropout", dtype=self.dtype_policy)
        return sublayer, norm, drop

    def _attention(self, name, window=None):
        return MultiHeadAttention(
            self.num_heads,
            key_dim=self.key_dim,
            dropout=self.attention_dropout,
            window=window,
            name=name,
            dtype=self.dtype_policy,
        )

    def _feed_forward(self):
        return PositionwiseFFN(
            self.d_ff, activation=self.activation, name="feed_forward", dtype=self.dtype_policy
        )

    def _sublayer_input(self, x, norm):
        """What a sub-layer sees: `x` (post-norm, the paper) or `LayerNorm(x)` (pre-norm)."""
        return norm(x) if self.norm_first else x

    def _sublayer_output(self, residual, out, norm, drop, training):
        """Post-norm `LayerNorm(x + Dropout(Sublayer(x)))` or pre-norm `x + Dropout(...)`."""
        x = drop(out, training=training) + residual
        return x if self.norm_first else norm(x)

    def get_config(self):
        return {**super().get_config(), **block_config(self)}


_BLOCK_ARGS = """
    Args:
        num_heads: Number of attention heads h.
        d_ff: Inner width of the feed-forward network.
        dropout: Residual dropout P_drop, applied to each sub-layer's output before it
            is added to the sub-layer input (section 5.4). Defaults to `0.1`.
        norm_first: `False` (the paper) puts LayerNorm after the residual sum
            (post-norm); `True` puts it before the sub-layer (pre-norm), which trains
            more stably in deep stacks. Defaults to `False`.
        activation: FFN activation. Defaults to `"relu"`.
        key_dim: Head size d_k. Defaults to `d_model // num_heads`.
        attention_dropout: Dropout on attention weights (not in the paper). Defaults
            to `0.0`.
        layer_norm_epsilon: LayerNorm epsilon. Defaults to `1e-6`.
        window: Restricted self-attention: attend only to positions within this
            distance r (paper, Table 1), computed in O(n * r * d). Applies to
            self-attention only, never to encoder-decoder attention. Defaults to
            `None` (full attention).
        **kwargs: Base layer arguments (`name`, `dtype`, ...).
"""


@keras.saving.register_keras_serializable(package="keras_transformer")
class EncoderBlock(_Block):
    __doc__ = (
        """One encoder layer: self-attention, then the position-wise FFN (section 3.1).

    Each sub-layer is wrapped as `LayerNorm(x + Dropout(Sublayer(x)))` by default.
"""
        + _BLOCK_ARGS
        + """
    Call arguments:
        inputs: `(B, S, d_model)`.
        padding_mask: Boolean `(B, S)`, `True` at real tokens. Defaults to the
            inputs' Keras mask (e.g. `keras.layers.Embedding(mask_zero=True)`'s), if any.
        attention_mask: Boolean `(B, S, S)`, `True` = may attend. Defaults to `None`.
        training: Whether dropout is active.

    Returns:
        `(B, S, d_model)`, with the inputs' Keras mask.

    Example:

    >>> import numpy as np
    >>> block = EncoderBlock(num_heads=2, d_ff=16)
    >>> tuple(block(np.zeros((2, 5, 8), "float32")).shape)
    (2, 5, 8)
    """
    )

    def build(self, inputs_shape):
        inputs_shape = self._check_input_shape("inputs", inputs_shape)
        # Self-attention block.
        self.self_attention, self.self_attention_norm, self.self_attention_dropout = self._sublayer(
            "self_attention", self._attention("self_attention", self.window), inputs_shape, value_shape=inputs_shape
        )
        # Feed-forward block.
        self.feed_forward, self.feed_forward_norm, self.feed_forward_dropout = self._sublayer(
            "feed_forward", self._feed_forward(), inputs_shape
        )
        self.built = True

    def call(self, inputs, padding_mask=None, attention_mask=None, training=None, mask=None):
        padding_mask = padding_mask_or_keras_mask(self, "padding_mask", padding_mask, mask)
        # Self-attention block.
        y = self._sublayer_input(inputs, self.self_attention_norm)
        y = self.self_attention(y, y, attention_mask=attention_mask, value_mask=padding_mask, training=training)
        x = self._sublayer_output(inputs, y, self.self_attention_norm, self.self_attention_dropout, training)
        # Feed-forward block.
        y = self.feed_forward(self._sublayer_input(x, self.feed_forward_norm), training=training)
        return self._sublayer_output(x, y, self.feed_forward_norm, self.feed_forward_dropout, training)

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape)


@keras.saving.register_keras_serializable(package="keras_transformer")
class DecoderBlock(_Block):
    __doc__ = (
        """One decoder layer: masked self-attention, encoder-decoder attention, FFN.

    Section 3.1. Self-attention is causal ("ensures that the predictions for position
    i can depend only on the known outputs at positions less than i"). Queries of the
    encoder-decoder attention come from the decoder, keys and values from the encoder
    output. If the layer is built without an encoder sequence, it has no
    cross-attention sub-layer and works as a decoder-only (language model) layer.
"""
        + _BLOCK_ARGS
        + """
    Call arguments:
        decoder_sequence: `(B, T, d_model)`.
        encoder_sequence: `(B, S, d_model)` encoder output, or `None`.
        decoder_padding_mask: Boolean `(B, T)`. Defaults to the decoder sequence's
            Keras mask (e.g. `keras.layers.Embedding(mask_zero=True)`'s), if any.
        encoder_padding_mask: Boolean `(B, S)`. Defaults to the encoder sequence's
            Keras mask (an `EncoderBlock` passes its inputs' on), if any.
        cache: The block's cache from `init_cache`, for incremental decoding;
            requires `cache_index`. With it, `encoder_sequence` is not needed (its keys
            and values are in the cache). Defaults to `None`.
        cache_index: Position of the first decoder token in the cache.
        training: Whether dropout is active.

    Returns:
        `(B, T, d_model)` with the decoder sequence's Keras mask, and the updated cache
        if one was given.

    Example:

    >>> import numpy as np
    >>> block = DecoderBlock(num_heads=2, d_ff=16)
    >>> y, x = np.zeros((2, 4, 8), "float32"), np.zeros((2, 6, 8), "float32")
    >>> tuple(block(y, x).shape)
    (2, 4, 8)
    """
    )

    def build(self, decoder_sequence_shape, encoder_sequence_shape=None):
        decoder_sequence_shape = self._check_input_shape("decoder_sequence", decoder_sequence_shape)
        # Masked self-attention block.
        self.self_attention, self.self_attention_norm, self.self_attention_dropout = self._sublayer(
            "self_attention",
            self._attention("self_attention", self.window),
            decoder_sequence_shape,
            value_shape=decoder_sequence_shape,
        )
        # Encoder-decoder attention block.
        self.cross_attention = None
        if encoder_sequence_shape is not None:
            encoder_sequence_shape = self._check_input_shape("encoder_sequence", encoder_sequence_shape)
            self.cross_attention, self.cross_attention_norm, self.cross_attention_dropout = self._sublayer(
                "cross_attention",
                self._attention("cross_attention"),
                decoder_sequence_shape,
                value_shape=encoder_sequence_shape,
            )
        # Feed-forward block.
        self.feed_forward, self.feed_forward_norm, self.feed_forward_dropout = self._sublayer(
            "feed_forward", self._feed_forward(), decoder_sequence_shape
        )
        self.built = True

    def call(
        self,
        decoder_sequence,
        encoder_sequence=None,
        decoder_padding_mask=None,
        encoder_padding_mask=None,
        cache=None,
        cache_index=None,
        training=None,
        mask=None,
        decoder_sequence_mask=None,
        encoder_sequence_mask=None,
    ):
        decoder_padding_mask, encoder_padding_mask = decoder_padding_masks(
            self, decoder_padding_mask, encoder_padding_mask, mask, decoder_sequence_mask, encoder_sequence_mask)
        has_encoder = encoder_sequence is not None or (cache is not None and "cross_attention" in cache)
        if has_encoder and self.cross_attention is None:
            raise ValueError(
                f"Layer '{self.name}' was built without an encoder sequence (decoder-only), "
                "so it has no cross-attention. Received: an `encoder_sequence` or a cache "
                "with a 'cross_attention' entry."
            )
        if not has_encoder and self.cross_attention is not None:
            raise ValueError(
                f"Layer '{self.name}' has a cross-attention sub-layer and needs "
                "`encoder_sequence` (or a cache from `init_cache(..., encoder_sequence)`). "
                "Received: neither."
            )
        if cache is not None and cache_index is None:
            raise ValueError(
                f"Layer '{self.name}': `cache` requires `cache_index`. Received: cache_index=None"
            )
        # Masked self-attention block.
        y = self._sublayer_input(decoder_sequence, self.self_attention_norm)
        if cache is None:
            y = self.self_attention(y, y, value_mask=decoder_padding_mask, use_causal_mask=True, training=training)
        else:
            y, self_cache = self.self_attention(
                y, y, value_mask=decoder_padding_mask, use_causal_mask=True,
                cache=cache["self_attention"], cache_index=cache_index, training=training,
            )
            cache = {**cache, "self_attention": self_cache}
        x = self._sublayer_output(decoder_sequence, y, self.self_attention_norm, self.self_attention_dropout, training)
        # Encoder-decoder attention block.
        if has_encoder:
            y = self._sublayer_input(x, self.cross_attention_norm)
            if cache is None:
                y = self.cross_attention(y, encoder_sequence, value_mask=encoder_padding_mask, training=training)
            else:  # the encoder's keys and values, projected once by `init_cache`
                y, _ = self.cross_attention(
                    y, y, value_mask=encoder_padding_mask, cache=cache["cross_attention"], training=training
                )
            x = self._sublayer_output(x, y, self.cross_attention_norm, self.cross_attention_dropout, training)
        # Feed-forward block.
        y = self.feed_forward(self._sublayer_input(x, self.feed_forward_norm), training=training)
        x = self._sublayer_output(x, y, self.feed_forward_norm, self.feed_forward_dropout, training)
        return x if cache is None else (x, cache)

    def init_cache(self, batch_size, max_length, encoder_sequence=None, dtype=None):
        """The block's decoding cache: `{"self_attention": ...}`, plus
        `"cross_attention"` (the encoder output projected once) when the block has
        encoder-decoder attention. Each entry is a `MultiHeadAttention` cache.

        Args:
            batch_size: B.
            max_length: The longest output L.
            encoder_sequence: Encoder output `(B, S, d_model)`; required when the block
                has encoder-decoder attention.
            dtype: Defaults to the block's compute dtype.
        """
        if self.cross_attention is not None and encoder_sequence is None:
            raise ValueError(
                f"Layer '{self.name}' has encoder-decoder attention; its cache needs the "
                "`encoder_sequence`. Received: encoder_sequence=None"
            )
        cache = {"self_attention": self.self_attention.init_cache(batch_size, max_length, dtype)}
        if self.cross_attention is not None:
            cache["cross_attention"] = self.cross_attention.compute_cache(encoder_sequence)
        return cache

    def compute_output_shape(self, decoder_sequence_shape, encoder_sequence_shape=None):
        return tuple(decoder_sequence_shape)

    def compute_output_spec(self, decoder_sequence, encoder_sequence=None, cache=None, **kwargs):
        out = keras.KerasTensor(decoder_sequence.shape, dtype=self.compute_dtype)
        if cache is None:
            return out
        return out, keras.tree.map_structure(lambda c: keras.KerasTensor(c.shape, dtype=c.dtype), cache)


def padding_mask_or_keras_mask(layer, name: str, given, *keras_masks):
    """The padding mask `name` of `layer`'s call as booleans: the one given, else the
    sequence's Keras mask, which Keras passes as `mask` (one tensor argument) or as
    `<argument>_mask` (several); `None` without either."""
    mask = next((m for m in (given, *keras_masks) if m is not None), None)
    return None if mask is None else _checks.boolean_mask(f"Layer '{layer.name}': ", name, mask)


def decoder_padding_masks(layer, decoder_padding_mask, encoder_padding_mask, mask, decoder_sequence_mask,
                          encoder_sequence_mask):
    """A decoder's (block's or stack's) two padding masks, from its call's arguments: each as
    given, else its sequence's Keras mask (`padding_mask_or_keras_mask`)."""
    return (padding_mask_or_keras_mask(layer, "decoder_padding_mask", decoder_padding_mask, decoder_sequence_mask,
                                       mask),
            padding_mask_or_keras_mask(layer, "encoder_padding_mask", encoder_padding_mask, encoder_sequence_mask))
