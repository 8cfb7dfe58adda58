"""keras-transformer: the Transformer of "Attention Is All You Need" as Keras 3 layers.

The same code runs on the TensorFlow, JAX and PyTorch backends; choose one with the
`KERAS_BACKEND` environment variable before importing Keras.

The library is `ops`, `layers`, `models`, `decoding`, `losses`, `metrics`, `optimizers`,
`schedules` and `distribution`: Keras and one backend, nothing else. They are imported here, so that
`import keras_transformer` registers every layer and model with Keras' serialization and
`keras.saving.load_model` can read a saved `.keras` file. The tools around the library
(training, evaluation, export, the text pipeline, the command line) are
`keras_transformer.tools`, imported on first use; `kt.text`, `kt.export` and
`kt.callbacks` name three of them.
"""

import importlib

from keras_transformer import (
    decoding, defaults, distribution, layers, losses, metrics, models, ops, optimizers, schedules,
)

__version__ = "0.1.0"

# Tools reachable from the top level (they need the `text` extra: TensorFlow, TensorFlow Text).
_TOOLS = ("text", "export", "callbacks")

__all__ = [
    "decoding", "defaults", "distribution", "layers", "losses", "metrics", "models", "ops", "optimizers", "schedules",
    *_TOOLS, "tools", "__version__",
]


def __getattr__(name):
    if name == "tools":
        return importlib.import_module("keras_transformer.tools")
    if name in _TOOLS:
        return importlib.import_module(f"keras_transformer.tools.{name}")
    raise AttributeError(f"module 'keras_transformer' has no attribute {name!r}")
