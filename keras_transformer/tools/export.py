"""Export a trained Transformer as a TensorFlow SavedModel that translates strings.

The SavedModel's signature `translate` (also `serving_default`) maps a batch of strings
(`tf.string`, shape `[None]`) to `{"translation": tf.string [None]}`: the tokenizer
(SentencePiece or WordPiece), the beam search (with its KV cache) and the detokenizer
all run inside the graph, so TensorFlow Serving or `tf.saved_model.load` need nothing else (but
`import tensorflow_text` to register its ops).

A SavedModel is a TensorFlow artifact. When the running backend is JAX or PyTorch, the
model is saved to `.keras` and exported by the TensorFlow backend in a child process:
one artifact, whatever backend trained the model.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

import keras

from keras_transformer import _checks
from keras_transformer.defaults import (BEAM_SIZE, LENGTH_PENALTY, MAX_EXTRA_LENGTH, MAX_INPUT_LENGTH,
                                        MAX_LENGTH_PENALTY)
from keras_transformer.tools import atomic, files


def export_translator(model, tokenizer, path, beam_size: int = BEAM_SIZE, length_penalty: float = LENGTH_PENALTY,
                      max_extra_length: int = MAX_EXTRA_LENGTH,
                      max_input_length: int | None = MAX_INPUT_LENGTH) -> pathlib.Path:
    """Write a SavedModel at `path` that translates strings to strings.

    Args:
        model: A trained `keras_transformer.models.Transformer` (any backend).
        tokenizer: The `keras_transformer.text.Tokenizer` it was trained with.
        path: Output directory.
        beam_size: Defaults to `4` (the paper).
        length_penalty: alpha of the GNMT length penalty. Defaults to `0.6` (the paper).
        max_extra_length: Longest output = input length + this. Defaults to `50`.
        max_input_length: A longer input is cut to its first this many tokens, as
            `evaluation.translate_texts` and CTranslate2 do (self-attention's memory grows
            with the square of the length: one request must not exhaust a server's).
            Defaults to `1024`; `None`: no limit.

    Returns:
        The path written.

    Raises:
        ValueError: if the tokenizer's vocabulary size or special ids differ from the
            model's, a search setting is out of range, or `path` is a file or a directory
            that holds anything but an earlier SavedModel (the export replaces it whole).
    """
    from keras_transformer.tools.evaluation import check_special_ids

    check_special_ids(model, tokenizer)  # a ValueError naming both values
    beam_size, _ = _checks.beam(beam_size, 1, model.vocab_size)
    _checks.length_penalties(length_penalty=length_penalty)
    if length_penalty > MAX_LENGTH_PENALTY:  # a SavedModel takes inputs of any length
        raise ValueError(f"`length_penalty` must be at most {MAX_LENGTH_PENALTY} in a SavedModel, which translates "
                         f"inputs of any length (defaults.MAX_LENGTH_PENALTY). Received: length_penalty={length_penalty!r}")
    max_extra_length = _checks.counts(max_extra_length=max_extra_length)
    max_input_length = _checks.positive_ints(max_input_length=max_input_length, optional=True)
    files.check_replacement(path, "savedmodel")
    path = pathlib.Path(path)
    if keras.backend.backend() == "tensorflow":
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic.atomic_write(path) as tmp:  # a failed export leaves the old SavedModel
            _export_here(model, tokenizer, tmp, beam_size, length_penalty, max_extra_length, max_input_length)
        return path
    with tempfile.TemporaryDirectory() as tmp:
        model.save(os.path.join(tmp, "model.keras"))
        tokenizer.save(os.path.join(tmp, "tokenizer"))
        export_files(os.path.join(tmp, "model.keras"), os.path.join(tmp, "tokenizer"), path,
                     beam_size, length_penalty, max_extra_length, max_input_length)
    return path


def export_files(model_file, tokenizer_dir, path, beam_size=BEAM_SIZE, length_penalty=LENGTH_PENALTY,
                 max_extra_length=MAX_EXTRA_LENGTH, max_input_length=MAX_INPUT_LENGTH):
    """Export from files (`.keras` model, tokenizer directory) with the TensorFlow backend,
    in a child process."""
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    command = [
        sys.executable, "-m", "keras_transformer.tools.export", str(model_file), str(tokenizer_dir), str(path),
        "--beam-size", str(beam_size), "--length-penalty", str(length_penalty),
        "--max-extra-length", str(max_extra_length), "--max-input-length", str(max_input_length or 0),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"Export with the TensorFlow backend failed:\n{result.stderr[-4000:]}")


def cut_inputs(ids, max_input_length: int | None):
    """Ragged ids `(B, None)` with each row cut to its first `max_input_length` (`None`: as
    they are)."""
    return ids if max_input_length is None else ids[:, :max_input_length]


def _export_here(model, tokenizer, path, beam_size, length_penalty, max_extra_length, max_input_length):
    import tensorflow as tf

    from keras_transformer.models.translating import first_search_length

    def translate(texts):
        ids = cut_inputs(tokenizer.tokenize(texts), max_input_length)  # ragged (B, None) int64
        lengths = ids.row_lengths()
        # At least one position, so that a batch of empty strings still has a shape.
        width = tf.maximum(tf.reduce_max(tf.concat([lengths, [0]], 0)), 1)
        shape = tf.stack([tf.size(lengths, tf.int64), width])
        source = tf.cast(ids.to_tensor(default_value=tokenizer.pad_id, shape=shape), tf.int32)
        # As `Transformer.translate`: a search with a short buffer first, under the stopping
        # rule of the full length; the full search only if that one did not end in time.
        max_length = tf.shape(source)[1] + max_extra_length
        first = tf.minimum(max_length, first_search_length(tf.shape(source)[1]))
        short, _, complete = model.search(source, first, beam_size, length_penalty, bound_length=max_length,
                                          return_complete=True, greedy_scores=False)
        tokens = tf.cond(complete, lambda: short,
                         lambda: model.search(source, max_length, beam_size, length_penalty, greedy_scores=False)[0])
        text = tokenizer.detokenize(tf.RaggedTensor.from_tensor(tf.cast(tokens, tf.int64)))
        # An empty input translates to an empty string.
        return {"translation": tf.where(lengths > 0, text, tf.constant(""))}

    # tf.saved_model.save rather than keras.export.ExportArchive: the archive traces the
    # function once to list the variables it uses and the save traces it again (the
    # save's context is part of tf.function's cache key): the beam search and both
    # tokenizers, twice. Here the save traces it once for both signatures.
    translate = tf.function(translate, input_signature=[tf.TensorSpec([None], tf.string, name="texts")],
                            autograph=False)
    root = tf.Module()
    root.tokenizer = tokenizer
    root.model_variables = [v.value for v in model.variables]  # tf.Variables on this backend
    root.translate = translate
    tf.saved_model.save(root, str(path), signatures={"translate": translate, "serving_default": translate})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Export a .keras Transformer and its tokenizer as a SavedModel.")
    parser.add_argument("model_file")
    parser.add_argument("tokenizer_dir")
    parser.add_argument("path")
    parser.add_argument("--beam-size", type=int, default=BEAM_SIZE)
    parser.add_argument("--length-penalty", type=float, default=LENGTH_PENALTY)
    parser.add_argument("--max-extra-length", type=int, default=MAX_EXTRA_LENGTH)
    parser.add_argument("--max-input-length", type=int, default=MAX_INPUT_LENGTH, help="0: no limit")
    args = parser.parse_args(argv)
    if keras.backend.backend() != "tensorflow":
        raise SystemExit("The exporter's child process must run with KERAS_BACKEND=tensorflow.")
    from keras_transformer.tools.text import Tokenizer

    model = keras.saving.load_model(args.model_file)
    tokenizer = Tokenizer.load(args.tokenizer_dir)
    export_translator(model, tokenizer, args.path, args.beam_size, args.length_penalty, args.max_extra_length,
                      args.max_input_length or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
