"""keras-transformer: the Transformer of "Attention Is All You Need" as Keras 3 layers.

The same code runs on the TensorFlow, JAX and PyTorch backends; choose one with the
`KERAS_BACKEND` environment variable before importing Keras.
"""

from keras_transformer import layers, models, ops

__version__ = "0.1.0"

__all__ = ["layers", "models", "ops", "__version__"]
