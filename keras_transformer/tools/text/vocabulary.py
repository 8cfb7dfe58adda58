"""Learning a vocabulary: SentencePiece's unigram trainer, or WordPiece with Hugging Face
`tokenizers` or TensorFlow Text's learner. `Tokenizer.build` calls these; each returns
the learned model or token list, with the reserved tokens `[PAD] [UNK] [START] [END]`."""

from __future__ import annotations

import collections
import functools
import io
import math
import os
import pathlib
import re
import tempfile
import unicodedata

import tensorflow as tf

from keras_transformer import _checks
from keras_transformer.tools.text.tokenizer import BYTE_FALLBACK_MIN_VOCAB, END, PAD, RESERVED_TOKENS, START, UNK


def check_inputs(texts, vocab_size: int, min_frequency: int) -> tuple[list[str], int, int]:
    """`texts` as a list, and the sizes as Python ints, after refusing what no vocabulary can be learned from: a bare
    string (one text per character), a value that is not text, no text or only empty
    ones, a vocabulary size without room past the reserved tokens, a negative
    `min_frequency`."""
    texts = _checks.texts(texts)
    vocab_size = _checks.positive_ints(vocab_size=vocab_size)
    min_frequency = _checks.counts(min_frequency=min_frequency)
    minimum = len(RESERVED_TOKENS) + 1
    if vocab_size < minimum:
        raise ValueError(f"`vocab_size` must be at least {minimum} (the reserved tokens {list(RESERVED_TOKENS)} "
                         f"and one more). Received: vocab_size={vocab_size}")
    if not any(t.strip() for t in texts):
        raise ValueError(f"Cannot build a vocabulary from an empty corpus. Received: {len(texts)} texts, "
                         "none with a character other than white space")
    return texts, vocab_size, min_frequency


@functools.lru_cache(maxsize=1)
def nfc_rules() -> str:
    """A SentencePiece normalization rule table that composes to NFC (and changes
    nothing else): one line `decomposed code points<TAB>composed code point` per
    character whose NFD differs from it."""
    lines = []
    for code in range(0x110000):
        char = chr(code)
        decomposed = unicodedata.normalize("NFD", char)
        if decomposed != char and unicodedata.normalize("NFC", decomposed) == char:
            lines.append(" ".join(f"{ord(c):04X}" for c in decomposed) + f"\t{code:04X}")
    return "\n".join(lines) + "\n"


# With byte fallback, single characters take at most this share of the pieces left after
# the reserved and byte pieces: a text with more distinct characters (Chinese, Japanese in
# a small vocabulary) spells its rarest as bytes and keeps the rest for words and subwords.
CHARACTER_SHARE = 0.75
BYTE_PIECES = 256


def without_rare_characters(texts: list[str], vocab_size: int) -> list[str]:
    """`texts` to learn a vocabulary of `vocab_size` with byte fallback from: as they are
    when their distinct characters fit in `CHARACTER_SHARE` of the pieces left after the
    reserved and byte pieces, else with each character past the most frequent that fit
    replaced by a space, so that it gets no piece (and no piece spans it) and is spelled as
    bytes. Before, a vocabulary smaller than the characters was refused; SentencePiece's own
    `character_coverage` cannot go below 0.98, which a Chinese text in 2,000 pieces needs.
    Below `BYTE_FALLBACK_MIN_VOCAB` pieces (byte fallback asked for explicitly), as they are."""
    if vocab_size < BYTE_FALLBACK_MIN_VOCAB:  # bytes a quarter of the pieces or more
        return texts
    counts = collections.Counter()
    for text in texts:
        counts.update(text)
    fit = int(CHARACTER_SHARE * (vocab_size - len(RESERVED_TOKENS) - BYTE_PIECES))
    if len(counts) <= fit:
        return texts
    ordered = sorted(counts, key=lambda c: (-counts[c], c))
    rare = str.maketrans(dict.fromkeys(ordered[fit:], " "))
    return [text.translate(rare) for text in texts]


def vocabulary_for_characters(distinct: int) -> int:
    """The smallest vocabulary with byte fallback that gives `distinct` characters a piece each."""
    return math.ceil(distinct / CHARACTER_SHARE) + len(RESERVED_TOKENS) + BYTE_PIECES


# Unicode's code points: no text holds more distinct characters.
CODE_POINTS = 0x110000
# SentencePiece's unigram trainer starts from at most this many seed pieces (its default
# `seed_sentencepiece_size`), substrings of at most 16 characters (`max_sentencepiece_length`).
SEED_PIECES = 1_000_000


def largest_sentencepiece_vocabulary(texts: list[str]) -> int:
    """More pieces than SentencePiece's unigram trainer can learn from `texts`: its seeds
    (substrings of the texts), every character, the 256 byte pieces and the reserved
    tokens; it only removes pieces from there. Asked for more, it learns the same
    vocabulary, in time that grows with the size asked for, and past about 1.95e9 (the
    size times 1.1 overflows an int32) it never returns."""
    characters = sum(len(text) for text in texts)
    return min(SEED_PIECES, 16 * characters) + min(characters, CODE_POINTS) + BYTE_PIECES + len(RESERVED_TOKENS)


def learn_sentencepiece(texts: list[str], vocab_size: int, ids: list[int], byte_fallback: bool) -> bytes:
    import sentencepiece as spm

    pad_id, unk_id, start_id, end_id = ids
    if byte_fallback:
        texts = without_rare_characters(texts, vocab_size)
    model = io.BytesIO()
    # The trainer reads normalization rules from a file only; the file lives as long as the training.
    with tempfile.TemporaryDirectory(prefix="keras_transformer_") as tmp:
        rules = pathlib.Path(tmp) / "nfc.tsv"
        rules.write_text(nfc_rules(), encoding="utf-8")
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(texts),
                model_writer=model,
                model_type="unigram",
                vocab_size=min(vocab_size, largest_sentencepiece_vocabulary(texts)),
                seed_sentencepiece_size=SEED_PIECES,
                # A smaller corpus gives a smaller vocabulary instead of an error.
                hard_vocab_limit=False,
                # Every character of the training text gets a piece (the default drops the
                # rarest 0.05%, which then come back as [UNK] or bytes).
                character_coverage=1.0,
                byte_fallback=byte_fallback,
                # NFC only: SentencePiece's default NFKC would rewrite full-width CJK
                # punctuation, ligatures and fractions, which a round trip must keep.
                normalization_rule_tsv=str(rules),
                pad_id=pad_id, unk_id=unk_id, bos_id=start_id, eos_id=end_id,
                pad_piece=PAD, unk_piece=UNK, bos_piece=START, eos_piece=END,
                input_sentence_size=2_000_000,
                shuffle_input_sentence=True,
                num_threads=os.cpu_count() or 1,
                minloglevel=2,
            )
        except RuntimeError as e:
            # "Vocabulary size is smaller than required_chars. 6 vs 37. Increase vocab_size or decrease
            # character_coverage with --character_coverage option.": its flags are not ours.
            needed = re.search(r"smaller than required_chars\. \d+ vs (\d+)\.", str(e))
            reason = (f"the texts' distinct characters and the reserved tokens need {needed.group(1)} pieces, one "
                      "each" if needed else str(e))
            raise ValueError(
                f"SentencePiece could not learn a vocabulary of {vocab_size} pieces from {len(texts)} texts: "
                f"{reason}. A vocabulary must hold every character of the text; raise the vocabulary size"
                + (f" to at least {needed.group(1)}." if needed else ".")
            ) from None
    return model.getvalue()


def largest_wordpiece_vocabulary(texts: list[str], min_frequency: int) -> int:
    """More pieces than a WordPiece (BPE) trainer can learn from `texts`: the reserved
    tokens, each character alone and as a continuation (`##c`), and the merges. Every merge
    takes a pair seen at least `min_frequency` times and so removes at least that many
    pieces from the texts' words, which start as at most their characters."""
    characters = sum(len(text) for text in texts)
    return len(RESERVED_TOKENS) + 2 * min(characters, CODE_POINTS) + characters // max(1, min_frequency)


def learn_with_tokenizers(texts: list[str], vocab_size: int, min_frequency: int) -> list[str]:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    learner = HFTokenizer(models.WordPiece(unk_token=UNK))
    learner.normalizer = normalizers.NFC()
    # The same split as TensorFlow Text's BertTokenizer: whitespace, punctuation, CJK.
    learner.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        # The trainer sets memory aside for the size asked for: past what the texts can give,
        # the same vocabulary, and at 2**31 - 1 the process aborted (141 GB asked for).
        vocab_size=min(vocab_size, largest_wordpiece_vocabulary(texts, min_frequency)),
        min_frequency=min_frequency,
        special_tokens=list(RESERVED_TOKENS),
        continuing_subword_prefix="##",
        show_progress=False,
    )
    learner.train_from_iterator(texts, trainer)
    return [token for token, _ in sorted(learner.get_vocab().items(), key=lambda kv: kv[1])]


def learn_with_tensorflow_text(texts: list[str], vocab_size: int) -> list[str]:
    from tensorflow_text.tools.wordpiece_vocab import bert_vocab_from_dataset as bvd

    dataset = tf.data.Dataset.from_tensor_slices(tf.constant(texts, tf.string)).batch(1024)
    return bvd.bert_vocab_from_dataset(
        dataset,
        vocab_size=vocab_size,
        reserved_tokens=list(RESERVED_TOKENS),
        bert_tokenizer_params=dict(lower_case=False, normalization_form="NFC"),
        learn_params={},
    )
