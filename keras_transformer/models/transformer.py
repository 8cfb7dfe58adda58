"""The Transformer (paper, section 3): encoder-decoder model for sequence transduction."""

from __future__ import annotations

import copy
import warnings

import keras
from keras import ops

from keras_transformer import _checks, _compat, decoding
from keras_transformer.backend.compile import FunctionCache, compile_search
from keras_transformer import ops as kt_ops
from keras_transformer.defaults import BEAM_SIZE, END_ID, LENGTH_PENALTY, MAX_EXTRA_LENGTH, PAD_ID, PRESETS, START_ID
from keras_transformer.layers.embedding import SinusoidalEmbedding
from keras_transformer.layers.stacks import Decoder, Encoder


def first_search_length(source_length):
    """The output room `translate` (and an exported translator) searches with first:
    `S + max(16, S // 2)` for sources `S` tokens wide. An int, or a tensor for a tensor."""
    if isinstance(source_length, int):
        return source_length + max(16, source_length // 2)
    return source_length + ops.maximum(16, source_length // 2)


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
        special = {"pad_id": pad_id, "start_id": start_id, "end_id": end_id}
        for arg, value in special.items():
            if not isinstance(value, int) or not 0 <= value < vocab_size:
                raise ValueError(
                    f"Model '{self.name}': `{arg}` must be a token id in [0, vocab_size={vocab_size}). "
                    f"Received: {arg}={value!r}"
                )
        if len(set(special.values())) != 3:
            raise ValueError(f"Model '{self.name}': the special ids must differ. Received: {special}")
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

        On PyTorch, `compile(jit_compile=True)` trains eagerly, with one warning. Keras
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
            warnings.warn(
                f"Model '{self.name}': jit_compile=True on PyTorch would wrap the training step in "
                "torch.compile, which breaks the graph inside Keras' layers and is slower than eager "
                "on this model (keras-team/keras#21851); training runs eagerly.",
                RuntimeWarning,
                stacklevel=3,
            )
            value = False
        keras.Model.jit_compile.fset(self, value)

    def build(self, inputs_shape=None):
        sequence_shape = (None, None, self.d_model)
        for emb in {id(e): e for e in (self.source_embedding, self.target_embedding)}.values():
            emb.build((None, None))
        self.encoder.build(sequence_shape)
        self.decoder.build(sequence_shape, sequence_shape)
        if self.output_projection is not None:
            self.output_projection.build(sequence_shape)
        self.built = True

    def make_train_function(self, force=False):
        self._build_training_state()
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

    def search(
        self,
        source_ids,
        max_length,
        beam_size: int = BEAM_SIZE,
        length_penalty: float = LENGTH_PENALTY,
        min_length: int = 0,
        use_cache: bool = True,
        num_hypotheses: int = 1,
        *,
        call=None,
        while_loop=None,
        bound_length=None,
        return_complete: bool = False,
    ):
        """Greedy (`beam_size=1`) or beam search, traceable: the body of `translate`.

        `max_length` may be a tensor (the exporter traces it from the input's length).
        Returns `(tokens (B, max_length), scores (B,))`; greedy scores are zeros. With
        `num_hypotheses=n > 1` (beam search), `(B, n, max_length)` and `(B, n)`.
        `bound_length` and `return_complete` (a third result) are the searches' own,
        see `keras_transformer.decoding.beam_search`.

        `call(fn, *args)` runs the encoder call (defaults to `fn(*args)`) and
        `while_loop` the search's loop (defaults to `keras.ops.while_loop`): the two
        places where PyTorch's compiled search runs exported programs instead
        (`keras_transformer.backend.torch_decoding`).
        """
        source_ids = ops.convert_to_tensor(source_ids, "int32")
        call = call or (lambda fn, *args: fn(*args))
        if use_cache:
            step, cache = self.step, call(self.init_cache, source_ids, max_length)
        else:
            encoder_output, source_mask = call(self.encode, source_ids)
            step, cache = self.uncached_step, {"encoder_output": encoder_output, "source_mask": source_mask}
        batch = ops.shape(source_ids)[0]
        special = dict(start_id=self.start_id, end_id=self.end_id, pad_id=self.pad_id, min_length=min_length)
        if beam_size == 1:
            tokens, complete = decoding.greedy_search(step, cache, batch, max_length, while_loop=while_loop,
                                                      return_complete=True, **special)
            result = tokens, ops.zeros((batch,), "float32"), complete
        else:
            result = decoding.beam_search(
                step, cache, batch, max_length, beam_size=beam_size, length_penalty_alpha=length_penalty,
                num_hypotheses=num_hypotheses, while_loop=while_loop, bound_length=bound_length,
                return_complete=True, **special,
            )
        return result if return_complete else result[:2]

    def translate(
        self,
        source_ids,
        beam_size: int = BEAM_SIZE,
        length_penalty: float = LENGTH_PENALTY,
        max_extra_length: int = MAX_EXTRA_LENGTH,
        *,
        max_length: int | None = None,
        min_length: int = 0,
        use_cache: bool = True,
        return_scores: bool = False,
        num_hypotheses: int = 1,
        compile: bool | str = True,
    ):
        """Beam search (section 6.1): the best output ids for each source row.

        The search is compiled for the backend (`jax.jit`, XLA-compiled `tf.function`;
        on PyTorch its encoder call and one loop iteration are exported with
        `torch.export` and replayed) once per batch size, length and setting, and kept
        with the model (the last 8). One model may translate from several threads at
        once.

        Every step reads and reorders a cache as long as the longest output allowed,
        and most outputs end long before it: the search runs first with room for
        `S + max(16, S // 2)` tokens (if `min_length` fits), under the stopping rule
        of the full length. If it ended in time (every output finished, and no live
        hypothesis could still win), that is the full search's result; otherwise the
        full search runs.

        Args:
            source_ids: Integer `(B, S)`, padded with `pad_id`.
            beam_size: Defaults to `4` (the paper). `1` is greedy decoding.
            length_penalty: alpha of the GNMT penalty `((5 + |Y|) / 6)^alpha`.
                Defaults to `0.6` (the paper).
            max_extra_length: Longest output = `S + max_extra_length`. Defaults to `50`.
            max_length: Longest output, instead of `S + max_extra_length`.
            min_length: No `[END]` before this many tokens. Defaults to `0`.
            use_cache: Use the KV cache. `False` re-runs the decoder over the whole
                prefix at every step (same tokens, slower: for checks and benchmarks).
            return_scores: Also return the `(B,)` scores `log P / lp` (zeros for greedy).
            num_hypotheses: n, the size of the n-best list per row, at most
                `beam_size`. Defaults to `1`.
            compile: Run the compiled search. `False` runs the same search eagerly,
                op by op, on every backend (same tokens; a way out when compiling
                fails). A search that cannot be compiled also runs eagerly, with one
                warning naming the reason. On PyTorch, `"torch.compile"` also compiles
                the exported programs with `torch.compile` (faster steps, seconds of
                compilation per shape; see `keras_transformer.backend.torch_decoding`).
                Defaults to `True`.

        Returns:
            Integer `(B, max_length)`: output tokens, `[END]`, then `pad_id`; and the
            scores if `return_scores`. With `num_hypotheses=n > 1`: `(B, n, max_length)`
            best first, and `(B, n)` scores.
        """
        _checks.beam(beam_size, num_hypotheses)
        source_ids = ops.convert_to_tensor(source_ids)
        if "int" not in keras.backend.standardize_dtype(source_ids.dtype):
            raise ValueError(f"`source_ids` must be integer token ids. Received: dtype={source_ids.dtype}")
        if len(source_ids.shape) != 2:
            raise ValueError(f"`source_ids` must be (batch, length). Received: shape={tuple(source_ids.shape)}")
        if not self.built:
            self.build()
        max_length = int(source_ids.shape[1] + max_extra_length if max_length is None else max_length)
        mode = "default" if compile is True else compile

        source_ids = ops.cast(source_ids, "int32")
        settings = (int(beam_size), float(length_penalty), int(min_length), bool(use_cache), num_hypotheses)
        # Most outputs end long before the longest allowed: searching first with a short
        # buffer (what every step reads and reorders) gives the same result when it
        # ends in time, and the full search runs only when it did not.
        first = min(max_length, first_search_length(int(source_ids.shape[1])))
        short = min_length <= first < max_length  # an output must have room for `[END]`
        for length in ([first] if short else []) + [max_length]:
            tokens, scores, complete = self._run_search(source_ids, length, max_length, settings, compile, mode)
            if length == max_length or bool(ops.convert_to_numpy(complete)):
                break
        if length < max_length:
            padding = [[0, 0]] * (len(tokens.shape) - 1) + [[0, max_length - length]]
            tokens = ops.pad(tokens, padding, constant_values=self.pad_id)
        return (tokens, scores) if return_scores else tokens

    def _run_search(self, source_ids, length, bound_length, settings, compile, mode):
        """`search` with a buffer of `length`, compiled once per settings and variables."""
        if compile is False:
            return self.search(source_ids, length, *settings, while_loop=decoding.eager_while_loop,
                               bound_length=bound_length, return_complete=True)
        # A compiled search holds the variables it was made with: a model whose variables
        # were replaced since (`quantize`, LoRA) gets a new one.
        variables = self.variables

        def make():
            def search(ids, **runner):
                return self.search(ids, length, *settings, bound_length=bound_length, return_complete=True, **runner)

            return compile_search(search, variables, name=f"search of model '{self.name}'", mode=mode)

        key = (length, bound_length, *settings, mode, tuple(map(id, variables)))
        return self._searches.get(key, make)(source_ids)

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

