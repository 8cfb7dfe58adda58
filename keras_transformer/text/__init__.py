"""Text: WordPiece tokenizer, corpora and the tf.data input pipeline.

This sub-package needs TensorFlow and TensorFlow Text (the `text` extra), whatever
Keras backend trains the model.
"""

from keras_transformer.text import corpora, datasets
from keras_transformer.text.tokenizer import (
    END_ID,
    PAD_ID,
    RESERVED_TOKENS,
    START_ID,
    UNK_ID,
    Tokenizer,
)

__all__ = ["corpora", "datasets", "END_ID", "PAD_ID", "RESERVED_TOKENS", "START_ID", "UNK_ID", "Tokenizer"]
