"""`keras-transformer export`: a SavedModel, or a CTranslate2 model with --format ctranslate2."""

from __future__ import annotations

import os
import pathlib

from keras_transformer.defaults import BEAM_SIZE, LENGTH_PENALTY, MAX_INPUT_LENGTH
from keras_transformer.tools.commands.common import (add_command, check_writable, decoding_flags, load_run,
                                                      path, quantize_flag, run_dir_flag)
from keras_transformer.tools.config import RunError
from keras_transformer.tools.files import replacement_problem, run_model_file, tokenizer_kind


def add_parser(sub) -> None:
    p = add_command(
        sub,
        "export",
        help="Write a SavedModel (or a CTranslate2 model) that translates strings to strings.",
        description="Export a training run as a TensorFlow SavedModel whose `translate` signature "
                    "maps a batch of strings to a batch of strings (tokenizer, beam search and "
                    "detokenizer inside; runs the TensorFlow backend in a child process when "
                    "KERAS_BACKEND is jax or torch), or with --format ctranslate2 as a CTranslate2 "
                    "model directory with the run's SentencePiece model.",
    )
    run_dir_flag(p)
    p.add_argument("--output", type=path, default="artifacts/translator", help="Directory to write.")
    p.add_argument("--format", choices=("savedmodel", "ctranslate2"), default="savedmodel",
                   help="savedmodel: TensorFlow Serving, strings in and out. ctranslate2: the CTranslate2 "
                        "engine (needs the `ctranslate2` extra; SentencePiece runs only).")
    p.add_argument("--quantization", metavar="TYPE",
                   help="ctranslate2 only: CTranslate2's weight type, e.g. int8, int8_float32, float16 "
                        "[default: the float32 weights]")
    decoding_flags(p, batch=False)
    quantize_flag(p, "exporting the SavedModel")
    p.set_defaults(handler=run, check=check)


def check(args) -> None:
    check_writable("--output", args.output, args.run_dir)
    check_replaceable(args.output, args.format)
    if args.format != "ctranslate2":
        if args.quantization is not None:
            raise RunError("--quantization applies to --format ctranslate2 only (--quantize int8 quantizes the "
                           "SavedModel's Dense layers with Keras)")
    elif args.quantize is not None:
        raise RunError("--quantize is Keras' quantization of the SavedModel; for CTranslate2 give its weight type "
                       "with --quantization, e.g. --quantization int8")
    elif (args.beam_size, args.length_penalty, args.max_input_length) != (BEAM_SIZE, LENGTH_PENALTY, MAX_INPUT_LENGTH):
        raise RunError("--beam-size, --length-penalty and --max-input-length are the SavedModel's search settings; a "
                       "CTranslate2 model takes beam_size, length_penalty and max_input_length each time it "
                       "translates (translate_batch; the README the export writes shows them)")
    else:
        from keras_transformer.tools.ctranslate2_export import CTranslate2Error, check_tokenizer_kind, quantizations

        try:
            known = quantizations()
        except ImportError:
            raise RunError("--format ctranslate2 needs the ctranslate2 package: pip install "
                           "'keras-transformer[ctranslate2]'") from None
        if args.quantization is not None and args.quantization not in known:
            raise RunError(f"--quantization {args.quantization or repr(args.quantization)} is not a CTranslate2 "
                           f"weight type; known: {', '.join(known)}")
        kind = tokenizer_kind(pathlib.Path(args.run_dir) / "tokenizer")
        if kind is not None:  # unreadable: loading the run reports that
            try:
                check_tokenizer_kind(kind)
            except CTranslate2Error as e:
                raise RunError(str(e)) from None
    run_model_file(args.run_dir, args.model)


def check_replaceable(output, format) -> None:
    """Refuse an output the export may not replace as a whole (`files.replacement_problem`)."""
    problem = replacement_problem(output, format)
    if problem:
        raise RunError(f"--output {output} {problem}")


def run(args) -> int:
    from keras_transformer.tools import export

    model, tokenizer = load_run(args)
    if args.format == "ctranslate2":
        from keras_transformer.tools.ctranslate2_export import (
            CTranslate2Error,
            export_ctranslate2,
            serving_instructions as ctranslate2_instructions,
        )

        try:
            export_ctranslate2(model, tokenizer, args.output, quantization=args.quantization)
        except CTranslate2Error as e:
            raise RunError(str(e)) from None
        print(f"CTranslate2 model written to {args.output}" + (f" ({args.quantization})" if args.quantization else ""))
        print(ctranslate2_instructions(os.path.abspath(args.output), tokenizer.lower_case))
        return 0
    export.export_translator(model, tokenizer, args.output, args.beam_size, args.length_penalty,
                             max_input_length=args.max_input_length)
    print(f"SavedModel written to {args.output}" + (f" (Dense layers {args.quantize})" if args.quantize else ""))
    print(serving_instructions(args.output))
    return 0


def serving_instructions(path) -> str:
    path = os.path.abspath(path)
    return f"""Serve it:
  saved_model_cli show --dir {path} --tag_set serve --signature_def translate
  docker run -p 8501:8501 -v {path}:/models/translator/1 -e MODEL_NAME=translator tensorflow/serving
  curl -d '{{"signature_name": "translate", "instances": ["forty-two"]}}' http://localhost:8501/v1/models/translator:predict
Or in Python (no keras_transformer needed):
  import tensorflow as tf, tensorflow_text
  translate = tf.saved_model.load("{path}").signatures["translate"]
  translate(texts=tf.constant(["forty-two"]))["translation"]"""

