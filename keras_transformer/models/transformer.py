"""The Transformer (paper, section 3): encoder-decoder model for sequence transduction."""

from __future__ import annotations

import copy

import keras
from keras import ops

from keras_transformer import ops as kt_ops
from keras_transformer.layers.embedding import SinusoidalEmbedding
from keras_transformer.layers.stacks import Decoder, Encoder

PRESETS = {
    # Table 3 of the paper, "base": N=6, d_model=512, d_ff=2048, h=8, P_drop=0.1.
    "base": dict(num_layers=6, d_model=512, num_heads=8, d_ff=2048, dropout=0.1),
    # Table 3, "big": N=6, d_model=1024, d_ff=4096, h=16, P_drop=0.3 (EN-DE).
    "big": dict(num_layers=6, d_model=1024, num_heads=16, d_ff=4096, dropout=0.3),
    # Small enough to train in minutes on a laptop CPU: tests and demos.
    "tiny": dict(num_layers=2, d_model=128, num_heads=4, d_ff=512, dropout=0.1),
}


@keras.saving.register_keras_serializable(package="keras_transformer")
class Transformer(keras.Model):
    """The encoder-decoder Transformer of "Attention Is All You Need".

    Paper, section 3 and Figure 1. Source and target token ids are embedded (× sqrt
    d_model, plus the sinusoidal encoding, then dropout), the encoder maps the source
    to a sequence of d_model vectors, the decoder attends to it and to the target
    prefix, and a linear layer gives logits over the vocabulary. With `tie_weights`
    (the paper's choice, section 3.4) one matrix serves as the source embedding, the
    target embedding and the pre-softmax projection; the vocabulary is shared.

    Padding (id `pad_id`) and causal masks are built from the ids inside the model.

    Args:
        vocab_size: Size of the shared vocabulary.
        num_layers: N, blocks in the encoder and in the decoder. Defaults to `6`.
        d_model: Model width. Defaults to `512`.
        num_heads: Attention heads h. Defaults to `8`.
        d_ff: FFN inner width. Defaults to `2048`.
        dropout: P_drop on embeddings and sub-layer outputs. Defaults to `0.1`.
        norm_first: Pre-norm instead of the paper's post-norm. Defaults to `False`.
        tie_weights: One matrix for both embeddings and the output projection.
            `False` gives three separate matrices. Defaults to `True`.
        activation: FFN activation. Defaults to `"relu"`.
        layer_norm_epsilon: Defaults to `1e-6`.
        max_wavelength: Base of the sinusoidal encoding. Defaults to `10000`.
        pad_id: Padding token id. Defaults to `0`.
        **kwargs: `keras.Model` arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: `{"source_ids": (B, S) int, "target_ids": (B, T) int}`; `target_ids`
            is the decoder input (the shifted target, starting with `[START]`).
        training: Whether dropout is active.

    Returns:
        Logits `(B, T, vocab_size)`, float32 whatever the dtype policy.

    Example:

    >>> import numpy as np
    >>> model = Transformer(vocab_size=20, num_layers=1, d_model=16, num_heads=2, d_ff=32)
    >>> logits = model({"source_ids": np.array([[5, 6, 7, 0]]), "target_ids": np.array([[2, 8, 9]])})
    >>> tuple(logits.shape)
    (1, 3, 20)
    """

    def __init__(
        self,
        vocab_size: int,
        num_layers: int = 6,
        d_model: int = 512,
        num_heads: int = 8,
        d_ff: int = 2048,
        dropout: float = 0.1,
        norm_first: bool = False,
        tie_weights: bool = True,
        activation="relu",
        layer_norm_epsilon: float = 1e-6,
        max_wavelength: float = 10000,
        pad_id: int = 0,
        **kwargs,
    ):
        # Inputs are token ids: never cast them (a float id is an error, not a float).
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        if d_model % num_heads != 0:
            raise ValueError(
                f"Model '{self.name}': `d_model` must be divisible by `num_heads`. "
                f"Received: d_model={d_model}, num_heads={num_heads}"
            )
        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_ff = d_ff
        self.dropout = dropout
        self.norm_first = norm_first
        self.tie_weights = tie_weights
        self.activation = activation
        self.layer_norm_epsilon = layer_norm_epsilon
        self.max_wavelength = max_wavelength
        self.pad_id = pad_id

        def embedding(name):
            return SinusoidalEmbedding(
                vocab_size, d_model, dropout=dropout, max_wavelength=max_wavelength,
                name=name, dtype=self.dtype_policy,
            )

        stack_args = dict(
            num_layers=num_layers, num_heads=num_heads, d_ff=d_ff, dropout=dropout,
            norm_first=norm_first, activation=activation,
            layer_norm_epsilon=layer_norm_epsilon, dtype=self.dtype_policy,
        )
        if tie_weights:
            self.embedding = embedding("embedding")
            self.source_embedding = self.target_embedding = self.embedding
            self.output_projection = None
        else:
            self.source_embedding = embedding("source_embedding")
            self.target_embedding = embedding("target_embedding")
            self.output_projection = keras.layers.Dense(
                vocab_size, use_bias=False, name="output_projection", dtype=self.dtype_policy
            )
        self.encoder = Encoder(name="encoder", **stack_args)
        self.decoder = Decoder(name="decoder", **stack_args)

    @classmethod
    def from_preset(cls, preset: str, vocab_size: int, **kwargs) -> "Transformer":
        """A model with the sizes of a named preset: `"base"`, `"big"` or `"tiny"`.

        Keyword arguments override the preset's values (e.g. `dropout=0.0`).
        """
        if preset not in PRESETS:
            raise ValueError(
                f"Unknown preset. Expected one of {sorted(PRESETS)}. Received: preset={preset!r}"
            )
        config = copy.deepcopy(PRESETS[preset])
        config.update(kwargs)
        return cls(vocab_size=vocab_size, **config)

    def build(self, inputs_shape=None):
        sequence_shape = (None, None, self.d_model)
        for emb in {id(e): e for e in (self.source_embedding, self.target_embedding)}.values():
            emb.build((None, None))
        self.encoder.build(sequence_shape)
        self.decoder.build(sequence_shape, sequence_shape)
        if self.output_projection is not None:
            self.output_projection.build(sequence_shape)
        self.built = True

    def call(self, inputs, training=None):
        source_ids, target_ids = self._unpack(inputs)
        encoder_outputs, source_mask = self.encode(source_ids, training=training)
        target_mask = kt_ops.padding_mask(target_ids, self.pad_id)
        y = self.target_embedding(target_ids, training=training)
        y = self.decoder(
            y,
            encoder_outputs,
            decoder_padding_mask=target_mask,
            encoder_padding_mask=source_mask,
            training=training,
        )
        return self.project(y)

    def encode(self, source_ids, training=None):
        """Encoder output `(B, S, d_model)` and source padding mask `(B, S)`."""
        source_mask = kt_ops.padding_mask(source_ids, self.pad_id)
        x = self.source_embedding(source_ids, training=training)
        return self.encoder(x, padding_mask=source_mask, training=training), source_mask

    def project(self, decoder_outputs):
        """Pre-softmax projection to float32 logits `(B, T, vocab_size)`."""
        if self.output_projection is None:
            logits = self.embedding(decoder_outputs, reverse=True)
        else:
            logits = self.output_projection(decoder_outputs)
        return ops.cast(logits, "float32")

    def translate(self, source_ids, beam_size: int = 4, length_penalty: float = 0.6, max_extra_length: int = 50):
        """Beam search (section 6.1): the best output ids for each source row.

        Args:
            source_ids: Integer `(B, S)`, padded with `pad_id`.
            beam_size: Defaults to `4` (the paper). `1` is greedy decoding.
            length_penalty: alpha of the GNMT penalty `((5 + |Y|) / 6)^alpha`.
                Defaults to `0.6` (the paper).
            max_extra_length: Longest output = `S + max_extra_length`. Defaults to `50`.

        Returns:
            Integer `(B, S + max_extra_length)`: output tokens, `[END]`, then padding.
        """
        from keras_transformer import decoding

        return decoding.beam_search(
            self, source_ids, beam_size=beam_size, length_penalty_alpha=length_penalty,
            max_extra_length=max_extra_length,
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocab_size": self.vocab_size,
                "num_layers": self.num_layers,
                "d_model": self.d_model,
                "num_heads": self.num_heads,
                "d_ff": self.d_ff,
                "dropout": self.dropout,
                "norm_first": self.norm_first,
                "tie_weights": self.tie_weights,
                "activation": self.activation,
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "max_wavelength": self.max_wavelength,
                "pad_id": self.pad_id,
            }
        )
        return config

    @property
    def input_dtype(self):
        """Token ids are integers (also what saved signatures are traced with)."""
        return "int32"

    def get_build_config(self):
        # Every weight shape follows from the constructor arguments.
        return {"from_config": True}

    def build_from_config(self, config):
        self.build()

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def _unpack(self, inputs):
        if not isinstance(inputs, dict) or not {"source_ids", "target_ids"} <= set(inputs):
            got = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
            raise ValueError(
                f"Model '{self.name}' expects a dict with keys 'source_ids' and "
                f"'target_ids'. Received: {got}"
            )
        return inputs["source_ids"], inputs["target_ids"]

