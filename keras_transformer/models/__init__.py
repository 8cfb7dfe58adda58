"""Models: `Transformer` and its presets."""

from keras_transformer.models.transformer import PRESETS, Transformer

__all__ = ["PRESETS", "Transformer"]
