"""Encoder and decoder stacks: N identical blocks (paper, section 3.1)."""

from __future__ import annotations

import keras
from keras import ops

from keras_transformer.layers.blocks import DecoderBlock, EncoderBlock, block_config


class _Stack(keras.layers.Layer):
    """What both stacks share: N blocks and, for pre-norm, a final LayerNorm."""

    block_class = None

    def __init__(
        self,
        num_layers: int,
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
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(
                f"Layer '{self.name}': `num_layers` must be a positive integer. "
                f"Received: num_layers={num_layers!r}"
            )
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.d_ff = d_ff
        self.dropout = dropout
        self.norm_first = norm_first
        self.activation = keras.activations.get(activation)
        self.key_dim = key_dim
        self.attention_dropout = attention_dropout
        self.layer_norm_epsilon = layer_norm_epsilon
        self.window = window
        prefix = self.block_class.__name__.replace("Block", "").lower()
        self.blocks = [
            self.block_class(
                num_heads,
                d_ff,
                dropout=dropout,
                norm_first=norm_first,
                activation=activation,
                key_dim=key_dim,
                attention_dropout=attention_dropout,
                layer_norm_epsilon=layer_norm_epsilon,
                window=window,
                name=f"{prefix}_block_{i}",
                dtype=self.dtype_policy,
            )
            for i in range(num_layers)
        ]
        # Pre-norm leaves the residual stream un-normalised; normalise it once at the end.
        self.final_norm = (
            keras.layers.LayerNormalization(
                epsilon=layer_norm_epsilon, name="final_norm", dtype=self.dtype_policy
            )
            if norm_first
            else None
        )

    def _build_final_norm(self, shape):
        if self.final_norm is not None:
            self.final_norm.build(shape)

    def _finish(self, x):
        return x if self.final_norm is None else self.final_norm(x)

    def get_config(self):
        return {**super().get_config(), "num_layers": self.num_layers, **block_config(self)}


@keras.saving.register_keras_serializable(package="keras_transformer")
class Encoder(_Stack):
    """The encoder: a stack of N `EncoderBlock`s (paper, section 3.1; N = 6).

    Args:
        num_layers: Number of blocks N.
        num_heads: Attention heads h per block.
        d_ff: FFN inner width.
        dropout: Residual dropout. Defaults to `0.1`.
        norm_first: Pre-norm blocks plus a final LayerNorm. Defaults to `False`.
        activation: FFN activation, as in `EncoderBlock`. Defaults to `"relu"`.
        key_dim: Size d_k of each head. Defaults to `d_model // num_heads`.
        attention_dropout: Dropout on the attention weights. Defaults to `0.0`.
        layer_norm_epsilon: Defaults to `1e-6`.
        window: Restricted self-attention distance r, as in `EncoderBlock`. Defaults to
            `None` (full attention).
        **kwargs: Base layer arguments.

    Call arguments:
        inputs: Embedded source `(B, S, d_model)`.
        padding_mask: Boolean `(B, S)`, `True` at real tokens. Defaults to `None`.
        attention_mask: Boolean `(B, S, S)`. Defaults to `None`.
        training: Whether dropout is active.

    Returns:
        `(B, S, d_model)`.

    Example:

    >>> import numpy as np
    >>> encoder = Encoder(num_layers=2, num_heads=2, d_ff=16)
    >>> tuple(encoder(np.zeros((1, 5, 8), "float32")).shape)
    (1, 5, 8)
    """

    block_class = EncoderBlock

    def build(self, inputs_shape):
        for block in self.blocks:
            block.build(inputs_shape)
        self._build_final_norm(inputs_shape)
        self.built = True

    def call(self, inputs, padding_mask=None, attention_mask=None, training=None):
        x = inputs
        for block in self.blocks:
            x = block(x, padding_mask=padding_mask, attention_mask=attention_mask, training=training)
        return self._finish(x)

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape)


@keras.saving.register_keras_serializable(package="keras_transformer")
class Decoder(_Stack):
    """The decoder: a stack of N `DecoderBlock`s (paper, section 3.1; N = 6).

    Built with an encoder sequence, each block has encoder-decoder attention; built
    without one, the stack is a decoder-only (causal language model) stack.

    Args:
        num_layers: Number of blocks N.
        num_heads: Attention heads h per block.
        d_ff: FFN inner width.
        dropout: Residual dropout. Defaults to `0.1`.
        norm_first: Pre-norm blocks plus a final LayerNorm. Defaults to `False`.
        activation: FFN activation, as in `DecoderBlock`. Defaults to `"relu"`.
        key_dim: Size d_k of each head. Defaults to `d_model // num_heads`.
        attention_dropout: Dropout on the attention weights. Defaults to `0.0`.
        layer_norm_epsilon: Defaults to `1e-6`.
        window: Restricted self-attention distance r, as in `DecoderBlock`. Defaults to
            `None` (full attention).
        **kwargs: Base layer arguments.

    Call arguments:
        decoder_sequence: Embedded target `(B, T, d_model)`.
        encoder_sequence: Encoder output `(B, S, d_model)`, or `None` (decoder-only).
        decoder_padding_mask: Boolean `(B, T)`. Defaults to `None`.
        encoder_padding_mask: Boolean `(B, S)`. Defaults to `None`.
        self_attention_cache: A list with one `(key_cache, value_cache)` per block
            (see `init_cache`). Requires `cache_index`. Defaults to `None`.
        cache_index: Position of the first decoder token in the cache.
        cross_attention_cache: A list with one precomputed `(keys, values)` per block
            (see `compute_cross_attention_cache`). Defaults to `None`.
        training: Whether dropout is active.

    Returns:
        `(B, T, d_model)`, and the list of updated caches if caches were given.

    Example:

    >>> import numpy as np
    >>> decoder = Decoder(num_layers=2, num_heads=2, d_ff=16)
    >>> y, x = np.zeros((1, 4, 8), "float32"), np.zeros((1, 6, 8), "float32")
    >>> tuple(decoder(y, x).shape)
    (1, 4, 8)
    """

    block_class = DecoderBlock

    def build(self, decoder_sequence_shape, encoder_sequence_shape=None):
        for block in self.blocks:
            block.build(decoder_sequence_shape, encoder_sequence_shape)
        self._build_final_norm(decoder_sequence_shape)
        self.built = True

    def call(
        self,
        decoder_sequence,
        encoder_sequence=None,
        decoder_padding_mask=None,
        encoder_padding_mask=None,
        self_attention_cache=None,
        cache_index=None,
        cross_attention_cache=None,
        training=None,
    ):
        x = decoder_sequence
        new_caches = []
        for i, block in enumerate(self.blocks):
            out = block(
                x,
                encoder_sequence,
                decoder_padding_mask=decoder_padding_mask,
                encoder_padding_mask=encoder_padding_mask,
                self_attention_cache=None if self_attention_cache is None else self_attention_cache[i],
                cache_index=cache_index,
                cross_attention_cache=None if cross_attention_cache is None else cross_attention_cache[i],
                training=training,
            )
            if self_attention_cache is not None:
                x, cache = out
                new_caches.append(cache)
            else:
                x = out
        x = self._finish(x)
        if self_attention_cache is not None:
            return x, new_caches
        return x

    def init_cache(self, batch_size, max_length, dtype=None):
        """Zero self-attention caches: one `(key_cache, value_cache)` per block.

        Each is `(batch_size, max_length, h, d_k)`, preallocated so that every decoding
        step has the same shapes (and compiles once).
        """
        dtype = dtype or self.compute_dtype
        caches = []
        for block in self.blocks:
            attn = block.self_attention
            k = ops.zeros((batch_size, max_length, attn.num_heads, attn._key_dim), dtype=dtype)
            v = ops.zeros((batch_size, max_length, attn.num_heads, attn._value_dim), dtype=dtype)
            caches.append((k, v))
        return caches

    def compute_cross_attention_cache(self, encoder_sequence):
        """Project the encoder output once per block: a list of `(keys, values)`."""
        return [block.cross_attention.compute_key_value(encoder_sequence) for block in self.blocks]

    def compute_output_shape(self, decoder_sequence_shape, encoder_sequence_shape=None):
        return tuple(decoder_sequence_shape)

    def compute_output_spec(self, decoder_sequence, encoder_sequence=None, self_attention_cache=None, **kwargs):
        out = keras.KerasTensor(decoder_sequence.shape, dtype=self.compute_dtype)
        if self_attention_cache is not None:
            caches = [tuple(keras.KerasTensor(c.shape, dtype=c.dtype) for c in pair) for pair in self_attention_cache]
            return out, caches
        return out
