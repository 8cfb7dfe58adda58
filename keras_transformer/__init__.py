"""keras-transformer: the Transformer of "Attention Is All You Need" as Keras 3 layers.

The same code runs on the TensorFlow, JAX and PyTorch backends; choose one with the
`KERAS_BACKEND` environment variable before importing Keras.
"""

import importlib

from keras_transformer import callbacks, decoding, distribution, layers, losses, metrics, models, ops, schedules

__version__ = "0.1.0"

__all__ = [
    "callbacks", "decoding", "distribution", "layers", "losses", "metrics", "models", "ops", "schedules", "text", "export",
    "__version__",
]


def __getattr__(name):
    # `text` and `export` need TensorFlow and TensorFlow Text (the `text` extra):
    # import them on use.
    if name in ("text", "export"):
        return importlib.import_module(f"keras_transformer.{name}")
    raise AttributeError(f"module 'keras_transformer' has no attribute {name!r}")
