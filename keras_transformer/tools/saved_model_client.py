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


def translate(saved_model, texts, signature: str = "translate") -> list[str]:
    """The SavedModel's translations of `texts` (a list of strings) by `signature`."""
    import tensorflow as tf
    import tensorflow_text  # noqa: F401 - registers the tokenizer's ops

    translator = tf.saved_model.load(str(saved_model))
    outputs = translator.signatures[signature](texts=tf.constant(list(texts), tf.string))["translation"]
    return [t.decode("utf-8") for t in outputs.numpy()]


def main(argv=None) -> int:
    saved_model, texts = (sys.argv[1:] if argv is None else argv)[:2]
    result = {name: translate(saved_model, json.loads(texts), name) for name in SIGNATURES}
    result["imported_keras_transformer"] = "keras_transformer" in sys.modules
    print(json.dumps(result, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
