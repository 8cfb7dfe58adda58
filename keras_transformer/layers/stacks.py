"""Encoder and decoder stacks: N identical blocks (paper, section 3.1)."""

from __future__ import annotations

import keras

from keras_transformer import _checks
from keras_transformer.layers.blocks import (BLOCK_ARGUMENTS, DecoderBlock, EncoderBlock, block_config,
                                              decoder_padding_masks, padding_mask_or_keras_mask)


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
        num_layers = _checks.positive_ints(f"Layer '{self.name}': ", num_layers=num_layers)
        self.num_layers = num_layers
        prefix = self.block_class.__name__.replace("Block", "").lower()
        arguments = dict(
            num_heads=num_heads, d_ff=d_ff, dropout=dropout, norm_first=norm_first, activation=activation,
            key_dim=key_dim, attention_dropout=attention_dropout, layer_norm_epsilon=layer_norm_epsilon,
            window=window,
        )
        self.blocks = [
            self.block_class(**arguments, name=f"{prefix}_block_{i}", dtype=self.dtype_policy)
            for i in range(num_layers)
        ]
        self.supports_masking = True  # the output keeps the (first) input's Keras mask
        # The blocks validate the arguments; the stack keeps them (as the blocks hold them) for its config.
        for name in BLOCK_ARGUMENTS:
            setattr(self, name, getattr(self.blocks[0], name))
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


_STACK_ARGS = """
    Args:
        num_layers: Number of blocks N.
        num_heads: Attention heads h per block.
        d_ff: FFN inner width.
        dropout: Residual dropout. Defaults to `0.1`.
        norm_first: Pre-norm blocks plus a final LayerNorm. Defaults to `False`.
        activation: FFN activation, as in the blocks. Defaults to `"relu"`.
        key_dim: Size d_k of each head. Defaults to `d_model // num_heads`.
        attention_dropout: Dropout on the attention weights. Defaults to `0.0`.
        layer_norm_epsilon: Defaults to `1e-6`.
        window: Restricted self-attention distance r, as in the blocks. Defaults to
            `None` (full attention).
        **kwargs: Base layer arguments.
"""


@keras.saving.register_keras_serializable(package="keras_transformer")
class Encoder(_Stack):
    __doc__ = (
        """The encoder: a stack of N `EncoderBlock`s (paper, section 3.1; N = 6).
"""
        + _STACK_ARGS
        + """
    Call arguments:
        inputs: Embedded source `(B, S, d_model)`.
        padding_mask: Boolean `(B, S)`, `True` at real tokens. Defaults to the
            inputs' Keras mask (e.g. `keras.layers.Embedding(mask_zero=True)`'s), if any.
        attention_mask: Boolean `(B, S, S)`. Defaults to `None`.
        training: Whether dropout is active.

    Returns:
        `(B, S, d_model)`, with the inputs' Keras mask.

    Example:

    >>> import numpy as np
    >>> encoder = Encoder(num_layers=2, num_heads=2, d_ff=16)
    >>> tuple(encoder(np.zeros((1, 5, 8), "float32")).shape)
    (1, 5, 8)
    """
    )

    block_class = EncoderBlock

    def build(self, inputs_shape):
        for block in self.blocks:
            block.build(inputs_shape)
        self._build_final_norm(inputs_shape)
        self.built = True

    def call(self, inputs, padding_mask=None, attention_mask=None, training=None, mask=None):
        padding_mask = padding_mask_or_keras_mask(self, "padding_mask", padding_mask, mask)
        x = inputs
        for block in self.blocks:
            x = block(x, padding_mask=padding_mask, attention_mask=attention_mask, training=training)
        return self._finish(x)

    def compute_output_shape(self, inputs_shape):
        return tuple(inputs_shape)


@keras.saving.register_keras_serializable(package="keras_transformer")
class Decoder(_Stack):
    __doc__ = (
        """The decoder: a stack of N `DecoderBlock`s (paper, section 3.1; N = 6).

    Built with an encoder sequence, each block has encoder-decoder attention; built
    without one, the stack is a decoder-only (causal language model) stack.
"""
        + _STACK_ARGS
        + """
    Call arguments:
        decoder_sequence: Embedded target `(B, T, d_model)`.
        encoder_sequence: Encoder output `(B, S, d_model)`, or `None` (decoder-only).
        decoder_padding_mask: Boolean `(B, T)`. Defaults to the decoder sequence's
            Keras mask (e.g. `keras.layers.Embedding(mask_zero=True)`'s), if any.
        encoder_padding_mask: Boolean `(B, S)`. Defaults to the encoder sequence's
            Keras mask (an `Encoder` passes its inputs' on), if any.
        cache: The stack's cache from `init_cache` (one entry per block), for
            incremental decoding. Requires `cache_index`. Defaults to `None`.
        cache_index: Position of the first decoder token in the cache.
        training: Whether dropout is active.

    Returns:
        `(B, T, d_model)` with the decoder sequence's Keras mask, and the updated cache
        if one was given.

    Example:

    >>> import numpy as np
    >>> decoder = Decoder(num_layers=2, num_heads=2, d_ff=16)
    >>> y, x = np.zeros((1, 4, 8), "float32"), np.zeros((1, 6, 8), "float32")
    >>> tuple(decoder(y, x).shape)
    (1, 4, 8)
    """
    )

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
        cache=None,
        cache_index=None,
        training=None,
        mask=None,
        decoder_sequence_mask=None,
        encoder_sequence_mask=None,
    ):
        decoder_padding_mask, encoder_padding_mask = decoder_padding_masks(
            self, decoder_padding_mask, encoder_padding_mask, mask, decoder_sequence_mask, encoder_sequence_mask)
        x = decoder_sequence
        new_cache = []
        for i, block in enumerate(self.blocks):
            kwargs = dict(
                decoder_padding_mask=decoder_padding_mask,
                encoder_padding_mask=encoder_padding_mask,
                training=training,
            )
            if cache is None:
                x = block(x, encoder_sequence, **kwargs)
            else:
                x, block_cache = block(x, encoder_sequence, cache=cache[i], cache_index=cache_index, **kwargs)
                new_cache.append(block_cache)
        x = self._finish(x)
        return x if cache is None else (x, new_cache)

    def init_cache(self, batch_size, max_length, encoder_sequence=None, dtype=None):
        """The stack's decoding cache: a list with each block's `DecoderBlock.init_cache`.

        Args:
            batch_size: B.
            max_length: The longest output L.
            encoder_sequence: Encoder output `(B, S, d_model)`, projected once into each
                block's encoder-decoder keys and values. `None` for a decoder-only stack.
            dtype: Defaults to the stack's compute dtype.
        """
        return [block.init_cache(batch_size, max_length, encoder_sequence, dtype) for block in self.blocks]

    def compute_output_shape(self, decoder_sequence_shape, encoder_sequence_shape=None):
        return tuple(decoder_sequence_shape)

    def compute_output_spec(self, decoder_sequence, encoder_sequence=None, cache=None, **kwargs):
        out = keras.KerasTensor(decoder_sequence.shape, dtype=self.compute_dtype)
        if cache is None:
            return out
        return out, keras.tree.map_structure(lambda c: keras.KerasTensor(c.shape, dtype=c.dtype), cache)
