"""WordPiece tokenization with TensorFlow Text: one vocabulary for source and target.

Tokenization is TensorFlow ops, so it runs inside `tf.data` (which feeds `model.fit` on
every Keras backend) and inside an exported SavedModel.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Iterable, Sequence

import tensorflow as tf
import tensorflow_text as tf_text

PAD, UNK, START, END = "[PAD]", "[UNK]", "[START]", "[END]"
RESERVED_TOKENS = (PAD, UNK, START, END)
PAD_ID, UNK_ID, START_ID, END_ID = 0, 1, 2, 3

# Scripts written without spaces between words. BERT's basic tokenizer splits them
# into one token per character; detokenization joins them back.
_NO_SPACE_SCRIPT = r"[\p{Han}\p{Hiragana}\p{Katakana}\p{Thai}]"


class Tokenizer(tf.Module):
    """WordPiece tokenizer with the reserved tokens `[PAD] [UNK] [START] [END]` at ids 0..3.

    Text is split on whitespace and punctuation (and per character in CJK scripts) by
    TensorFlow Text's `BertTokenizer`, then into word pieces from the vocabulary.
    Unicode is kept as is (NFC-normalised): German umlauts, CJK characters and emoji
    survive a round trip when the vocabulary contains them; anything else becomes
    `[UNK]`. Lower-casing is an option, off by default; it keeps accents.

    Args:
        vocab: The vocabulary, a list of tokens whose first four entries are the
            reserved tokens. Continuation pieces start with `##`.
        lower_case: Lower-case text before tokenizing. Defaults to `False`.

    Example:

    >>> tok = Tokenizer.build(["zwei und vierzig", "forty-two"], vocab_size=60, min_frequency=1)
    >>> ids = tok.tokenize(["forty-two"])
    >>> tok.detokenize(ids).numpy().tolist()
    [b'forty - two']
    """

    def __init__(self, vocab: Sequence[str], lower_case: bool = False):
        super().__init__(name="tokenizer")
        vocab = [str(t) for t in vocab]
        if tuple(vocab[: len(RESERVED_TOKENS)]) != RESERVED_TOKENS:
            raise ValueError(
                f"The vocabulary must start with the reserved tokens {list(RESERVED_TOKENS)}. "
                f"Received: {vocab[:len(RESERVED_TOKENS)]}"
            )
        self.lower_case = bool(lower_case)
        self.vocab = tf.Variable(vocab, trainable=False, name="vocab")
        self._vocab_list = vocab
        table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(vocab), tf.range(len(vocab), dtype=tf.int64)
            ),
            default_value=UNK_ID,
        )
        self._tokenizer = tf_text.BertTokenizer(
            table, token_out_type=tf.int64, unknown_token=UNK, lower_case=False,
            normalization_form="NFC",
        )

    @property
    def vocab_size(self) -> int:
        return len(self._vocab_list)

    @property
    def vocabulary(self) -> list[str]:
        return list(self._vocab_list)

    @classmethod
    def build(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        lower_case: bool = False,
        min_frequency: int = 20,
        learner: str = "tokenizers",
    ) -> "Tokenizer":
        """Learn a WordPiece vocabulary of at most `vocab_size` tokens from `texts`.

        Pass the source and target sides together: one shared vocabulary lets the
        source embedding, target embedding and output projection be one matrix.

        Two learners give vocabularies in the same WordPiece format (continuation
        pieces start with `##`), which the same TensorFlow Text tokenizer then applies:

        * `"tokenizers"` (default): the WordPiece trainer of Hugging Face `tokenizers`,
          written in Rust. A piece is only created from a pair seen at least
          `min_frequency` times, so rare words are not memorised whole.
        * `"tensorflow-text"`: `bert_vocab_from_dataset`. Its Python learner enumerates
          every substring (up to 50 characters) of every distinct word for each step of
          a binary search over count thresholds; on the numbers corpus, whose German
          side is long compounds, it took 82 s for 3,000 sentences (yielding 136
          tokens) and did not finish 100,000 in 12 minutes. Fine for short-word text.

        Args:
            texts: Training sentences, both languages.
            vocab_size: Largest vocabulary size, reserved tokens included.
            lower_case: Lower-case text first. Defaults to `False`.
            min_frequency: Fewest occurrences of a pair to merge it (`"tokenizers"`
                only). Defaults to `20`.
            learner: `"tokenizers"` or `"tensorflow-text"`. Defaults to `"tokenizers"`.
        """
        minimum = len(RESERVED_TOKENS) + 1
        if vocab_size < minimum:
            raise ValueError(
                f"`vocab_size` must be at least {minimum} (the reserved tokens "
                f"{list(RESERVED_TOKENS)} and one more). Received: vocab_size={vocab_size}"
            )
        texts = list(texts)
        if not texts:
            raise ValueError("Cannot build a vocabulary from an empty corpus. Received: 0 texts")
        if lower_case:
            texts = [t.lower() for t in texts]
        if learner == "tokenizers":
            vocab = _learn_with_tokenizers(texts, vocab_size, min_frequency)
        elif learner == "tensorflow-text":
            vocab = _learn_with_tensorflow_text(texts, vocab_size)
        else:
            raise ValueError(
                f"`learner` must be 'tokenizers' or 'tensorflow-text'. Received: learner={learner!r}"
            )
        return cls(vocab[:vocab_size], lower_case=lower_case)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def tokenize(self, texts):
        """Strings `(B,)` -> token ids, a `tf.RaggedTensor` of int64 `(B, None)`.

        No `[START]`/`[END]` are added; the input pipeline and the exporter add them.
        """
        if self.lower_case:
            texts = _lower(texts)
        ids = self._tokenizer.tokenize(texts)  # (B, words, pieces)
        return ids.merge_dims(-2, -1)

    @tf.function(input_signature=[tf.RaggedTensorSpec([None, None], tf.int64)])
    def detokenize(self, ids):
        """Token ids `(B, None)` -> strings `(B,)`. Reserved tokens are dropped, word
        pieces are joined, words are separated by one space (none between CJK
        characters)."""
        ids = tf.ragged.boolean_mask(ids, ids >= len(RESERVED_TOKENS))
        pieces = tf.gather(self.vocab, ids)
        text = tf.strings.reduce_join(pieces, separator=" ", axis=-1)
        text = tf.strings.regex_replace(text, " ##", "")
        # Two passes: each joins every other pair of neighbouring characters.
        for _ in range(2):
            text = tf.strings.regex_replace(
                text, f"({_NO_SPACE_SCRIPT}) ({_NO_SPACE_SCRIPT})", r"\1\2"
            )
        return text

    def tokenize_dense(self, texts) -> tf.Tensor:
        """Convenience: tokenize and pad with `[PAD]` to a dense int32 `(B, T)`."""
        return tf.cast(self.tokenize(tf.constant(list(texts), tf.string)).to_tensor(PAD_ID), tf.int32)

    def detokenize_dense(self, ids) -> list[str]:
        """Convenience: dense or ragged ids (NumPy or tensor) -> a list of Python strings."""
        if not isinstance(ids, tf.RaggedTensor):
            ids = tf.RaggedTensor.from_tensor(tf.cast(tf.convert_to_tensor(ids), tf.int64))
        return [s.decode("utf-8") for s in self.detokenize(tf.cast(ids, tf.int64)).numpy()]

    def save(self, directory: str | os.PathLike) -> None:
        """Write `vocab.txt` (one token per line) and `tokenizer.json` to `directory`."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        _atomic_write(directory / "vocab.txt", "\n".join(self._vocab_list) + "\n")
        _atomic_write(
            directory / "tokenizer.json",
            json.dumps({"lower_case": self.lower_case, "vocab_size": self.vocab_size}, indent=2),
        )

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Tokenizer":
        """Read a tokenizer written by `save`."""
        directory = pathlib.Path(directory)
        vocab_file, config_file = directory / "vocab.txt", directory / "tokenizer.json"
        for f in (vocab_file, config_file):
            if not f.is_file():
                raise FileNotFoundError(f"No tokenizer in {directory}: missing {f.name}")
        config = json.loads(config_file.read_text(encoding="utf-8"))
        vocab = vocab_file.read_text(encoding="utf-8").split("\n")[:-1]
        if len(vocab) != config["vocab_size"]:
            raise ValueError(
                f"{vocab_file} holds {len(vocab)} tokens but {config_file.name} says "
                f"{config['vocab_size']}."
            )
        return cls(vocab, lower_case=config["lower_case"])


def _learn_with_tokenizers(texts: list[str], vocab_size: int, min_frequency: int) -> list[str]:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    learner = HFTokenizer(models.WordPiece(unk_token=UNK))
    learner.normalizer = normalizers.NFC()
    # The same split as TensorFlow Text's BertTokenizer: whitespace, punctuation, CJK.
    learner.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(RESERVED_TOKENS),
        continuing_subword_prefix="##",
        show_progress=False,
    )
    learner.train_from_iterator(texts, trainer)
    return [token for token, _ in sorted(learner.get_vocab().items(), key=lambda kv: kv[1])]


def _learn_with_tensorflow_text(texts: list[str], vocab_size: int) -> list[str]:
    from tensorflow_text.tools.wordpiece_vocab import bert_vocab_from_dataset as bvd

    dataset = tf.data.Dataset.from_tensor_slices(tf.constant(texts, tf.string)).batch(1024)
    return bvd.bert_vocab_from_dataset(
        dataset,
        vocab_size=vocab_size,
        reserved_tokens=list(RESERVED_TOKENS),
        bert_tokenizer_params=dict(lower_case=False, normalization_form="NFC"),
        learn_params={},
    )


def _lower(texts):
    # tf.strings.lower with utf-8 lower-cases non-ASCII letters (Ä -> ä) and keeps accents.
    return tf.strings.lower(texts, encoding="utf-8")


def _atomic_write(path: pathlib.Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
