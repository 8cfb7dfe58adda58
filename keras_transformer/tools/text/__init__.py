"""Text: SentencePiece and WordPiece tokenizers, corpora and the tf.data input pipeline.

This sub-package needs TensorFlow and TensorFlow Text (the `text` extra), whatever
Keras backend trains the model.
"""

from keras_transformer.tools.text import corpora, datasets
from keras_transformer.tools.text.tokenizer import (
    RESERVED_TOKENS,
    SentencePieceTokenizer,
    Tokenizer,
    TokenizerError,
    WordPieceTokenizer,
)

__all__ = ["corpora", "datasets", "RESERVED_TOKENS", "SentencePieceTokenizer", "Tokenizer", "TokenizerError", "WordPieceTokenizer"]
