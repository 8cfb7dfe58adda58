"""Tokenization with TensorFlow Text: one vocabulary for source and target.

Two kinds share one interface (`Tokenizer`):

* `SentencePieceTokenizer` (the default for new vocabularies): pieces carry the
  whitespace before them (`▁`), so `detokenize(tokenize(text))` gives `text` back
  (NFC-normalised, runs of whitespace as one space): punctuation, apostrophes,
  hyphens and scripts without spaces come back as written.
* `WordPieceTokenizer`: BERT's split on whitespace and punctuation, then word pieces.
  Detokenized text has a space around punctuation (`forty - two`). Runs written
  before SentencePiece became the default use it and keep loading.

Tokenization is TensorFlow ops, so it runs inside `tf.data` (which feeds `model.fit` on
every Keras backend) and inside an exported SavedModel.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import unicodedata
from typing import Iterable, Sequence

import tensorflow as tf
import tensorflow_text as tf_text

from keras_transformer import _checks
from keras_transformer.defaults import END_ID, PAD_ID, START_ID, UNK_ID
from keras_transformer.tools import atomic, files

PAD, UNK, START, END = "[PAD]", "[UNK]", "[START]", "[END]"
RESERVED_TOKENS = (PAD, UNK, START, END)
KINDS = ("sentencepiece", "wordpiece")

# Scripts written without spaces between words. BERT's basic tokenizer splits them
# into one token per character; WordPiece detokenization joins them back.
_NO_SPACE_SCRIPT = r"[\p{Han}\p{Hiragana}\p{Katakana}\p{Thai}]"
# A SentencePiece vocabulary at least this large spends 256 pieces on UTF-8 bytes, so
# that characters it never saw are spelled as bytes instead of becoming [UNK].
BYTE_FALLBACK_MIN_VOCAB = 1024


class Tokenizer(tf.Module):
    """A subword tokenizer with the reserved tokens `[PAD] [UNK] [START] [END]`.

    Build one with `Tokenizer.build(texts, vocab_size)`, read one with
    `Tokenizer.load(directory)`. The reserved tokens are at ids 0..3 unless the build
    puts them elsewhere (`pad_id=...`); their ids (`pad_id`, `unk_id`, `start_id`,
    `end_id`) must agree with the model's.

    Example:

    >>> tok = Tokenizer.build(["It's forty-two.", "Es ist zweiundvierzig."] * 10, vocab_size=60)
    >>> ids = tok.tokenize(["It's forty-two."])
    >>> tok.detokenize(ids).numpy().tolist()
    [b"It's forty-two."]
    """

    kind: str = ""

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
        # Dropped by `detokenize`: True at the reserved ids.
        self._reserved = tf.constant([t in RESERVED_TOKENS for t in vocab])

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
        kind: str = "sentencepiece",
        lower_case: bool = False,
        min_frequency: int = 20,
        learner: str = "tokenizers",
        byte_fallback: bool | None = None,
        pad_id: int = PAD_ID,
        unk_id: int = UNK_ID,
        start_id: int = START_ID,
        end_id: int = END_ID,
    ) -> "Tokenizer":
        """Learn a vocabulary of at most `vocab_size` tokens from `texts`.

        Pass the source and target sides together: one shared vocabulary lets the
        source embedding, target embedding and output projection be one matrix.

        Args:
            texts: Training sentences, both languages.
            vocab_size: Largest vocabulary size, reserved tokens included. A corpus
                with fewer distinct pieces gives a smaller vocabulary.
            kind: `"sentencepiece"` (default; lossless text round trip, see
                `SentencePieceTokenizer`) or `"wordpiece"` (`WordPieceTokenizer`).
            lower_case: Lower-case text first. Defaults to `False`.
            min_frequency: Fewest occurrences of a pair to merge it (WordPiece with the
                `"tokenizers"` learner only). Defaults to `20`.
            learner: WordPiece only: `"tokenizers"` or `"tensorflow-text"`. The first
                breaks ties in hash-map order, so the same texts can give another
                vocabulary in another process (huggingface/tokenizers#1794, open).
            byte_fallback: SentencePiece only: spell characters outside the vocabulary
                (and the rarest, past 3/4 of the pieces) as UTF-8 bytes, not `[UNK]`.
                Defaults to `None`: on when `vocab_size >= 1024`.
            pad_id: Id of `[PAD]`. Defaults to `0`. Give the model the same ids.
            unk_id: Id of `[UNK]`. Defaults to `1`.
            start_id: Id of `[START]`. Defaults to `2`.
            end_id: Id of `[END]`. Defaults to `3`.
        """
        from keras_transformer.tools.text import vocabulary

        if kind not in KINDS:
            raise ValueError(f"`kind` must be one of {list(KINDS)}. Received: kind={kind!r}")
        texts, vocab_size, min_frequency = vocabulary.check_inputs(texts, vocab_size, min_frequency)
        pad_id, unk_id, start_id, end_id = _checks.special_ids("", vocab_size, pad_id=pad_id, unk_id=unk_id,
                                                               start_id=start_id, end_id=end_id)
        ids = [pad_id, unk_id, start_id, end_id]
        if lower_case:
            texts = [t.lower() for t in texts]
        if kind == "sentencepiece":
            if byte_fallback is None:
                byte_fallback = vocab_size >= BYTE_FALLBACK_MIN_VOCAB
            model = vocabulary.learn_sentencepiece(texts, vocab_size, ids, byte_fallback)
            return SentencePieceTokenizer(model, lower_case=lower_case)
        vocab = _learn_wordpiece(texts, vocab_size, min_frequency, learner)
        return WordPieceTokenizer(_place_reserved(vocab, vocab_size, ids), lower_case=lower_case)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string)], autograph=False)
    def tokenize(self, texts):
        """Strings `(B,)` -> token ids, a `tf.RaggedTensor` of int64 `(B, None)`.

        No `[START]`/`[END]` are added; the input pipeline and the exporter add them.
        """
        if self.lower_case:
            # utf-8 lower-casing handles non-ASCII letters (Ä -> ä) and keeps accents.
            texts = tf.strings.lower(texts, encoding="utf-8")
        return self._tokenize(texts)

    @tf.function(input_signature=[tf.RaggedTensorSpec([None, None], tf.int64)], autograph=False)
    def detokenize(self, ids):
        """Token ids `(B, None)` -> strings `(B,)`. Reserved tokens are dropped."""
        ids = tf.ragged.boolean_mask(ids, tf.logical_not(tf.gather(self._reserved, ids)))
        return self._detokenize(ids)

    def _trace(self) -> None:
        """Trace `tokenize` and `detokenize` now, once each (fixed signatures). TensorFlow
        counts a `tf.function`'s traces by its code, across instances: five tokenizers in a
        process (a server with five models), each called once, were warned of "retracing".
        Traces made here are not calls; the first call finds its graph made."""
        self.tokenize.get_concrete_function()
        self.detokenize.get_concrete_function()

    def _tokenize(self, texts):
        raise NotImplementedError

    def _detokenize(self, ids):
        raise NotImplementedError

    def tokenize_dense(self, texts) -> tf.Tensor:
        """Convenience: a list of strings -> ids padded with `[PAD]`, a dense int32 `(B, T)`."""
        return tf.cast(self.tokenize(tf.constant(_checks.texts(texts), tf.string)).to_tensor(self.pad_id), tf.int32)

    def detokenize_dense(self, ids) -> list[str]:
        """Convenience: dense or ragged ids `(B, T)` (NumPy or tensor) -> B Python strings.

        Raises `ValueError` for an id outside the vocabulary (inside the graph it would
        fail as a gather out of range)."""
        if not isinstance(ids, tf.RaggedTensor):
            ids = tf.convert_to_tensor(ids)
            if ids.shape.rank == 1 and ids.shape[0] == 0:  # `[]`: no rows
                return []
            if ids.shape.rank != 2:
                raise ValueError(f"`ids` must be (batch, length). Received: shape={tuple(ids.shape)}")
            ids = tf.RaggedTensor.from_tensor(ids)
        if not ids.dtype.is_integer:  # a float id would be truncated to another token
            raise ValueError(f"`ids` must be integer token ids. Received: dtype={ids.dtype.name}")
        values = ids.flat_values.numpy()
        if values.size and (values.min() < 0 or values.max() >= self.vocab_size):
            raise ValueError(f"`ids` must be in [0, {self.vocab_size}) (the vocabulary). "
                             f"Received: min={values.min()}, max={values.max()}")
        return [s.decode("utf-8") for s in self.detokenize(tf.cast(ids, tf.int64)).numpy()]

    def save(self, directory: str | os.PathLike) -> None:
        """Write `tokenizer.json`, `vocab.txt` (one token per line) and, for SentencePiece,
        `sentencepiece.model` to `directory`, as one unit: an earlier saved tokenizer there is
        replaced, a file or a directory of other files is a `ValueError`."""
        files.check_replacement(directory, "tokenizer")
        directory = pathlib.Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        # All files or none: the directory is written beside and renamed into place.
        with atomic.atomic_write(directory) as tmp:
            tmp.mkdir()
            (tmp / "vocab.txt").write_text("\n".join(self._vocab_list) + "\n", encoding="utf-8")
            self._save_model(tmp)
            config = {"kind": self.kind, "lower_case": self.lower_case, "vocab_size": self.vocab_size}
            (tmp / "tokenizer.json").write_text(json.dumps(config, indent=2), encoding="utf-8")

    def _save_model(self, directory: pathlib.Path) -> None:
        pass

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Tokenizer":
        """Read a tokenizer written by `save` (of either kind).

        Raises:
            TokenizerError: A file of the tokenizer is missing, unreadable or not what
                `save` wrote; the message names the file.
        """
        directory = pathlib.Path(directory)
        config_file = directory / "tokenizer.json"
        data = _read(config_file)
        try:
            config = json.loads(data.decode("utf-8"))
            kind, lower_case, vocab_size = files.kind_of_tokenizer(config), config["lower_case"], config["vocab_size"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise TokenizerError(config_file, f"is not the settings file `save` writes ({type(e).__name__}: {e})")
        if kind == "sentencepiece":
            model_file = directory / SentencePieceTokenizer.MODEL_FILE
            model = _read(model_file)
            try:
                tokenizer = SentencePieceTokenizer(model, lower_case=lower_case)
            except (tf.errors.OpError, UnicodeDecodeError, ValueError) as e:
                raise TokenizerError(model_file, f"is not a SentencePiece model ({type(e).__name__})")
        elif kind == "wordpiece":
            vocab_file = directory / "vocab.txt"
            data = _read(vocab_file)
            try:
                vocab = data.decode("utf-8").split("\n")[:-1]
                tokenizer = WordPieceTokenizer(vocab, lower_case=lower_case)
            except (UnicodeDecodeError, ValueError) as e:
                raise TokenizerError(vocab_file, f"is not a vocabulary ({type(e).__name__}: {e})")
        else:
            raise TokenizerError(config_file, f"names an unknown tokenizer kind {kind!r}; known: {list(KINDS)}")
        if tokenizer.vocab_size != vocab_size:
            raise TokenizerError(
                directory, f"holds {tokenizer.vocab_size} tokens but {config_file.name} says {vocab_size}"
            )
        return tokenizer


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be read: the message names the file and what to do."""

    def __init__(self, path, problem: str):
        super().__init__(
            f"The tokenizer file {path} {problem}. A run's tokenizer is written once, when the run starts: "
            "restore the file from a copy of the run directory, or train a new run in another directory."
        )


def _read(path: pathlib.Path) -> bytes:
    """The bytes of one tokenizer file, or a `TokenizerError` naming it."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise TokenizerError(path, "is missing") from None
    except OSError as e:
        raise TokenizerError(path, f"cannot be read ({e.strerror or type(e).__name__})") from None


class WordPieceTokenizer(Tokenizer):
    """WordPiece: text is split on whitespace and punctuation (and per character in CJK
    scripts) by TensorFlow Text's `BertTokenizer`, then into word pieces.

    Unicode is kept as is (NFC-normalised): German umlauts, CJK characters and emoji
    survive when the vocabulary contains them; anything else becomes `[UNK]`.
    Detokenization joins word pieces and separates words (and punctuation) by one space.

    Args:
        vocab: The vocabulary, a list of tokens holding each reserved token once.
            Continuation pieces start with `##`.
        lower_case: Lower-case text before tokenizing. Defaults to `False`.
    """

    kind = "wordpiece"

    def __init__(self, vocab: Sequence[str], lower_case: bool = False):
        super().__init__(vocab, lower_case)
        table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(self._vocab_list), tf.range(self.vocab_size, dtype=tf.int64)
            ),
            default_value=self.unk_id,
        )
        self._tokenizer = tf_text.BertTokenizer(
            table, token_out_type=tf.int64, unknown_token=UNK, lower_case=False,
            normalization_form="NFC",
        )
        self._trace()

    def _tokenize(self, texts):
        return self._tokenizer.tokenize(texts).merge_dims(-2, -1)  # (B, words, pieces) -> (B, pieces)

    def _detokenize(self, ids):
        pieces = tf.gather(self.vocab, ids)
        text = tf.strings.reduce_join(pieces, separator=" ", axis=-1)
        text = tf.strings.regex_replace(text, " ##", "")
        # Two passes: each joins every other pair of neighbouring characters.
        for _ in range(2):
            text = tf.strings.regex_replace(
                text, f"({_NO_SPACE_SCRIPT}) ({_NO_SPACE_SCRIPT})", r"\1\2"
            )
        return text


class SentencePieceTokenizer(Tokenizer):
    """SentencePiece (unigram language model): lossless detokenization.

    Text is NFC-normalised and runs of whitespace become one space inside the
    SentencePiece model; a piece that starts a word carries `▁` for the space before
    it, so detokenization restores spacing exactly: no space appears before `.`,
    inside `it's` or `t-shirt`, or between CJK characters unless the text had one.
    With byte fallback, characters outside the vocabulary are spelled as UTF-8 bytes
    and survive too; without it they become `[UNK]`, which detokenization drops.

    Args:
        model: A serialized SentencePiece model (`ModelProto` bytes) whose control
            symbols are `[PAD] [UNK] [START] [END]`, as `Tokenizer.build` makes.
        lower_case: Lower-case text before tokenizing. Defaults to `False`.
    """

    kind = "sentencepiece"
    MODEL_FILE = "sentencepiece.model"

    def __init__(self, model: bytes, lower_case: bool = False):
        self._model = bytes(model)
        sp = tf_text.SentencepieceTokenizer(model=self._model, out_type=tf.int32)
        vocab = [t.decode("utf-8") for t in sp.id_to_string(tf.range(sp.vocab_size())).numpy()]
        super().__init__(vocab, lower_case)
        self._trace()

    @property
    def model_proto(self) -> bytes:
        """The serialized SentencePiece model (what `sentencepiece.model` holds)."""
        return self._model

    def _sentencepiece(self):
        # Made inside each traced function, not kept: the SentencePiece op's model is
        # owned by its kernel, and TensorFlow drops eager kernels whenever a global seed
        # is set (`keras.utils.set_random_seed`), after which a tokenizer made earlier
        # failed with "Resource ... does not exist". A function's kernels are rebuilt
        # with it. (tensorflow_text's own TODO b/318839908 in sentencepiece_tokenizer.py.)
        return tf_text.SentencepieceTokenizer(model=self._model, out_type=tf.int32)

    def _tokenize(self, texts):
        return tf.cast(self._sentencepiece().tokenize(texts), tf.int64)

    def _detokenize(self, ids):
        return self._sentencepiece().detokenize(tf.cast(ids, tf.int32))

    def _save_model(self, directory: pathlib.Path) -> None:
        (directory / self.MODEL_FILE).write_bytes(self._model)


def normalise(text: str) -> str:
    """`text` as a SentencePiece round trip gives it back: NFC, runs of spaces as one, no
    space at either end."""
    return re.sub(" +", " ", unicodedata.normalize("NFC", text)).strip()


def _learn_wordpiece(texts: list[str], vocab_size: int, min_frequency: int, learner: str) -> list[str]:
    """The WordPiece vocabulary `learner` ("tokenizers" or "tensorflow-text") learns."""
    from keras_transformer.tools.text import vocabulary

    if learner == "tokenizers":
        return vocabulary.learn_with_tokenizers(texts, vocab_size, min_frequency)
    if learner == "tensorflow-text":
        return vocabulary.learn_with_tensorflow_text(texts, vocab_size)
    raise ValueError(f"`learner` must be 'tokenizers' or 'tensorflow-text'. Received: learner={learner!r}")


def _place_reserved(vocab: list[str], vocab_size: int, ids) -> list[str]:
    """The learned `vocab` cut to `vocab_size`, with the reserved tokens at `ids`."""
    pieces = [t for t in vocab if t not in RESERVED_TOKENS][: vocab_size - len(RESERVED_TOKENS)]
    size = len(pieces) + len(RESERVED_TOKENS)
    if max(ids) >= size:
        raise ValueError(
            f"The reserved ids must be smaller than the vocabulary size {size}. Received: {ids}"
        )
    for token_id, token in sorted(zip(ids, RESERVED_TOKENS)):
        pieces.insert(token_id, token)
    return pieces
