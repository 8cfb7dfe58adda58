"""Translate with an exported SavedModel and plain TensorFlow: what a server runs.

Imports TensorFlow and TensorFlow Text only (never `keras_transformer`), so it also runs
as a script in a process that has nothing else:

    python keras_transformer/tools/saved_model_client.py SAVED_MODEL '["forty-two"]'

prints `{"translate": [...], "serving_default": [...], "imported_keras_transformer": false}`
as one JSON line: the translations of both signatures.
"""

from __future__ import annotations

import json
import sys

SIGNATURES = ("translate", "serving_default")


def load(saved_model):
    """The exported translator at the path `saved_model`: load it once, translate with it
    many times (from any number of threads)."""
    import tensorflow as tf
    import tensorflow_text  # noqa: F401 - registers the tokenizer's ops

    return tf.saved_model.load(str(saved_model))


def translate(saved_model, texts, signature: str = "translate") -> list[str]:
    """The translations of `texts` (a list of strings) by `signature`; `saved_model` is what
    `load` returned, or a path to load it from."""
    import tensorflow as tf

    translator = saved_model if hasattr(saved_model, "signatures") else load(saved_model)
    outputs = translator.signatures[signature](texts=tf.constant(list(texts), tf.string))["translation"]
    return [t.decode("utf-8") for t in outputs.numpy()]


def main(argv=None) -> int:
    path, texts = (sys.argv[1:] if argv is None else argv)[:2]
    translator = load(path)
    result = {name: translate(translator, json.loads(texts), name) for name in SIGNATURES}
    result["imported_keras_transformer"] = "keras_transformer" in sys.modules
    print(json.dumps(result, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
