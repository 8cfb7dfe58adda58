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

from keras_transformer.defaults import END_ID, PAD_ID, START_ID, UNK_ID
from keras_transformer.tools import files

PAD, UNK, START, END = "[PAD]", "[UNK]", "[START]", "[END]"
RESERVED_TOKENS = (PAD, UNK, START, END)

# Scripts written without spaces between words. BERT's basic tokenizer splits them
# into one token per character; detokenization joins them back.
_NO_SPACE_SCRIPT = r"[\p{Han}\p{Hiragana}\p{Katakana}\p{Thai}]"


class Tokenizer(tf.Module):
    """WordPiece tokenizer with the reserved tokens `[PAD] [UNK] [START] [END]`.

    The reserved tokens are at ids 0..3 unless the vocabulary puts them elsewhere
    (`build(..., pad_id=...)`); their ids are read from the vocabulary (`pad_id`,
    `unk_id`, `start_id`, `end_id`) and must agree with the model's.

    Text is split on whitespace and punctuation (and per character in CJK scripts) by
    TensorFlow Text's `BertTokenizer`, then into word pieces from the vocabulary.
    Unicode is kept as is (NFC-normalised): German umlauts, CJK characters and emoji
    survive a round trip when the vocabulary contains them; anything else becomes
    `[UNK]`. Lower-casing is an option, off by default; it keeps accents.

    Args:
        vocab: The vocabulary, a list of tokens holding each reserved token once.
            Continuation pieces start with `##`.
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
        counts = {token: vocab.count(token) for token in RESERVED_TOKENS}
        if any(n != 1 for n in counts.values()):
            raise ValueError(
                f"The vocabulary must hold each reserved token {list(RESERVED_TOKENS)} exactly once. "
                f"Received: counts {counts}"
            )
        self.pad_id, self.unk_id, self.start_id, self.end_id = (vocab.index(t) for t in RESERVED_TOKENS)
        self.lower_case = bool(lower_case)
        self.vocab = tf.Variable(vocab, trainable=False, name="vocab")
        self._vocab_list = vocab
        table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(vocab), tf.range(len(vocab), dtype=tf.int64)
            ),
            default_value=self.unk_id,
        )
        # Dropped by `detokenize`: True at the reserved ids.
        self._reserved = tf.constant([t in RESERVED_TOKENS for t in vocab])
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
        pad_id: int = PAD_ID,
        unk_id: int = UNK_ID,
        start_id: int = START_ID,
        end_id: int = END_ID,
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
            pad_id: Id of `[PAD]`. Defaults to `0`. Give the model the same ids.
            unk_id: Id of `[UNK]`. Defaults to `1`.
            start_id: Id of `[START]`. Defaults to `2`.
            end_id: Id of `[END]`. Defaults to `3`.
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
        return cls(_place_reserved(vocab, vocab_size, (pad_id, unk_id, start_id, end_id)), lower_case=lower_case)

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
        ids = tf.ragged.boolean_mask(ids, tf.logical_not(tf.gather(self._reserved, ids)))
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
        return tf.cast(self.tokenize(tf.constant(list(texts), tf.string)).to_tensor(self.pad_id), tf.int32)

    def detokenize_dense(self, ids) -> list[str]:
        """Convenience: dense or ragged ids (NumPy or tensor) -> a list of Python strings."""
        if not isinstance(ids, tf.RaggedTensor):
            ids = tf.RaggedTensor.from_tensor(tf.cast(tf.convert_to_tensor(ids), tf.int64))
        return [s.decode("utf-8") for s in self.detokenize(tf.cast(ids, tf.int64)).numpy()]

    def save(self, directory: str | os.PathLike) -> None:
        """Write `vocab.txt` (one token per line) and `tokenizer.json` to `directory`."""
        directory = pathlib.Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        # Both files or neither: the directory is written beside and renamed into place.
        with files.atomic_write(directory) as tmp:
            tmp.mkdir()
            (tmp / "vocab.txt").write_text("\n".join(self._vocab_list) + "\n", encoding="utf-8")
            config = {"lower_case": self.lower_case, "vocab_size": self.vocab_size}
            (tmp / "tokenizer.json").write_text(json.dumps(config, indent=2), encoding="utf-8")

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


def _place_reserved(vocab: list[str], vocab_size: int, ids) -> list[str]:
    """The learned `vocab` cut to `vocab_size`, with the reserved tokens at `ids`."""
    ids = [int(i) for i in ids]
    if len(set(ids)) != len(ids) or min(ids) < 0:
        raise ValueError(f"The reserved ids must be distinct and non-negative. Received: {ids}")
    pieces = [t for t in vocab if t not in RESERVED_TOKENS][: vocab_size - len(RESERVED_TOKENS)]
    size = len(pieces) + len(RESERVED_TOKENS)
    if max(ids) >= size:
        raise ValueError(
            f"The reserved ids must be smaller than the vocabulary size {size}. Received: {ids}"
        )
    for token_id, token in sorted(zip(ids, RESERVED_TOKENS)):
        pieces.insert(token_id, token)
    return pieces


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

