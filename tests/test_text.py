"""Tokenizer, corpora and the tf.data pipeline.

They are TensorFlow Text and tf.data whatever the Keras backend, so these tests run in the
TensorFlow suite only; the training, translation and export tests use them under JAX and
PyTorch too."""

import gzip
import io
import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import unicodedata
import warnings

import numpy as np
import pytest

from keras_transformer.decoding import END_ID, PAD_ID, START_ID
from keras_transformer.tools.text import Tokenizer, WordPieceTokenizer, corpora
from keras_transformer.tools.text.datasets import bucket_lengths, make_dataset
from tests.conftest import only_on, run_in_threads

pytestmark = only_on("tensorflow", "backend-independent (TensorFlow Text and tf.data under every backend)")

UNICODE = ["Grüße aus München, schöne Äpfel", "你好世界", "I ❤️ 🍕 pizza 😀", "forty-two thousand and seven"]
# What a round trip must keep: punctuation, apostrophes, hyphens, numbers, umlauts, CJK.
REAL = [
    "It's a t-shirt, isn't it?",
    "Tom's 3.5-year-old dog costs $1,200.",
    "„Grüß Gott!“, sagte die Österreicherin; er lächelte.",
    "Er wohnt in der Kaiser-Wilhelm-Straße 12a (3. Stock).",
    "東京は日本の首都です。「はい」と言った。",
    "«Ça va?» — Oui… ½ 99\u202f% sicher!",
    "Wait... what?! No: 'never' -- really.",
]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.build(UNICODE * 5, vocab_size=300)


def test_reserved_tokens_and_unicode_round_trip(tokenizer):
    assert tokenizer.kind == "sentencepiece"
    assert {tokenizer.vocabulary[i] for i in range(4)} == {"[PAD]", "[UNK]", "[START]", "[END]"}
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.start_id, tokenizer.end_id) == (0, 1, 2, 3)
    ids = tokenizer.tokenize(UNICODE)
    assert int(ids.flat_values.numpy().min()) >= 4  # no reserved ids from text
    text = [t.decode("utf-8") for t in tokenizer.detokenize(ids).numpy()]
    assert text == UNICODE
    unknown = tokenizer.tokenize(["Zebra"]).flat_values.numpy().tolist()
    assert 1 in unknown  # a letter never seen is [UNK] (a small vocabulary has no byte fallback)


def _normalised(text):
    return re.sub(" +", " ", unicodedata.normalize("NFC", text)).strip()


@pytest.mark.parametrize("kind", ["sentencepiece", "wordpiece"])
def test_sentencepiece_round_trip_is_lossless_wordpiece_is_not(kind):
    tok = Tokenizer.build(REAL * 10, vocab_size=400, kind=kind, min_frequency=1)
    assert tok.kind == kind
    back = tok.detokenize_dense(tok.tokenize_dense(REAL))
    if kind == "sentencepiece":
        assert back == [_normalised(t) for t in REAL]
        # Whitespace is normalised (runs become one space); decomposed umlauts compose (NFC).
        messy = ["  Grüße,   Tom!  ", "Gru\u0308\u00dfe"]
        assert tok.detokenize_dense(tok.tokenize_dense(messy)) == ["Grüße, Tom!", "Grüße"]
    else:
        # BERT's pre-tokenizer splits punctuation off, and detokenization cannot tell.
        assert back[0] == "It ' s a t - shirt , isn ' t it ?"


def test_learning_leaves_no_temporary_files(tmp_path, monkeypatch):
    import tempfile

    from keras_transformer.tools.text import vocabulary

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    vocabulary.nfc_rules.cache_clear()  # whatever it caches is made again, here
    Tokenizer.build(REAL * 3, vocab_size=200)
    assert list(tmp_path.iterdir()) == []


def test_byte_fallback_spells_unseen_characters():
    texts = [t for t in REAL if not t.startswith("東京")] * 40
    tok = Tokenizer.build(texts, vocab_size=1024)  # >= 1024: bytes on by default
    unseen = ["東京 Zürich ß€ 🦒"]
    ids = tok.tokenize_dense(unseen).numpy()
    assert tok.unk_id not in ids
    assert tok.detokenize_dense(ids) == unseen
    without = Tokenizer.build(texts, vocab_size=1024, byte_fallback=False)
    assert without.unk_id in without.tokenize_dense(unseen).numpy()


def test_lower_case_keeps_umlauts():
    for kind in ("sentencepiece", "wordpiece"):
        tok = Tokenizer.build(["ÄPFEL und Öl"], vocab_size=30, lower_case=True, min_frequency=1, kind=kind)
        assert tok.detokenize_dense(tok.tokenize_dense(["ÄPFEL und Öl"])) == ["äpfel und öl"]


@pytest.mark.parametrize("kind", ["sentencepiece", "wordpiece"])
def test_save_and_load(kind, tmp_path):
    tokenizer = Tokenizer.build(UNICODE * 5, vocab_size=300, kind=kind, min_frequency=1)
    tokenizer.save(tmp_path / "tok")
    loaded = Tokenizer.load(tmp_path / "tok")
    assert type(loaded) is type(tokenizer) and loaded.kind == kind
    assert loaded.vocabulary == tokenizer.vocabulary and loaded.lower_case is False
    np.testing.assert_array_equal(
        loaded.tokenize_dense(UNICODE).numpy(), tokenizer.tokenize_dense(UNICODE).numpy()
    )
    # The directory is written as a whole: an earlier saved tokenizer is replaced; a file, or
    # a directory of anything else (which the write would delete), is refused untouched.
    Tokenizer.build(REAL * 5, vocab_size=300, kind=kind, min_frequency=1).save(tmp_path / "tok")
    assert Tokenizer.load(tmp_path / "tok").vocabulary != tokenizer.vocabulary
    (tmp_path / "notes.txt").write_text("mine")
    for path, message in ((tmp_path, r"holds files that are not a saved tokenizer \(notes.txt, tok\)"),
                          (tmp_path / "notes.txt", "is a file; give a directory for the tokenizer")):
        with pytest.raises(ValueError, match=message):
            tokenizer.save(path)
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "tok"] and (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("kind", ["sentencepiece", "wordpiece"])
def test_one_loaded_tokenizer_serves_several_threads(kind, tmp_path):
    # A server loads a tokenizer once and calls it from its request threads; here four
    # threads make their first calls at once.
    Tokenizer.build(UNICODE * 5, vocab_size=300, kind=kind, min_frequency=1).save(tmp_path / "tok")
    shared, alone = Tokenizer.load(tmp_path / "tok"), Tokenizer.load(tmp_path / "tok")
    texts = [text for text in UNICODE for _ in range(3)]
    ids = alone.tokenize_dense(texts).numpy()
    back = alone.detokenize_dense(ids)
    results = []

    def work(i):
        mine, mine_ids, mine_back = texts[i:] + texts[:i], np.roll(ids, -i, axis=0), back[i:] + back[:i]
        for _ in range(10):
            got = shared.tokenize_dense(mine).numpy()
            results.append((np.array_equal(got, mine_ids), shared.detokenize_dense(got) == mine_back))

    assert run_in_threads(work) == [] and len(results) == 40
    assert all(same_ids and same_text for same_ids, same_text in results), results


def test_a_process_with_six_tokenizers_is_not_told_they_retrace(tmp_path):
    # A server with a tokenizer per model. TensorFlow counts a `tf.function`'s traces by
    # its code, across instances, and each tokenizer traces its own graph: the fifth
    # tokenizer's first call was warned of "excessive" retracing (once for `tokenize`,
    # once for `detokenize`, and again at the sixth).
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("tensorflow")
    logger.addHandler(handler)
    try:
        for kind in ("sentencepiece", "wordpiece"):
            Tokenizer.build(UNICODE * 5, vocab_size=300, kind=kind, min_frequency=1).save(tmp_path / kind)
        tokenizers = [Tokenizer.load(tmp_path / kind) for kind in ("sentencepiece", "wordpiece") for _ in range(3)]
        back = [tok.detokenize_dense(tok.tokenize_dense(UNICODE)) for tok in tokenizers]
    finally:
        logger.removeHandler(handler)
    assert back[0] == UNICODE and len(back) == 6  # SentencePiece round trips
    assert [r.getMessage()[:80] for r in records if "retracing" in r.getMessage()] == []


def test_vocabularies_written_before_sentencepiece_still_load(tmp_path):
    # A run directory's tokenizer as the WordPiece-only releases wrote it: no "kind".
    (tmp_path / "tok").mkdir()
    vocab = ["[PAD]", "[UNK]", "[START]", "[END]", "forty", "two", "##s"]
    (tmp_path / "tok" / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    (tmp_path / "tok" / "tokenizer.json").write_text('{"lower_case": false, "vocab_size": 7}', encoding="utf-8")
    tok = Tokenizer.load(tmp_path / "tok")
    assert isinstance(tok, WordPieceTokenizer) and tok.vocabulary == vocab
    assert tok.tokenize_dense(["forty twos"]).numpy().tolist() == [[4, 5, 6]]
    (tmp_path / "tok" / "tokenizer.json").write_text('{"kind": "bpe", "lower_case": false, "vocab_size": 7}')
    with pytest.raises(ValueError, match="unknown tokenizer kind 'bpe'"):
        Tokenizer.load(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer.json").write_text('{"kind": "sentencepiece", "lower_case": false, "vocab_size": 7}')
    with pytest.raises(ValueError, match=r"sentencepiece.model is missing"):
        Tokenizer.load(tmp_path / "tok")


@pytest.mark.parametrize("damage, file, says", [
    ("delete", "tokenizer.json", "is missing"),
    ("garble", "tokenizer.json", "is not the settings file"),
    ("delete", "sentencepiece.model", "is missing"),
    ("garble", "sentencepiece.model", "is not a SentencePiece model"),
    ("truncate", "sentencepiece.model", "is not a SentencePiece model"),
    ("folder", "sentencepiece.model", "cannot be read"),
])
def test_a_damaged_tokenizer_names_the_file(damage, file, says, tmp_path):
    from keras_transformer.tools.text import TokenizerError

    Tokenizer.build(UNICODE * 5, vocab_size=300, kind="sentencepiece", min_frequency=1).save(tmp_path / "tok")
    path = tmp_path / "tok" / file
    data = path.read_bytes()
    path.unlink()
    if damage == "garble":
        path.write_bytes(b"\xff\x00 not this file" * 3)
    elif damage == "truncate":
        path.write_bytes(data[: len(data) // 3])
    elif damage == "folder":
        path.mkdir()
    with pytest.raises(TokenizerError) as caught:
        Tokenizer.load(tmp_path / "tok")
    assert f"The tokenizer file {path} {says}" in str(caught.value), str(caught.value)


def test_tensorflow_text_learner_gives_the_same_format():
    tok = Tokenizer.build(["the cat sat", "the cats sat down"] * 20, vocab_size=40, kind="wordpiece",
                          learner="tensorflow-text")
    assert tok.vocabulary[:4] == ["[PAD]", "[UNK]", "[START]", "[END]"]
    assert tok.detokenize_dense(tok.tokenize_dense(["the cats sat"])) == ["the cats sat"]


def test_tokenizer_bad_input():
    with pytest.raises(ValueError, match="at least 5.*vocab_size=4"):
        Tokenizer.build(["a b c"], vocab_size=4)
    with pytest.raises(ValueError, match="empty corpus"):
        Tokenizer.build([], vocab_size=100)
    # Only empty texts: the trainer's own error asked for a larger vocabulary.
    with pytest.raises(ValueError, match="2 texts, none with a character other than white space"):
        Tokenizer.build(["", "  "], vocab_size=100)
    # A bare string was learned from character by character; a non-text failed inside the trainer.
    with pytest.raises(TypeError, match="for one text, pass"):
        Tokenizer.build("the cat sat", vocab_size=100)
    with pytest.raises(TypeError, match=r"`texts` must be strings. Received: texts\[1\]=None"):
        Tokenizer.build(["a b", None], vocab_size=100)
    with pytest.raises(ValueError, match="`min_frequency` must be an integer >= 0"):  # was an OverflowError
        Tokenizer.build(["a b c"], vocab_size=100, kind="wordpiece", min_frequency=-1)
    with pytest.raises(ValueError, match="`kind` must be one of"):
        Tokenizer.build(["a b c"], vocab_size=100, kind="bpe")
    with pytest.raises(ValueError, match=r"each reserved token .* exactly once.*'\[PAD\]': 0"):
        WordPieceTokenizer(["a", "b", "c", "d", "e"])
    with pytest.raises(ValueError, match=r"'\[END\]': 2"):
        WordPieceTokenizer(["[PAD]", "[UNK]", "[START]", "[END]", "[END]"])
    for kind in ("sentencepiece", "wordpiece"):
        with pytest.raises(ValueError, match="the special ids must differ"):
            Tokenizer.build(["a b c"], vocab_size=50, min_frequency=1, pad_id=1, kind=kind)
    # A reserved id the vocabulary has no room for failed inside SentencePiece's trainer;
    # 1.5 was taken as id 1 and True as id 1.
    with pytest.raises(ValueError, match=r"`pad_id` must be a token id in \[0, vocab_size=50\). Received: pad_id=500"):
        Tokenizer.build(["a b c"], vocab_size=50, min_frequency=1, pad_id=500)
    for bad in (1.5, True, -1):
        with pytest.raises(ValueError,
                           match=rf"`pad_id` must be a token id in \[0, vocab_size=50\). Received: pad_id={bad}"):
            Tokenizer.build(["a b c"], vocab_size=50, min_frequency=1, pad_id=bad)
    # More distinct characters than the vocabulary can hold: the size that holds them is
    # named (SentencePiece's own words named its trainer's flags, not ours), and it is enough.
    with pytest.raises(ValueError, match=r"from 1 texts: the texts' distinct characters and the reserved tokens need "
                                         r"(\d+) pieces, one each\. .* raise the vocabulary size to at least \d+\.$"
                       ) as error:
        Tokenizer.build(["abcdefghijklmnopqrstuvwxyz"], vocab_size=10)
    needed = int(re.search(r"at least (\d+)", str(error.value)).group(1))
    assert needed > 26 + 4  # the letters, the reserved tokens and SentencePiece's word boundary
    assert Tokenizer.build(["abcdefghijklmnopqrstuvwxyz"], vocab_size=needed).vocab_size == needed
    with pytest.raises(ValueError, match=rf"to at least {needed}\.$"):
        Tokenizer.build(["abcdefghijklmnopqrstuvwxyz"], vocab_size=needed - 1)


def test_a_text_with_more_characters_than_fit_spells_its_rarest_as_bytes():
    # A Chinese corpus (about 3,500 distinct characters) in the default 2,000 pieces was
    # refused: every character needed a piece. With byte fallback the most frequent get one,
    # at most three quarters of the pieces past the reserved and byte ones, and the rest
    # are spelled as UTF-8 bytes. Here character i is in 160 - i // 5 of the texts.
    from keras_transformer.tools.run_setup import data_statistics
    from keras_transformer.tools.text.vocabulary import vocabulary_for_characters

    chars = [chr(0x4E00 + i) for i in range(800)]
    texts = ["".join(chars[:n]) for n in range(5, 801, 5)]
    tok = Tokenizer.build(texts, vocab_size=1024)
    pieces = set(tok.vocabulary)
    assert [c in pieces for c in chars] == [True] * 573 + [False] * 227  # int(0.75 * (1024 - 4 - 256))
    assert tok.detokenize_dense(tok.tokenize_dense(texts)) == texts
    rarest = [tok.vocabulary[i] for i in tok.tokenize_dense([chars[-1]]).numpy()[0]]
    assert rarest[-3:] == [f"<0x{b:02X}>" for b in chars[-1].encode()] and rarest[:-3] in ([], ["▁"])
    corpus = corpora.Corpus(train=[(t, t) for t in texts], validation=[], test=[])
    summary = data_statistics(corpus, tok, max_length=1024)["summary"]
    assert re.search(r"\nwarning: [0-9.]+% of the training tokens are UTF-8 bytes, which spell the 227 rarest of the "
                     r"text's 800 distinct characters \(they have no piece of their own\); a --vocab-size of at least "
                     r"1,327 gives each character a piece$", summary), summary
    assert vocabulary_for_characters(800) == 1327
    # Bytes asked for in fewer than 1,024 pieces: every character still needs a piece.
    with pytest.raises(ValueError, match=r"raise the vocabulary size to at least 1061\.$"):
        Tokenizer.build(texts, vocab_size=1000, byte_fallback=True)
    tok = Tokenizer.build(texts, vocab_size=1327)
    assert all(c in tok.vocabulary for c in chars)
    assert "warning" not in data_statistics(corpus, tok, max_length=1024)["summary"]


def test_dense_conveniences_refuse_what_is_not_texts_or_token_ids(tokenizer):
    import tensorflow as tf

    # A string is a sequence of its characters: as `texts` it would give one row per character.
    with pytest.raises(TypeError, match=r"for one text, pass \[text\]"):
        tokenizer.tokenize_dense("forty-two")
    size = tokenizer.vocab_size
    for ids in ([[5, size]], np.array([[-1, 5]]), tf.ragged.constant([[5], [5, size + 7]], dtype=tf.int64)):
        with pytest.raises(ValueError, match=rf"`ids` must be in \[0, {size}\)"):
            tokenizer.detokenize_dense(ids)
    # Anything but a list of texts: TensorFlow's conversion errors, in our words.
    for texts, received in ((None, "None"), (5, "5"), (["a", 3], r"texts\[1\]=3")):
        with pytest.raises(TypeError, match=f"`texts` must be .*Received: {received}"):
            tokenizer.tokenize_dense(texts)
    # A float id was truncated to another token; one row of ids was a RaggedTensor error.
    with pytest.raises(ValueError, match="`ids` must be integer token ids. Received: dtype=float32"):
        tokenizer.detokenize_dense(np.array([[5.5, 6.0]], "float32"))
    with pytest.raises(ValueError, match=r"`ids` must be \(batch, length\). Received: shape=\(2,\)"):
        tokenizer.detokenize_dense([5, 6])
    # No rows, and rows of no ids.
    assert tokenizer.detokenize_dense([]) == [] and tokenizer.detokenize_dense(np.zeros((2, 0), "int32")) == ["", ""]
    assert tokenizer.tokenize_dense([]).shape == (0, 0)


@pytest.mark.parametrize("kind", ["sentencepiece", "wordpiece"])
def test_reserved_tokens_can_sit_at_other_ids(kind):
    tok = Tokenizer.build(["zwei und vierzig", "forty two"] * 5, vocab_size=60, min_frequency=1,
                          pad_id=6, unk_id=0, start_id=9, end_id=3, kind=kind)
    assert (tok.pad_id, tok.unk_id, tok.start_id, tok.end_id) == (6, 0, 9, 3)
    assert [tok.vocabulary[i] for i in (6, 0, 9, 3)] == ["[PAD]", "[UNK]", "[START]", "[END]"]
    ids = tok.tokenize_dense(["forty two", "zwei"]).numpy()
    assert ids[1, -1] == 6  # padded with [PAD]'s id
    # The reserved tokens are dropped wherever they sit; real pieces are kept.
    framed = [[9, *[i for i in ids[0] if i != 6], 3, 6, 6]]
    assert tok.detokenize_dense(framed) == ["forty two"]
    assert tok.detokenize_dense([[0]]) == [""]  # [UNK] at id 0 is reserved too


def test_numbers_corpus_is_deterministic_and_splits_are_disjoint():
    a = corpora.numbers_corpus(train_size=2000, validation_size=200, test_size=200)
    b = corpora.numbers_corpus(train_size=2000, validation_size=200, test_size=200)
    assert a.train == b.train and a.test == b.test
    assert (len(a.train), len(a.validation), len(a.test)) == (2000, 200, 200)
    train, val, test = ({s for s, _ in split} for split in (a.train, a.validation, a.test))
    assert not (train & val) and not (train & test) and not (val & test)
    pairs = dict(a.train)
    assert pairs["forty-two"] == "zweiundvierzig" and pairs["seventeen"] == "siebzehn"
    other = corpora.numbers_corpus(train_size=2000, validation_size=200, test_size=200, seed=1)
    assert other.test != a.test


@pytest.mark.parametrize("lang", ["en", "de", "es"])
def test_number_words_by_parts_are_num2words(lang):
    from num2words import num2words

    words = corpora._NumberWords(lang)
    assert words._by_parts  # the fast path is the one checked here
    rng = np.random.default_rng(0)
    numbers = [0, 7, 999, 1000, 1001, 10_000, 100_001, 999_999, 1_000_000, 1_234_567, *rng.integers(0, 10**6, 1500)]
    for n in numbers:
        assert words(int(n)) == num2words(int(n), lang=lang), n


def test_number_words_fall_back_to_num2words_where_the_parts_rule_breaks(monkeypatch):
    import num2words as package

    def irregular(n, lang):  # "1000 + b" does not begin with the words of 1000
        return f"w{n}" if n != 1001 else "other"

    monkeypatch.setattr(package, "num2words", irregular)
    words = corpora._NumberWords("xx")
    assert not words._by_parts
    assert [words(n) for n in (5, 1001, 123_456)] == ["w5", "other", "w123456"]


def test_parallel_files_gzip_and_empty_lines(tmp_path):
    src, tgt = tmp_path / "train.en.gz", tmp_path / "train.de"
    with gzip.open(src, "wt", encoding="utf-8") as f:
        f.write("a house\n\nthe cat\n")
    tgt.write_text("ein Haus\nleer\ndie Katze\n", encoding="utf-8")
    pairs, skipped = corpora.read_parallel_files(src, tgt)
    assert pairs == [("a house", "ein Haus"), ("the cat", "die Katze")] and skipped == 1


def test_gzip_data_is_read_as_gzip_whatever_the_file_is_called(tmp_path):
    # A compressed corpus saved without .gz (a download renamed): gzip's first bytes are no text's.
    corpus = tmp_path / "pairs.tsv"
    corpus.write_bytes(gzip.compress("a house\tein Haus\nthe cat\tdie Katze\n".encode()))
    assert corpora.read_tsv(corpus) == ([("a house", "ein Haus"), ("the cat", "die Katze")], 0)
    assert corpora.read_stream(io.BytesIO(corpus.read_bytes()), "pipe") == corpus.read_bytes()  # a pipe: no NUL check
    corpus.write_bytes(b"\x1f\x8b not gzip after all")
    with pytest.raises(corpora.CorpusError, match=r"pairs.tsv is not a complete gzip file \(BadGzipFile"):
        corpora.read_tsv(corpus)


def test_parallel_files_errors_name_files_counts_and_lines(tmp_path):
    src, tgt = tmp_path / "s.txt", tmp_path / "t.txt"
    src.write_text("a\nb\nc\n")
    tgt.write_text("x\n")
    with pytest.raises(corpora.CorpusError, match=r"s.txt has 3 lines, .*t.txt has 1 line\."):
        corpora.read_parallel_files(src, tgt)
    with pytest.raises(corpora.CorpusError, match=r"File not found: .*missing.txt"):
        corpora.read_parallel_files(src, tmp_path / "missing.txt")
    tgt.write_bytes(b"x\ny\n\xff\xfe broken\n")
    with pytest.raises(corpora.CorpusError, match=r"t.txt, line 3: not valid UTF-8"):
        corpora.read_parallel_files(src, tgt)


def test_a_stream_is_read_in_chunks_and_a_nul_byte_stops_it():
    import io

    # The NUL is in the third 1 MiB chunk: its line counts the lines of the chunks before it.
    data = b"word\n" * 500_000 + b"\x00"
    with pytest.raises(corpora.CorpusError, match=r"^pipe, line 500001: a NUL byte"):
        corpora.read_stream(io.BytesIO(data), "pipe")
    assert corpora.read_stream(io.BytesIO(data), "pipe", text=False) == data  # gzip data holds NUL bytes
    assert corpora.read_stream(io.BytesIO(b"a\nb\n"), "pipe") == b"a\nb\n"


def test_the_lines_of_a_stream_come_in_chunks_as_they_arrive():
    import io

    from keras_transformer.tools.text import streams

    class Pipe(io.BytesIO):  # its reads end where the test says
        def __init__(self, *parts):
            super().__init__(b"".join(parts))
            self.sizes = [len(p) for p in parts]

        def read1(self, size=-1):
            return super().read1(self.sizes.pop(0) if self.sizes else size)

    data = b"\xef\xbb\xbfone\r\n\ntwo\rthree\nf\xc3\xbcnf"  # a BOM, every line ending, no final one
    for cut in range(1, len(data)):  # a read may end anywhere: inside \r\n, inside a character
        for chunk_lines in (1, 2, 10):
            chunks = list(streams.line_chunks(Pipe(data[:cut], data[cut:]), "pipe", chunk_lines))
            assert [line for chunk in chunks for line in chunk] == corpora.decode_lines(data, "pipe")
            assert all(len(chunk) == chunk_lines for chunk in chunks[:-1]), (cut, chunks)
    # From a terminal, each line as soon as it is complete; from a pipe, full chunks.
    assert list(streams.line_chunks(Pipe(b"a\nb\n", b"c\n", b"d"), "t", 3, interactive=True)) == [
        ["a", "b"], ["c"], ["d"]]
    assert list(streams.line_chunks(Pipe(b"a\nb\n", b"c\n", b"d"), "t", 3)) == [["a", "b", "c"], ["d"]]
    # Mistakes name their line, counted from the stream's start; a NUL byte stops the
    # stream before its line ends (/dev/zero has none).
    for parts, message in (((b"a\nb\n", b"c\n\xff\n"), "pipe, line 4: not valid UTF-8 (byte 0: b'\\xff')"),
                           ((b"a\nb\n", b"c\nd\0"), "pipe, line 4: a NUL byte"),
                           ((b"\xff\xfeo\0n\0e\0",), "pipe is UTF-16 text")):
        with pytest.raises(corpora.CorpusError, match=re.escape(message)):
            list(streams.line_chunks(Pipe(*parts), "pipe", 2))
    with pytest.raises(corpora.CorpusError, match="^zeros, line 1: a NUL byte"):  # at its first read
        next(streams.line_chunks(Pipe(b"\0" * 10, b"\0" * 10), "zeros", 2, interactive=True))


def test_a_slow_writers_lines_are_given_out_when_the_stream_goes_quiet():
    import threading

    from keras_transformer.tools.text import streams

    read_end, write_end = os.pipe()
    with open(read_end, "rb") as reader, open(write_end, "wb", buffering=0) as writer:
        writer.write(b"one\ntwo\n")  # the writer stays, with nothing more for now (`tail -f`)
        chunks = streams.line_chunks(reader, "pipe", chunk_lines=100)
        got = []
        thread = threading.Thread(target=lambda: got.append(next(chunks)), daemon=True)
        thread.start()
        thread.join(timeout=30)
        assert got == [["one", "two"]]  # not held back for a list of 100
        writer.write(b"three\n")
        writer.close()
        assert list(chunks) == [["three"]]


def test_tsv_reader(tmp_path):
    path = tmp_path / "deu.tsv"
    path.write_text("Hi.\tHallo!\tCC-BY 2.0 (France) Attribution\n\nRun!\tLauf!\n", encoding="utf-8")
    pairs, skipped = corpora.read_tsv(path)
    assert pairs == [("Hi.", "Hallo!"), ("Run!", "Lauf!")] and skipped == 1
    path.write_text("Hi.\tHallo!\nno tab here\n", encoding="utf-8")
    with pytest.raises(corpora.CorpusError, match=r"deu.tsv, line 2: .*no tab"):
        corpora.read_tsv(path)


def test_split_groups_translations_of_a_sentence_drops_repeats_and_follows_the_seed():
    # 300 English sentences, each with 1-3 German translations, and some repeated pairs.
    pairs = [(f"sentence {i}.", f"Satz {i}, Variante {k}.") for i in range(300) for k in range(1 + i % 3)]
    pairs += pairs[:25]
    corpus = corpora.split_pairs(pairs, holdout=40, seed=3)
    assert corpus.duplicates_dropped == 25 and "25 repeated pairs dropped" in corpus.summary()
    sources = [{s for s, _ in split} for split in (corpus.train, corpus.validation, corpus.test)]
    assert not (sources[0] & sources[1]) and not (sources[0] & sources[2]) and not (sources[1] & sources[2])
    # Every translation of a held-out sentence is held out with it.
    assert len(corpus.train) + len(corpus.validation) + len(corpus.test) == len(set(pairs))
    for split in (corpus.validation, corpus.test):
        assert 40 <= len(split) < 40 + 3
    # Line order does not matter; the seed does.
    shuffled = corpora.split_pairs(pairs[::-1], holdout=40, seed=3)
    assert sorted(shuffled.test) == sorted(corpus.test)
    assert sorted(corpora.split_pairs(pairs, holdout=40, seed=4).test) != sorted(corpus.test)
    assert "split seed 3" in corpus.description


def test_split_pairs_refuses_empty_corpus():
    with pytest.raises(corpora.CorpusError, match="empty"):
        corpora.split_pairs([], holdout=10)


@pytest.mark.parametrize("size, held_out", [(60_000, 500), (5_000, 500), (4_999, 499), (1_200, 120), (25, 2), (7, 1)])
def test_without_a_holdout_a_corpus_holds_out_500_pairs_or_a_tenth(size, held_out):
    """A corpus of 1,200 pairs was refused unless --holdout was given (500 each would
    leave 200 to train on)."""
    pairs = [(f"sentence {i}.", f"Satz {i}.") for i in range(size)]
    corpus = corpora.split_pairs(pairs, seed=1)
    assert len(corpus.test) == len(corpus.validation) == held_out
    assert len(corpus.train) == size - 2 * held_out
    # The split says why it holds out fewer than 500.
    assert ("held out for each of validation and test" in corpus.description) == (held_out < 500)
    # An explicit --holdout is taken as given, and refused where it cannot be.
    assert len(corpora.split_pairs(pairs, holdout=1, seed=1).test) == 1
    if size < 3_000:
        with pytest.raises(corpora.CorpusError, match=rf"--holdout 500 asks .* use at most --holdout {size // 6}"):
            corpora.split_pairs(pairs, holdout=500)


def test_the_real_text_benchmark_holds_out_2000_pairs_or_a_tenth(tmp_path):
    """benchmarks/real_text.py held out 2,000 pairs for each split whatever the corpus: one
    of fewer than 12,000 pairs was refused."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "real_text", pathlib.Path(__file__).parents[1] / "benchmarks" / "real_text.py")
    real_text = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(real_text)
    for size, held_out in ((3_000, 300), (30_000, 2_000)):
        tsv = tmp_path / f"{size}.tsv"
        tsv.write_text("".join(f"sentence {i}.\tSatz {i}.\n" for i in range(size)) + "sentence 0.\tSatz 0.\n")
        assert real_text.holdout(real_text.parse_args(["--tsv", str(tsv)])) == held_out
    assert real_text.holdout(real_text.parse_args(["--tsv", str(tsv), "--holdout", "7"])) == 7


def test_a_corpus_of_fewer_than_six_pairs_cannot_be_split():
    pairs = [(f"s{i}", f"t{i}") for i in range(5)]
    for holdout in (None, 1):
        with pytest.raises(corpora.CorpusError, match="^5 distinct pairs read: a corpus needs at least 6"):
            corpora.split_pairs(pairs + pairs, holdout=holdout)  # repeats do not count


def test_dataset_teacher_forcing_and_token_budget():
    corpus = corpora.numbers_corpus(train_size=1000, validation_size=10, test_size=10)
    texts = [s for s, _ in corpus.train] + [t for _, t in corpus.train]
    tok = Tokenizer.build(texts, vocab_size=400, min_frequency=2)
    ds = make_dataset(corpus.train, tok, batch_tokens=512, max_length=32, shuffle=False, seed=0)
    lengths = bucket_lengths(32)
    seen, shorter_targets = 0, 0
    for inputs, labels in ds:
        src, dec, lab = inputs["source_ids"].numpy(), inputs["target_ids"].numpy(), labels.numpy()
        assert dec.shape == lab.shape and src.shape[0] == lab.shape[0]
        # Each side padded to the shortest bucket length that holds its longest row.
        for ids, longest in ((src, (src != PAD_ID).sum(1).max()), (lab, (lab != PAD_ID).sum(1).max())):
            assert ids.shape[1] == min(n for n in lengths if n >= longest), (ids.shape, longest)
        assert src.shape[0] * max(src.shape[1], lab.shape[1]) <= 512  # the budget holds on both sides
        shorter_targets += lab.shape[1] < src.shape[1]
        assert (dec[:, 0] == START_ID).all()
        for d, l in zip(dec, lab):
            n = int((l != PAD_ID).sum())
            assert l[n - 1] == END_ID and (d[1:n] == l[: n - 1]).all() and (d[n:] == PAD_ID).all()
        seen += src.shape[0]
    assert seen == 1000  # nothing longer than 32 tokens in this corpus, nothing dropped
    assert shorter_targets > 0  # German number words are a few pieces, their English sources many


def test_dataset_drops_long_pairs_and_checks_budget(tokenizer):
    pairs = [("forty - two", "I pizza")] * 3 + [(" ".join(["pizza"] * 40), "I")]
    ds = make_dataset(pairs, tokenizer, batch_tokens=64, max_length=16, shuffle=False)
    assert sum(int(x["source_ids"].shape[0]) for x, _ in ds) == 3
    with pytest.raises(ValueError, match="batch_tokens=8, max_length=16"):
        make_dataset(pairs, tokenizer, batch_tokens=8, max_length=16)


@pytest.mark.parametrize("too_long", [10, 11])
def test_a_max_length_that_leaves_out_more_than_a_twentieth_of_the_pairs_is_reported(tokenizer, too_long):
    from keras_transformer.tools.run_setup import data_statistics

    long_source = " ".join(["pizza"] * 3)
    length = len(tokenizer.tokenize_dense([long_source]).numpy()[0])  # the longest pair's longer side
    assert 16 < length <= 64
    train = [("forty - two", "I pizza")] * 190 + [(long_source, "I")] * too_long
    corpus = corpora.Corpus(train=train, validation=train[:5], test=train[:5])
    summary = data_statistics(corpus, tokenizer, max_length=16)["summary"]
    assert f"190 kept, {too_long} longer than --max-length 16 dropped" in summary
    warning = [line for line in summary.splitlines() if line.startswith("warning:")]
    if too_long == 10:  # 10 of 200: 5%, not more
        assert warning == [], summary
    else:  # 11 of 201; 99% of the pairs fit the long ones' length, rounded up to a multiple of 8
        assert warning == [f"warning: {11 / 201:.1%} of the training pairs are longer than --max-length 16 and "
                           f"are not trained on (the longest is {length} tokens); --max-length "
                           f"{-(-length // 8) * 8} keeps 99% of them"], summary
    # At the bound: a source of `length` tokens fits --max-length `length`; a target of as many does not ([END]).
    edge = corpora.Corpus(train=[(long_source, "I")] * 100 + [("I", long_source)], validation=[], test=[])
    counts = data_statistics(edge, tokenizer, max_length=length)
    assert (counts["train_pairs"], counts["train_too_long"]) == (100, 1), counts


def test_datasets_run_without_tf_datas_autotuning_thread(tokenizer):
    # Deleting an iterator waits out the autotuner thread's optimization period (up to a
    # minute): an iterator `fit` left behind froze the process for up to 52 s when Python's
    # collector deleted it (`datasets._without_autotune_thread`).
    pairs = [("forty - two", "I pizza")] * 3
    for repeat in (False, True):
        ds = make_dataset(pairs, tokenizer, batch_tokens=64, max_length=16, repeat=repeat)
        assert ds.options().autotune.enabled is False


def test_a_budget_larger_than_the_data_makes_batches_of_the_pairs_there_are(tokenizer):
    # `--batch-tokens 2147483647`: a repeated dataset filled one batch with the same pairs,
    # pass after pass (268 million rows), and training never started. Here 600 tokens at
    # length 8 asked for 75 rows of 5 pairs.
    pairs = [(text, text) for text in UNICODE[:2]] + [("forty - two", "I pizza")] * 3
    batches = make_dataset(pairs, tokenizer, batch_tokens=600, max_length=16, repeat=True, shuffle=False)
    for x, _ in batches.take(4):
        assert int(x["source_ids"].shape[0]) <= len(pairs), x["source_ids"].shape


def test_a_vocabulary_asked_larger_than_the_texts_can_give_is_what_they_give():
    # `--vocab-size 2147483647`: SentencePiece's trainer never returned (its size times 1.1
    # overflows an int32) and Hugging Face's WordPiece trainer aborted the process, asking
    # for 141 GB; below that, both took time that grows with the size asked for. In a child
    # process: the failures were a hang and an abort.
    program = (
        "import json, sys; from keras_transformer.tools.text import Tokenizer; "
        "texts = [f'{i} times forty-two, said Ünal' for i in range(300)]; "
        "print(json.dumps([Tokenizer.build(texts, vocab_size=size, kind=kind, min_frequency=2).vocab_size "
        "for kind in ('sentencepiece', 'wordpiece') for size in (2**31 - 1, 20_000)]))"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    sentencepiece_huge, sentencepiece, wordpiece_huge, wordpiece = json.loads(result.stdout.strip().splitlines()[-1])
    assert sentencepiece_huge == sentencepiece and wordpiece_huge == wordpiece and wordpiece > 20, result.stdout


def test_a_corpus_reversed_swaps_every_pair_and_keeps_the_splits():
    corpus = corpora.numbers_corpus(train_size=200, validation_size=5, test_size=5)
    back = corpus.reversed()
    for split in ("train", "validation", "test"):
        assert getattr(back, split) == [(t, s) for s, t in getattr(corpus, split)]
    assert back.skipped_empty == corpus.skipped_empty and back.description.endswith("reversed")
    assert back.reversed().train == corpus.train


def test_a_text_longer_than_max_input_length_is_cut_with_one_warning(tokenizer):
    from keras_transformer.tools import evaluation

    class Recorder:
        """Stands in for a model: records the ids of each row and returns [END]."""
        vocab_size, pad_id = tokenizer.vocab_size, tokenizer.pad_id
        start_id, end_id = tokenizer.start_id, tokenizer.end_id
        rows = []

        def translate(self, source, beam_size, length_penalty, max_extra_length, compile=True):
            self.rows += [row[row != self.pad_id].tolist() for row in np.asarray(source)]
            return np.full((len(source), 1), self.end_id, "int32")

    # One line of 12,000 tokens took 9 GB to translate: self-attention is quadratic.
    long, short = " ".join(["forty two"] * 40), "forty two"
    ids = [row[row != tokenizer.pad_id].tolist() for row in tokenizer.tokenize_dense([long, short]).numpy()]
    model, limit = Recorder(), len(ids[1])  # the short text just fits
    with pytest.warns(evaluation.LongTextWarning, match=rf"^1 of the 2 texts is longer than max_input_length={limit} "
                                                        rf"tokens \(the longest: {len(ids[0])}\) and was cut to its "
                                                        rf"first {limit}"):
        evaluation.translate_texts(model, tokenizer, [long, short], max_input_length=limit)
    assert sorted(model.rows) == sorted([ids[0][:limit], ids[1]])
    model.rows = []
    evaluation.translate_texts(model, tokenizer, [long, short], max_input_length=None)  # no limit
    assert sorted(model.rows, key=len) == [ids[1], ids[0]]
    # Longer than the model was trained on: translated whole, with one warning.
    model.rows = []
    with pytest.warns(evaluation.LongTextWarning, match=rf"^1 of the 2 texts is longer than the longest source "
                                                        rf"the model was trained on \({limit} tokens, the run's "
                                                        rf"--max-length\): its translation "):
        evaluation.translate_texts(model, tokenizer, [long, short], max_input_length=None, trained_length=limit)
    assert sorted(model.rows, key=len) == [ids[1], ids[0]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        evaluation.translate_texts(model, tokenizer, [long, short], trained_length=len(ids[0]))  # none is longer


@pytest.mark.parametrize("beam_size", [1, 4])
def test_default_decode_batches_keep_the_token_budget_and_the_row_cap(tokenizer, beam_size):
    from keras_transformer.defaults import DECODE_BATCH_TOKENS, DECODE_MAX_BATCH, MAX_EXTRA_LENGTH
    from keras_transformer.tools import evaluation

    class Recorder:
        """Stands in for a model: records each batch and returns [END] for every row."""
        vocab_size, pad_id = tokenizer.vocab_size, tokenizer.pad_id
        start_id, end_id = tokenizer.start_id, tokenizer.end_id
        shapes = []

        def translate(self, source, beam_size, length_penalty, max_extra_length, compile=True):
            self.shapes.append(source.shape)
            return np.full((len(source), 1), self.end_id, "int32")

    model = Recorder()
    texts = [UNICODE[i % len(UNICODE)] for i in range(1000)]
    assert evaluation.translate_texts(model, tokenizer, texts, beam_size=beam_size) == [""] * 1000
    assert sum(rows for rows, _ in model.shapes) == 1000
    widths = {width for _, width in model.shapes}
    rows = max(rows for rows, _ in model.shapes)
    # A batch decodes until its last row ends: greedy search is capped by rows, beam search by tokens.
    assert rows <= DECODE_MAX_BATCH and all(w % 8 == 0 for w in widths)
    assert rows * beam_size * (max(widths) + MAX_EXTRA_LENGTH) <= DECODE_BATCH_TOKENS
    by_tokens = DECODE_BATCH_TOKENS // (beam_size * (max(widths) + MAX_EXTRA_LENGTH))
    assert rows == (DECODE_MAX_BATCH if beam_size == 1 else by_tokens)


def test_text_functions_refuse_a_bare_string_and_scores_need_one_hypothesis_per_reference(tokenizer):
    from types import SimpleNamespace

    from keras_transformer.tools import evaluation

    model = SimpleNamespace(vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id, start_id=tokenizer.start_id,
                            end_id=tokenizer.end_id)  # refused before anything is translated
    with pytest.raises(TypeError, match=r"`texts` must be a list of strings; for one text, pass \[text\]"):
        evaluation.translate_texts(model, tokenizer, "forty-two")
    with pytest.raises(TypeError, match="`references` must be a list of strings"):
        evaluation.score(["a b"], "a b")
    # Not UTF-8: invalid bytes translated to "", and lone surrogates (a file name read with
    # surrogateescape) failed inside TensorFlow's string conversion.
    for texts, shown in (([b"seven", b"caf\xe9"], r"texts\[1\]=b'caf\\xe9' \(unexpected end of data at position 3\)"),
                         (["ok", "\udcff abc"], r"texts\[1\]='\\udcff abc' \(surrogates not allowed at position 0\)")):
        with pytest.raises(ValueError, match=rf"`texts` must be UTF-8 text. Received: {shown}"):
            evaluation.translate_texts(model, tokenizer, texts)
    ids = tokenizer.tokenize_dense([b"caf\xc3\xa9 forty-two", "caf\u00e9 forty-two"]).numpy()  # UTF-8 bytes pass
    assert (ids[0] == ids[1]).all()
    for hypotheses, references in ((["a"], ["a", "b"]), ([], [])):
        with pytest.raises(ValueError, match=f"one hypothesis per reference, at least one. Received: "
                                             f"{len(hypotheses)} hypotheses, {len(references)} references"):
            evaluation.score(hypotheses, references)
    scores = evaluation.score(["the cat sat on the mat", "a dog"], ["the cat sat on the mat", "the dog"])
    assert scores["exact_match"] == 0.5 and scores["sentences"] == 2 and 0 < scores["bleu"] < 100


def test_word_bleu_tokenizes_as_sacrebleu_does_for_the_references_language(monkeypatch):
    # Chinese references were tokenized by 13a, one word per sentence: word BLEU was 0 for a
    # translation that differs in two characters of seven, and validation BLEU chose the best
    # epoch among zeros.
    import sacrebleu

    from keras_transformer.tools import evaluation

    hypotheses, references = ["我喜欢吃苹果。", "他很高兴。"], ["我喜欢吃香蕉。", "他很高兴。"]
    scores = evaluation.score(hypotheses, references)
    expected = sacrebleu.metrics.BLEU(tokenize="zh").corpus_score(hypotheses, [references])
    assert scores["bleu"] == round(expected.score, 2) and scores["bleu"] > 40 and "tok:zh" in scores["bleu_signature"]
    assert sacrebleu.metrics.BLEU().corpus_score(hypotheses, [references]).score < 40  # 13a's: only the exact one
    pick = evaluation.bleu_tokenizer
    monkeypatch.setattr(evaluation, "_mecab_installed", lambda: False)
    assert pick(["私はりんごが好きです。"]) == "char"  # "ja-mecab" with sacrebleu[ja] installed
    monkeypatch.setattr(evaluation, "_mecab_installed", lambda: True)
    assert pick(["私はりんごが好きです。"]) == "ja-mecab" and pick(["ฉันชอบแอปเปิ้ล"]) == "char"
    assert pick(["我喜欢 Python 和 JavaScript 编程。"]) == "zh"
    for spaced in (["I like apples.", "Tom met 李明 in Beijing."], ["나는 사과를 좋아한다."], ["Я люблю яблоки."], [""]):
        assert pick(spaced) == "13a", spaced
