"""Export a trained Transformer to CTranslate2, the C++ inference engine for Transformers.

The export fills `ctranslate2.specs.TransformerSpec` from the model's weights and lets
CTranslate2's own converter write the model (`model.bin`, the vocabularies and
`config.json`), quantized as asked (`int8`, `int8_float32`, `float16`, ...). The
directory also holds the run's SentencePiece model and a README with the lines that
translate from Python with `ctranslate2` and `sentencepiece` alone.

What is carried over, and how:

* post-norm (`LayerNorm(x + Sublayer(x))`, `pre_norm=False`) or pre-norm with its final
  LayerNorm; ReLU or GELU; the model's LayerNorm epsilon;
* embeddings x sqrt(d_model) (`scale_embeddings`); the interleaved sinusoids
  (`PE[pos, 2i] = sin`, `PE[pos, 2i+1] = cos`) written out as an explicit position table,
  computed by the model's own `SinusoidalPositionalEncoding` (CTranslate2's built-in
  table puts all sines before all cosines);
* the tied matrix as source embedding, target embedding and output projection (or the
  three matrices of an untied model);
* the special tokens by name: `[START]` opens the decoder, `[END]` ends it; the output
  projection's bias is -1e4 for `[PAD]` and `[START]`, which our search never produces
  (a probability of exp(-1e4), 0 in any float type; -1e9 overflowed float16's range in the
  `*float16` weight types, with NumPy's warning on the terminal).

Refused with the reason: a WordPiece tokenizer (its detokenizer is TensorFlow Text's; use
the SavedModel), restricted self-attention (`window`), another activation.

Greedy search gives our greedy tokens. Beam search differs in its length penalty:
CTranslate2 divides the log-probability by `length ** length_penalty`, GNMT by
`((5 + length) / 6) ** alpha`; the README gives the closest setting.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

# Keras is imported inside the functions that read a model: the command line's checks
# (`quantizations`, `check_tokenizer_kind`) run before any backend loads.
from keras_transformer.tools import atomic, files

FORMAT = "ctranslate2"
_ACTIVATIONS = ("relu", "gelu")


class CTranslate2Error(ValueError):
    """A model or run CTranslate2 cannot serve as it is; the message says why."""


# The weight types CTranslate2's converter accepts: its `specs.model_spec.ACCEPTED_MODEL_TYPES`,
# written here because importing that module imports PyTorch when it is installed, and the
# command line checks `--quantization` before any backend loads. tests/test_ctranslate2.py
# fails when the two differ.
QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16", "float32")


def quantizations() -> tuple[str, ...]:
    """The weight types CTranslate2's converter accepts.

    Raises:
        ImportError: `ctranslate2` is not installed (found without importing it).
    """
    import importlib.util

    if importlib.util.find_spec("ctranslate2") is None:
        raise ImportError("No module named 'ctranslate2'")
    return QUANTIZATIONS


def check_tokenizer_kind(kind: str) -> None:
    """Refuse a tokenizer CTranslate2 cannot be served with (needs no backend)."""
    if kind != "sentencepiece":
        raise CTranslate2Error(
            f"the run's tokenizer is {kind}, and a CTranslate2 model is served with "
            "SentencePiece alone (a WordPiece tokenizer detokenizes with TensorFlow Text): export this run "
            "as a SavedModel (--format savedmodel), or train with --tokenizer sentencepiece"
        )


def check_exportable(model, tokenizer) -> None:
    """Refuse what CTranslate2 cannot serve the way `translate` does, with the reason."""
    check_tokenizer_kind(tokenizer.kind)
    activation = getattr(model.activation, "__name__", model.activation)
    if activation not in _ACTIVATIONS:
        raise CTranslate2Error(f"CTranslate2's Transformer has ReLU or GELU feed-forward layers; this model "
                               f"uses {activation!r}")
    for block in [*model.encoder.blocks, *model.decoder.blocks]:
        if getattr(block.self_attention, "window", None) is not None:
            raise CTranslate2Error(
                f"{block.name} uses restricted self-attention (window={block.self_attention.window}), which "
                "CTranslate2's Transformer cannot express; export a SavedModel instead"
            )


def export_ctranslate2(model, tokenizer, path, quantization: str | None = None,
                       max_positions: int = 1024) -> pathlib.Path:
    """Write a CTranslate2 model of `model` and its SentencePiece model to `path`.

    Args:
        model: A trained `keras_transformer.models.Transformer`.
        tokenizer: Its `SentencePieceTokenizer`.
        path: The output directory (written as one unit: all files or none).
        quantization: CTranslate2's weight type (`"int8"`, `"int8_float32"`,
            `"float16"`, ...; see `quantizations()`). Defaults to `None` (the saved
            float32 weights).
        max_positions: Rows of the position table: the longest source and output.
            Defaults to `1024`.

    Returns:
        The path written.

    Raises:
        CTranslate2Error: The run cannot be served by CTranslate2 (see `check_exportable`).
        ValueError: `path` is a file, or a directory that holds anything but an earlier
            CTranslate2 model (the export replaces it whole).
    """
    from keras_transformer.tools.evaluation import check_special_ids

    check_special_ids(model, tokenizer)
    check_exportable(model, tokenizer)
    files.check_replacement(path, "ctranslate2")
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic.atomic_write(path) as tmp:
        convert_model(model, tokenizer.vocabulary, tmp, quantization, max_positions)
        model_file = tokenizer.MODEL_FILE
        (tmp / model_file).write_bytes(tokenizer.model_proto)
        (tmp / "keras_transformer.json").write_text(json.dumps(
            {"lower_case": tokenizer.lower_case, "sentencepiece_model": model_file, "quantization": quantization,
             "max_positions": max_positions}, indent=2) + "\n")
        (tmp / "README.md").write_text(serving_instructions(path, tokenizer.lower_case))
    return path


def convert_model(model, vocabulary, path, quantization: str | None = None, max_positions: int = 1024) -> None:
    """Write the CTranslate2 files of `model` (`model.bin`, the vocabulary, `config.json`)
    to the directory `path`, with CTranslate2's converter.

    `vocabulary` is the token string of every id (one vocabulary for source and target);
    the special tokens are the model's `start_id` and `end_id`, and `[UNK]` at id 1 if the
    vocabulary has it. `export_ctranslate2` adds the tokenizer and checks the model.
    """
    import ctranslate2

    spec = _spec(model, list(vocabulary), max_positions)

    class Converter(ctranslate2.converters.Converter):
        def _load(self):
            return spec

    Converter().convert(str(path), quantization=quantization, force=True)


def serving_instructions(path, lower_case: bool) -> str:
    """How to translate with the exported directory, with `ctranslate2` and `sentencepiece` only."""
    lower = ".lower()" if lower_case else ""
    return f"""# A keras-transformer model for CTranslate2

Translate from Python with `pip install ctranslate2 sentencepiece` and nothing else:

```python
import ctranslate2
import sentencepiece

directory = "{path}"
translator = ctranslate2.Translator(directory, device="cpu")  # or "cuda"
sp = sentencepiece.SentencePieceProcessor(model_file=f"{{directory}}/sentencepiece.model")

sentences = ["Ein Satz.", "Noch einer."]
pieces = [sp.encode(s{lower}, out_type=str) for s in sentences]
results = translator.translate_batch(pieces, beam_size=4, max_decoding_length=256)
print([sp.decode(r.hypotheses[0]) for r in results])
```

Greedy search (`beam_size=1`) gives the tokens of keras-transformer's greedy search.
Beam search scores hypotheses with `log P / length ** length_penalty` (default
`length_penalty=1`); keras-transformer uses GNMT's `((5 + length) / 6) ** 0.6`. The two
rank hypotheses of similar length alike; `length_penalty=1` is the closest setting.
keras-transformer stops at the source length + 50 tokens: pass
`max_decoding_length=len(longest source) + 50` for the same limit.
"""


def _spec(model, vocabulary: list, max_positions: int):
    import keras
    from ctranslate2.specs import common_spec, transformer_spec

    from keras_transformer.layers import SinusoidalPositionalEncoding

    activation = getattr(model.activation, "__name__", model.activation)
    spec = transformer_spec.TransformerSpec.from_config(
        (model.num_layers, model.num_layers), model.num_heads, pre_norm=bool(model.norm_first),
        activation=common_spec.Activation.RELU if activation == "relu" else common_spec.Activation.GELU,
    )
    spec.config.layer_norm_epsilon = float(model.layer_norm_epsilon)
    spec.config.bos_token = vocabulary[model.start_id]
    spec.config.decoder_start_token = vocabulary[model.start_id]
    spec.config.eos_token = vocabulary[model.end_id]
    if "[UNK]" in vocabulary:
        spec.config.unk_token = "[UNK]"
    # The model's own sinusoids: PE[pos] for pos < max_positions.
    encoding = SinusoidalPositionalEncoding(max_wavelength=model.max_wavelength, dtype="float32")
    table = _numpy(encoding(keras.ops.zeros((1, max_positions, model.d_model))))[0]

    source = _numpy(model.source_embedding.embeddings)
    target = _numpy(model.target_embedding.embeddings)
    spec.encoder.embeddings[0].weight = source
    spec.encoder.position_encodings.encodings = table
    spec.decoder.embeddings.weight = target
    spec.decoder.position_encodings.encodings = table
    if model.output_projection is None:
        spec.decoder.projection.weight = target
    else:
        spec.decoder.projection.weight = _numpy(model.output_projection.kernel).T
    bias = np.zeros(model.vocab_size, "float32")
    bias[[model.pad_id, model.start_id]] = -1e4  # never produced, as in our search; within float16's range
    spec.decoder.projection.bias = bias

    for layer, block in zip(spec.encoder.layer, model.encoder.blocks):
        _attention(layer.self_attention, block.self_attention, block.self_attention_norm, fused="qkv")
        _ffn(layer.ffn, block.feed_forward, block.feed_forward_norm)
    for layer, block in zip(spec.decoder.layer, model.decoder.blocks):
        _attention(layer.self_attention, block.self_attention, block.self_attention_norm, fused="qkv")
        _attention(layer.attention, block.cross_attention, block.cross_attention_norm, fused="kv")
        _ffn(layer.ffn, block.feed_forward, block.feed_forward_norm)
    if model.norm_first:
        _norm(spec.encoder.layer_norm, model.encoder.final_norm)
        _norm(spec.decoder.layer_norm, model.decoder.final_norm)
    spec.register_source_vocabulary(vocabulary)
    spec.register_target_vocabulary(vocabulary)
    return spec


def _numpy(x) -> np.ndarray:
    import keras

    return np.asarray(keras.ops.convert_to_numpy(x), dtype="float32")


def _linear(spec, dense) -> None:
    # Keras' Dense holds (in, out); CTranslate2's Linear, like torch.nn.Linear, (out, in).
    spec.weight = _numpy(dense.kernel).T
    if dense.use_bias:
        spec.bias = _numpy(dense.bias)


def _fused(spec, denses) -> None:
    spec.weight = np.concatenate([_numpy(d.kernel).T for d in denses], axis=0)
    if denses[0].use_bias:
        spec.bias = np.concatenate([_numpy(d.bias) for d in denses], axis=0)


def _norm(spec, norm) -> None:
    spec.gamma = _numpy(norm.gamma)
    spec.beta = _numpy(norm.beta)


def _attention(spec, attention, norm, fused: str) -> None:
    if fused == "qkv":
        _fused(spec.linear[0], [attention.query_dense, attention.key_dense, attention.value_dense])
    else:
        _linear(spec.linear[0], attention.query_dense)
        _fused(spec.linear[1], [attention.key_dense, attention.value_dense])
    _linear(spec.linear[-1], attention.output_dense)
    _norm(spec.layer_norm, norm)


def _ffn(spec, ffn, norm) -> None:
    _linear(spec.linear_0, ffn.inner_dense)
    _linear(spec.linear_1, ffn.outer_dense)
    _norm(spec.layer_norm, norm)
