"""The paper's layers, usable on their own inside any Keras model."""

from keras_transformer.layers.attention import MultiHeadAttention
from keras_transformer.layers.blocks import DecoderBlock, EncoderBlock
from keras_transformer.layers.embedding import SinusoidalEmbedding, SinusoidalPositionalEncoding
from keras_transformer.layers.feed_forward import PositionwiseFFN
from keras_transformer.layers.stacks import Decoder, Encoder

__all__ = [
    "Decoder",
    "DecoderBlock",
    "Encoder",
    "EncoderBlock",
    "MultiHeadAttention",
    "PositionwiseFFN",
    "SinusoidalEmbedding",
    "SinusoidalPositionalEncoding",
]
