"""The Transformer (paper, section 3): encoder-decoder model for sequence transduction.

Its searches (`search`, `translate`) are in `keras_transformer.models.translating`."""

from __future__ import annotations

import copy
import warnings

import keras
from keras import ops

from keras_transformer import _checks, _compat
from keras_transformer.backend.compile import FunctionCache
from keras_transformer import ops as kt_ops
from keras_transformer.defaults import END_ID, PAD_ID, PRESETS, START_ID
from keras_transformer.layers.embedding import SinusoidalEmbedding
from keras_transformer.layers.stacks import Decoder, Encoder
from keras_transformer.models.translating import Translating


@keras.saving.register_keras_serializable(package="keras_transformer")
class Transformer(Translating, keras.Model):
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
        start_id: The `[START]` id that opens every decoder input. Defaults to `2`.
        end_id: The `[END]` id that closes every output. Defaults to `3`.
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
        pad_id: int = PAD_ID,
        start_id: int = START_ID,
        end_id: int = END_ID,
        **kwargs,
    ):
        # Inputs are token ids: never cast them (a float id is an error, not a float).
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        where = f"Model '{self.name}': "
        vocab_size, num_layers, d_model, num_heads, d_ff = _checks.positive_ints(
            where, vocab_size=vocab_size, num_layers=num_layers, d_model=d_model, num_heads=num_heads, d_ff=d_ff)
        dropout = _checks.rates(where, dropout=dropout)
        layer_norm_epsilon = _checks.positive_numbers(where, layer_norm_epsilon=layer_norm_epsilon)
        max_wavelength = _checks.numbers_above(where, 1, max_wavelength=max_wavelength)
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
        self.norm_first, self.tie_weights = _checks.flags(where, norm_first=norm_first, tie_weights=tie_weights)
        self.activation = activation
        self.layer_norm_epsilon = layer_norm_epsilon
        self.max_wavelength = max_wavelength
        pad_id, start_id, end_id = _checks.special_ids(where, vocab_size, pad_id=pad_id, start_id=start_id,
                                                       end_id=end_id)
        self.pad_id = pad_id
        self.start_id = start_id
        self.end_id = end_id
        # Compiled searches, per static arguments: bounded, and released with the model.
        self._searches = FunctionCache(max_entries=8)

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

    @property
    def jit_compile(self):
        """Whether the training step is compiled (Keras' `jit_compile`).

        On PyTorch, `compile(jit_compile=True)` trains eagerly, with one warning when
        training starts (none when a model saved so on another backend is only loaded
        to translate). Keras
        compiles its PyTorch step with `torch.compile`; on this model TorchDynamo breaks
        the graph inside Keras' layer machinery and hits its recompile limit
        (keras-team/keras#21851, open): with Keras 3.15 and torch 2.13 the first step of
        a 2-layer model took 110 s to compile and later steps ran slower than eager, with
        the same losses. JAX and TensorFlow compile the step with XLA, as Keras does.
        """
        return keras.Model.jit_compile.fget(self)

    @jit_compile.setter
    def jit_compile(self, value):
        if value is True and keras.backend.backend() == "torch":
            self._eager_instead_of_jit = True  # said when training starts (`make_train_function`)
            value = False
        keras.Model.jit_compile.fset(self, value)

    def build(self, inputs_shape=None):
        if self.built:  # built already: by a first call, or by Keras from a config (`clone_model`)
            return  # (building the layers again would add their weights again, which Keras refuses)
        sequence_shape = (None, None, self.d_model)
        for emb in {id(e): e for e in (self.source_embedding, self.target_embedding)}.values():
            emb.build((None, None))
        self.encoder.build(sequence_shape)
        self.decoder.build(sequence_shape, sequence_shape)
        if self.output_projection is not None:
            self.output_projection.build(sequence_shape)
        self.built = True

    # A failed call keeps the weights on JAX too (see `_compat.state_kept_if_a_loop_fails`).
    def fit(self, *args, **kwargs):
        with _compat.state_kept_if_a_loop_fails(self):
            return super().fit(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        with _compat.state_kept_if_a_loop_fails(self):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with _compat.state_kept_if_a_loop_fails(self):
            return super().predict(*args, **kwargs)

    def make_train_function(self, force=False):
        self._build_training_state()
        if getattr(self, "_eager_instead_of_jit", False):
            self._eager_instead_of_jit = False
            warnings.warn(
                f"Model '{self.name}': jit_compile=True on PyTorch would wrap the training step in "
                "torch.compile, which breaks the graph inside Keras' layers and is slower than eager "
                "on this model (keras-team/keras#21851); training runs eagerly.",
                RuntimeWarning,
                stacklevel=2,
            )
        return super().make_train_function(force)

    def make_test_function(self, force=False):
        self._build_training_state()
        return super().make_test_function(force)

    def _build_training_state(self):
        # On TensorFlow without a distribution strategy, Keras creates the optimizer's and
        # the metrics' variables while tracing the first training step, and a
        # `tf.function` that creates variables is traced twice: the whole step again
        # (7 s of the tiny preset's 14 s first `fit` call on 2 CPU cores). Built before
        # the step is made, they are there when it is traced, once. (With a strategy, and
        # on JAX and PyTorch, Keras builds them before tracing.)
        if (keras.backend.backend() != "tensorflow" or not getattr(self, "compiled", False)
                or getattr(self, "_distribute_strategy", None) is not None):
            return
        ids = keras.KerasTensor((1, 8), "int32")
        try:
            self._symbolic_build(data_batch=({"source_ids": ids, "target_ids": ids}, ids))
        except Exception:  # a loss or metric for other targets: Keras builds them while tracing, as before
            pass

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

    # Decoding (section 6.1): the model offers its step; `keras_transformer.decoding`
    # searches over it without knowing anything else about the model.

    def init_cache(self, source_ids, max_length):
        """Everything decoding needs from the source, computed once.

        Encodes the source, projects the encoder output into each decoder layer's
        encoder-decoder keys and values, and preallocates each layer's self-attention
        cache of `max_length` positions.

        Args:
            source_ids: Integer `(B, S)`, padded with `pad_id`.
            max_length: The longest output L.

        Returns:
            `{"source_mask": (B, S) bool, "decoder": Decoder.init_cache(...)}`, a nest
            of tensors whose leading axis is B.
        """
        encoder_output, source_mask = self.encode(source_ids)
        batch = ops.shape(source_ids)[0]
        return {
            "source_mask": source_mask,
            "decoder": self.decoder.init_cache(batch, max_length, encoder_output),
        }

    def step(self, token_ids, cache, index):
        """One decoding step with the cache: the token at `index` through the decoder.

        Args:
            token_ids: Integer `(B, 1 + L)`, the tokens so far (`[START]` first).
            cache: From `init_cache` (or a previous step).
            index: Position of the newest token (scalar).

        Returns:
            `(logits, cache)`: float32 `(B, vocab_size)` logits of the token at
            `index + 1`, and the cache with the newest keys and values written in.
        """
        tokens = _compat.slice_along(token_ids, index, 1, axis=1)  # (B, 1)
        y = self.target_embedding(tokens, start_index=index)
        y, decoder_cache = self.decoder(
            y, None, encoder_padding_mask=cache["source_mask"], cache=cache["decoder"], cache_index=index
        )
        return self.project(y)[:, 0, :], {**cache, "decoder": decoder_cache}

    def uncached_step(self, token_ids, cache, index):
        """The same step without the KV cache: the whole prefix through the decoder.

        Same logits as `step` at much higher cost; for checks and benchmarks. `cache`
        is `{"encoder_output": ..., "source_mask": ...}` (see `search`).
        """
        y = self.target_embedding(token_ids)
        y = self.decoder(y, cache["encoder_output"], encoder_padding_mask=cache["source_mask"])
        return ops.take(self.project(y), index, axis=1), cache

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
                "start_id": self.start_id,
                "end_id": self.end_id,
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
        source_ids, target_ids = inputs["source_ids"], inputs["target_ids"]
        for key, ids in (("source_ids", source_ids), ("target_ids", target_ids)):
            if len(ids.shape) != 2:
                raise ValueError(
                    f"Model '{self.name}': `{key}` must be token ids of shape (batch, length). "
                    f"Received: {key}.shape={tuple(ids.shape)}"
                )
        return source_ids, target_ids

