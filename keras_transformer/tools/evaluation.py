"""Translate text with a trained run and score it: corpus BLEU and chrF (sacreBLEU), exact match."""

from __future__ import annotations

import json
import pathlib
import re
import threading
import warnings

import keras
import numpy as np

from keras_transformer import _checks
from keras_transformer.defaults import (BEAM_SIZE, DECODE_BATCH_TOKENS, DECODE_MAX_BATCH, LENGTH_PENALTY,
                                        MAX_EXTRA_LENGTH, MAX_INPUT_LENGTH, QUANTIZE_MODES)
from keras_transformer.tools import atomic, files
from keras_transformer.tools.files import RunDirError


def load_run(run_dir, model: str = "final", quantize: str | None = None):
    """The model and tokenizer of a training run directory.

    Args:
        run_dir: A directory written by `train`.
        model: `"final"` (`model.keras`, the averaged checkpoints) or `"best"`
            (`best/model.keras`, the best epoch by the run's validation score).
        quantize: `"int8"` to quantize the model's Dense layers (see `quantize_model`).
            Defaults to `None` (the saved float weights).
    """
    loaded = load_model_file(files.run_model_file(run_dir, model))
    if quantize is not None:
        quantize_model(loaded, quantize)
    return loaded, files.load_run_tokenizer(pathlib.Path(run_dir) / "tokenizer")


def quantize_model(model, mode: str = "int8"):
    """Quantize `model` in place with Keras' `model.quantize(mode)` and return it.

    `"int8"` stores every Dense kernel (attention projections, feed-forward layers) as
    int8 with one float scale per output channel, and quantizes each layer's input on the
    fly; the embedding (and so the tied output projection) and the layer norms stay
    float. Keras' warning for each layer without a `quantize` method (the layer norms) is
    not shown.

    Keras runs a full garbage collection each time it drops a float kernel (`Layer.__delattr__`,
    keras-team/keras#19954), 32 of them for a 3+3-layer model: seconds in a process that
    holds many objects. The objects that exist before the call are set aside for it
    (`gc.freeze`), so each of those collections looks only at what quantizing made, and
    one full collection at the end frees what they left, the float kernels included. A
    process that freezes objects itself (`gc.get_freeze_count() > 0`) is left as it is.
    """
    import gc
    import warnings

    if mode not in QUANTIZE_MODES:
        raise ValueError(f"`mode` must be one of {QUANTIZE_MODES}. Received: mode={mode!r}")
    with _ONE_QUANTIZATION_AT_A_TIME:
        set_aside = gc.get_freeze_count() == 0
        if set_aside:
            gc.freeze()
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*does not have a `quantize` method")
                model.quantize(mode)
        finally:
            if set_aside:
                gc.unfreeze()
                gc.collect()
    return model


# The collector's frozen set and the warning filters are the process's: two models
# quantized at once in two threads (a server loading two runs) would unfreeze each other's
# objects and put back each other's filters. One at a time.
_ONE_QUANTIZATION_AT_A_TIME = threading.Lock()


def load_model_file(model_file):
    """The Transformer saved in `model_file` (one that exists: see `files.run_model_file`).

    A file that cannot be loaded is a `RunDirError` naming it, why, and, in a run
    directory, how `train` writes it again."""
    import zipfile

    model_file = pathlib.Path(model_file)
    try:
        if not zipfile.is_zipfile(model_file):  # Keras says "File not found" for these
            raise ValueError("not a zip archive: damaged or cut short")
        model = keras.saving.load_model(model_file)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same message
        run = model_file.parent.parent if model_file.parent.name == "best" else model_file.parent
        fix = (f" Remove {run / 'metrics.json'} and run the same `keras-transformer train` again: it writes the "
               "run's models anew from its checkpoints." if (run / "config.json").is_file() else "")
        raise RunDirError(f"{model_file} is not a Keras model file ({type(e).__name__}: {str(e)[:200]}).{fix}") from None
    from keras_transformer.models import Transformer

    if not isinstance(model, Transformer):
        raise RunDirError(f"{model_file} holds a {type(model).__name__}, not a keras_transformer Transformer.")
    return model


def check_special_ids(model, tokenizer) -> None:
    """Refuse a model and tokenizer whose vocabulary size or special ids differ."""
    pairs = [("vocab_size", model.vocab_size, tokenizer.vocab_size)]
    pairs += [(name, getattr(model, name), getattr(tokenizer, name)) for name in ("pad_id", "start_id", "end_id")]
    differences = [f"{name}: model {m}, tokenizer {t}" for name, m, t in pairs if m != t]
    if differences:
        raise RunDirError(
            f"The model and the tokenizer disagree ({'; '.join(differences)}); use the tokenizer "
            "the model was trained with."
        )


def translate_texts(model, tokenizer, texts, beam_size=BEAM_SIZE, length_penalty=LENGTH_PENALTY,
                    batch_size: int | None = None, max_extra_length=MAX_EXTRA_LENGTH, n_best: int = 0,
                    max_input_length: int | None = MAX_INPUT_LENGTH, compile=True, trained_length: int | None = None):
    """Translate a list of strings, batched by length; returns strings in input order.

    `batch_size` sentences are decoded together; by default (`None`) as many as keep
    `batch_size x beam_size x (longest source + max_extra_length)` within
    `DECODE_BATCH_TOKENS`, at most `DECODE_MAX_BATCH`. With `n_best=n >= 1`, each result
    is instead the list of the `n` best `(translation, score)` pairs of the beam, best
    first (`n <= beam_size`). An empty text (or one with no tokens) translates to `""`, or
    with `n_best` to `[("", 0.0)]`: one empty translation, so that every text has an entry. A
    text longer than `max_input_length` tokens is cut to its first `max_input_length` (with
    one `LongTextWarning` for the call; `None`: no limit). `compile` is `Transformer.translate`'s
    (`False`: the eager search; `"torch.compile"` on PyTorch). `trained_length`: the
    longest source the model was trained on (a run's `--max-length`); texts longer than it
    are translated whole, with one `LongTextWarning` for the call (a model seldom carries a
    translation past the lengths it saw: a paragraph may come back as one sentence).
    """
    check_special_ids(model, tokenizer)
    batch_size, max_input_length, trained_length = _checks.positive_ints(
        optional=True, batch_size=batch_size, max_input_length=max_input_length, trained_length=trained_length)
    n_best = _checks.counts(n_best=n_best)
    texts = _checks.texts(texts)
    if not texts:
        return []
    ids = _token_ids(tokenizer, texts, max_input_length, trained_length)
    order = sorted(range(len(texts)), key=lambda i: len(ids[i]))
    if batch_size is None:
        # One batch size for the whole call: few shapes to compile.
        longest = -(-max(len(row) for row in ids) // 8) * 8 + max_extra_length
        batch_size = max(1, min(DECODE_MAX_BATCH, DECODE_BATCH_TOKENS // (max(beam_size, 1) * max(longest, 1))))
    results = [[("", 0.0)] if n_best else "" for _ in texts]  # one list per text, none shared
    for start in range(0, len(order), batch_size):
        chunk = [i for i in order[start : start + batch_size] if len(ids[i])]
        if not chunk:
            continue
        # Widths are rounded up to a multiple of 8: fewer shapes to compile.
        width = -(-max(len(ids[i]) for i in chunk) // 8) * 8
        source = np.full((len(chunk), width), tokenizer.pad_id, "int32")
        for r, i in enumerate(chunk):
            source[r, : len(ids[i])] = ids[i]
        if n_best:
            out, scores = model.translate(source, beam_size, length_penalty, max_extra_length, return_scores=True,
                                          num_hypotheses=n_best, compile=compile)
            out, scores = keras.ops.convert_to_numpy(out), keras.ops.convert_to_numpy(scores)
            if n_best == 1:  # (B, L), (B,) -> one hypothesis per row
                out, scores = out[:, None], scores[:, None]
            lines = tokenizer.detokenize_dense(out.reshape(-1, out.shape[-1]))
            for r, i in enumerate(chunk):
                results[i] = [(lines[r * n_best + j], float(scores[r, j])) for j in range(n_best)]
            continue
        out = model.translate(source, beam_size, length_penalty, max_extra_length, compile=compile)
        for i, text in zip(chunk, tokenizer.detokenize_dense(keras.ops.convert_to_numpy(out))):
            results[i] = text
    return results


class LongTextWarning(UserWarning):
    """`count` of `total` texts are longer than `limit` tokens (the longest: `longest`).

    `cut`: the limit is `max_input_length` and the texts were cut to it; otherwise it is the
    longest source the model was trained on, and they were translated whole. `translate`
    sums those of a file's chunks (`LongTextWarning.combined`) into one line per kind."""

    def __init__(self, count: int, total: int, limit: int, longest: int, cut: bool):
        self.count, self.total, self.limit, self.longest, self.cut = count, total, limit, longest, cut
        texts = "the text is" if total == 1 else f"{count:,} of the {total:,} texts {'is' if count == 1 else 'are'}"
        if cut:
            message = (f"{texts} longer than max_input_length={limit} tokens (the longest: {longest:,}) and "
                       f"{'was' if count == 1 else 'were'} cut to {'its' if count == 1 else 'their'} first {limit}")
        else:
            message = (f"{texts} longer than the longest source the model was trained on ({limit} tokens, the run's "
                       f"--max-length): {'its translation' if count == 1 else 'their translations'} may stop short")
        super().__init__(message + "; split long texts into sentences")

    @staticmethod
    def combined(found: list, total: int) -> list:
        """One warning per kind and limit for the `LongTextWarning`s in `found`, out of
        `total` texts in all."""
        kinds = {}
        for w in found:
            kinds.setdefault((w.cut, w.limit), []).append(w)
        return [LongTextWarning(sum(w.count for w in ws), total, limit, max(w.longest for w in ws), cut)
                for (cut, limit), ws in kinds.items()]


def _token_ids(tokenizer, texts: list, max_input_length: int | None, trained_length: int | None) -> list:
    """Each text's token ids (one tokenizer call for all, ragged: a long line does not pad
    every other one), cut to `max_input_length` with one `LongTextWarning` for the call, and
    one more for the texts longer than `trained_length` (`translate_texts`)."""
    import tensorflow as tf  # the tokenizer's ops

    ragged = tokenizer.tokenize(tf.constant(texts, tf.string))
    flat, lengths = ragged.flat_values.numpy().astype("int32"), ragged.row_lengths().numpy()
    ids = np.split(flat, np.cumsum(lengths)[:-1])
    if max_input_length is not None and lengths.max() > max_input_length:
        warnings.warn(LongTextWarning(int((lengths > max_input_length).sum()), len(texts), max_input_length,
                                      int(lengths.max()), cut=True), stacklevel=3)
        ids = [row[:max_input_length] for row in ids]
    longer = [len(row) for row in ids if trained_length is not None and len(row) > trained_length]
    if longer:
        warnings.warn(LongTextWarning(len(longer), len(texts), trained_length, max(longer), cut=False), stacklevel=3)
    return ids


# Scripts written without spaces between words: Han (with its extensions and compatibility
# ideographs); kana (Hiragana, Katakana and its extension, half-width Katakana); Thai, Lao,
# Myanmar and Khmer.
_HAN = re.compile("[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f]")
_KANA = re.compile("[\u3040-\u30ff\u31f0-\u31ff\uff66-\uff9d]")
_OTHER_UNSPACED = re.compile("[\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff]")


def bleu_tokenizer(references: list[str]) -> str:
    """sacreBLEU's tokenizer for word BLEU against `references`, chosen by their script as
    sacreBLEU chooses by target language: `"zh"` for Chinese and `"ja-mecab"` for Japanese
    (when `sacrebleu[ja]` is installed), whose sentences its default `"13a"` would count
    as one or two words each (and BLEU would be about 0 whatever the output); `"char"` for
    Japanese without MeCab and for Thai, Lao, Myanmar and Khmer; else `"13a"`. The
    signature names the choice."""
    text = "".join(references)
    letters = len(text) - sum(c.isspace() for c in text)
    han, kana, other = (len(script.findall(text)) for script in (_HAN, _KANA, _OTHER_UNSPACED))
    if not letters or han + kana + other < 0.2 * letters:  # mostly words between spaces
        return "13a"
    if kana > 0.1 * (han + kana) or other > han:
        return "ja-mecab" if kana > other and _mecab_installed() else "char"
    return "zh"


def _mecab_installed() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("MeCab", "ipadic"))


def score(hypotheses, references, tokenizer=None) -> dict:
    """Corpus BLEU (word and character level) and chrF (sacreBLEU) and exact match.

    Word BLEU tokenizes as sacreBLEU does for the references' language (`bleu_tokenizer`).
    References are NFC-normalised with runs of spaces as one, as a SentencePiece round
    trip gives them back. With a WordPiece tokenizer they pass through its round trip
    instead, so that its spacing around punctuation is not counted as an error (and
    the scores are then not comparable with scores on the raw references).
    """
    import sacrebleu

    hypotheses, references = _checks.texts(hypotheses, "hypotheses"), _checks.texts(references, "references")
    if len(hypotheses) != len(references) or not references:
        raise ValueError(f"Give one hypothesis per reference, at least one. Received: {len(hypotheses)} hypotheses, "
                         f"{len(references)} references")
    if tokenizer is not None and tokenizer.kind == "wordpiece":
        references = tokenizer.detokenize_dense(tokenizer.tokenize_dense(references).numpy())
    else:
        from keras_transformer.tools.text.tokenizer import normalise

        references = [normalise(r) for r in references]
    bleu = sacrebleu.metrics.BLEU(tokenize=bleu_tokenizer(references))
    # Word BLEU has no 2- to 4-grams in one-word sentences (German number words are single
    # compounds) and is then 0 whatever the output; character BLEU still measures them.
    bleu_char = sacrebleu.metrics.BLEU(tokenize="char")
    chrf = sacrebleu.metrics.CHRF()
    bleu_score = bleu.corpus_score(hypotheses, [references])
    bleu_char_score = bleu_char.corpus_score(hypotheses, [references])
    chrf_score = chrf.corpus_score(hypotheses, [references])
    exact = float(np.mean([h == r for h, r in zip(hypotheses, references)]))
    return {
        "bleu": round(bleu_score.score, 2),
        "bleu_char": round(bleu_char_score.score, 2),
        "chrf": round(chrf_score.score, 2),
        "exact_match": round(exact, 4),
        "sentences": len(references),
        "bleu_signature": str(bleu.get_signature()),
        "bleu_char_signature": str(bleu_char.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
    }


def write_lines(path, lines) -> None:
    """Write `lines`, one per line (UTF-8), to `path` in place once written, making its
    folder; gzip-compressed when the name ends in `.gz`, as an input so named is read."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(line + "\n" for line in lines)
    if path.name.endswith(".gz"):
        import gzip

        with atomic.atomic_write(path) as tmp:
            tmp.write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))
    else:
        atomic.write_text(path, text)


def dumps(data) -> str:
    return json.dumps(data, ensure_ascii=False)
