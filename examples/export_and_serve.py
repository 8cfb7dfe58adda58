"""Export a trained translator as a TensorFlow SavedModel that maps strings to strings.

The SavedModel holds the tokenizer (TensorFlow Text ops), the model and beam search;
serving it needs TensorFlow and TensorFlow Text only, whatever backend trained the
model. Give a run directory from `keras-transformer train` (or from
examples/translate_files.py); without one, a small run is trained first:

    KERAS_BACKEND=torch python examples/export_and_serve.py [--run-dir RUN] [--output translator]
"""

import argparse
import pathlib
import sys
import tempfile

import keras_transformer as kt
from keras_transformer.tools.commands.export import serving_instructions
from keras_transformer.tools.evaluation import load_run

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import translate_files  # noqa: E402  (the example next to this one)


SENTENCES = ["forty-two", "three hundred and seven", "ninety thousand"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=pathlib.Path, help="A finished training run. Default: train one.")
    parser.add_argument("--output", type=pathlib.Path, help="SavedModel directory. Default: a temporary one.")
    parser.add_argument("--train-steps", type=int, default=300, help="Steps of the run trained without --run-dir.")
    parser.add_argument("--train-size", type=int, default=20000)
    args = parser.parse_args(argv)
    work = pathlib.Path(tempfile.mkdtemp(prefix="kt-export-"))
    if args.run_dir is None:
        args.run_dir = work / "run"
        translate_files.main(["--run-dir", str(args.run_dir), "--steps", str(args.train_steps),
                              "--size", str(args.train_size), "--eval-size", "10"])
    output = args.output or work / "translator"

    model, tokenizer = load_run(args.run_dir)
    kt.export.export_translator(model, tokenizer, output, beam_size=4, length_penalty=0.6)
    print(f"SavedModel written to {output}")

    # Reload with plain TensorFlow, as a server would: no keras_transformer involved.
    import tensorflow as tf
    import tensorflow_text  # noqa: F401  (registers the tokenizer's ops)

    translate = tf.saved_model.load(str(output)).signatures["translate"]
    print("signature 'translate':")
    print(f"  inputs:  {translate.structured_input_signature[1]}")
    print(f"  outputs: {translate.structured_outputs}")
    outputs = translate(texts=tf.constant(SENTENCES))["translation"].numpy()
    for source, target in zip(SENTENCES, outputs):
        print(f"  {source}  ->  {target.decode('utf-8')}")
    print(serving_instructions(output))
    return [t.decode("utf-8") for t in outputs]


if __name__ == "__main__":
    main()
