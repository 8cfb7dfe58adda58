"""What a run needs before it trains: its corpus, the checks of its output directory,
its vocabulary (learned or read back) and what the input pipeline keeps of the text.

`train` calls these on the chief, before it trains; `launch` calls `check_output_dir`
before it starts the processes. Imports no backend: Keras is imported where it is used.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re

from keras_transformer.tools import files
from keras_transformer.tools.config import RunError, TrainConfig
from keras_transformer.tools.corpus_kinds import CORPORA, CORPUS_FILES

__all__ = ["check_corpus_unchanged", "check_mixed_precision", "check_output_dir", "check_saved_progress",
           "data_statistics", "load_corpus", "prepare", "state_error"]


def load_corpus(config: TrainConfig):
    from keras_transformer.tools.text import corpora

    try:
        corpus = CORPORA[config.corpus].load(config)
    except corpora.CorpusError as e:
        raise RunError(str(e)) from None
    return corpus.reversed() if config.reverse else corpus


# Fewest training pairs a run accepts after filtering.
MIN_TRAIN_PAIRS = 100
# Share of [UNK] in the tokenized training text above which the vocabulary is reported.
UNK_WARNING = 0.02
# Share of the training pairs longer than --max-length above which the setting is reported.
TOO_LONG_WARNING = 0.05


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def _same_setting(key: str, saved, now) -> bool:
    """Whether a saved setting is the one given now: a corpus file named another way (a
    relative path from another folder, a link) is the same file. (Whether its text
    changed since is `check_corpus_unchanged`'s question.)"""
    if saved == now:
        return True
    if key not in CORPUS_FILES or not (saved and now):
        return False
    try:
        return os.path.samefile(saved, now)
    except OSError:  # one of them is not there (any more): another file
        return False


def _shown(value) -> str:
    """A setting as a difference of configs names it: `None` is a flag not given (its
    default is worked out from the run, as `--holdout`'s and `--warmup-steps`' are)."""
    return "not given" if value is None else repr(value)


def check_output_dir(directory: pathlib.Path, config: TrainConfig) -> bool:
    """Refuse an output path that is a file, a directory that holds something other than
    a run, or a run with a different config; return whether a run is there to resume."""
    if directory.exists() and not directory.is_dir():
        raise RunError(f"--output-dir {directory} is a file, not a directory.")
    problem = files.creation_problem(directory)
    if problem:
        raise RunError(f"--output-dir {directory}: {problem}.")
    problem = directory.is_dir() and files.misplaced_run_file(directory)
    if problem:
        raise RunError(f"{problem}. Move it out of {directory}, or use another --output-dir.")
    config_file = directory / "config.json"
    if not config_file.exists():
        held = set(os.listdir(directory)) if directory.is_dir() else set()
        foreign = sorted(n for n in held if not files.run_name(n))
        if foreign:
            raise RunError(
                f"--output-dir {directory} is not empty and holds no run ({_some(foreign)}); "
                "choose a new or empty directory."
            )
        # A run writes its config first: only the lock and the config's temporary name are
        # there before it. A run's files without it are a run that lost its settings, which
        # a new run would overwrite (its vocabulary learned again under the saved weights).
        trained = sorted(held & set(files.RUN_FILES) - {"train.lock"})
        if trained:
            raise RunError(
                f"{config_file} is missing, but {directory} holds a run's files ({_some(trained)}). A run writes "
                "its config.json first: restore it from a copy of the run directory, or choose another --output-dir."
            )
        return False
    try:
        saved = files.json_object(config_file)
    except ValueError as e:  # not UTF-8, not JSON, not an object
        raise RunError(f"{config_file} is not a run config ({e}); restore it from a copy of the run directory, "
                       "or choose another --output-dir.") from None
    current = dataclasses.asdict(config)
    # A setting added after the run was written has its default there; one the run's
    # corpus does not read (an older version kept `--holdout` with the numbers corpus) is
    # not compared.
    saved = {**dataclasses.asdict(TrainConfig()), **saved}
    unread = config.unread_settings() if saved.get("corpus") == config.corpus else {}
    differences = [
        f"{key}: saved {_shown(saved.get(key))}, now {_shown(current.get(key))}"
        for key in sorted(set(saved) | set(current))
        if not _same_setting(key, saved.get(key), current.get(key)) and key not in unread
    ]
    if differences:
        raise RunError(
            f"{directory} holds a run with a different config ({'; '.join(differences)}). "
            "Use another --output-dir, or the same flags to resume that run."
        )
    return True


def check_saved_progress(directory: pathlib.Path) -> None:
    """Refuse to resume a run whose saved progress cannot be read: the resumption state,
    the epoch checkpoints, the best epochs' checkpoints and scores, and the log. Checked
    before training, so that a damaged file is one line naming it and what to do, not an
    error after the epochs that are left."""
    from keras_transformer.tools import callbacks, checkpoints

    try:
        done, _ = checkpoints.TrainingState.progress(directory / "state")
    except ValueError as e:
        raise state_error(e, directory) from None
    saved = [path for kept in ("checkpoints", "best") for path in sorted((directory / kept).glob("checkpoint_*.npz"))]
    if (done or saved) and not (directory / "tokenizer").is_dir():
        # Learned again, a vocabulary may number its pieces otherwise (WordPiece's learner
        # is not deterministic), and the saved weights would be read in other ids.
        raise RunError(f"{directory / 'tokenizer'} is missing, but the run has trained in its vocabulary's ids. "
                       "A run's tokenizer is written once, when the run starts: restore the directory from a copy "
                       "of the run directory, or train a new run in another --output-dir.")
    for path in saved:
        checkpoints.check_checkpoint(path)
    checkpoints.read_scores(directory / "best")
    if (directory / "log.csv").is_file():
        callbacks.read_log(directory / "log.csv")


def state_error(error: ValueError, directory: pathlib.Path) -> RunError:
    """The message for a resumption state that cannot be read (or loaded into the model)."""
    return RunError(f"{error}. Remove {directory / 'state'} to train the run from its start, or use another "
                    "--output-dir.")


def check_corpus_unchanged(directory: pathlib.Path, corpus) -> None:
    """Refuse a corpus whose training pairs differ from those the run in `directory`
    started with (`data.json`'s `train_digest`): a corpus file edited since then splits
    differently, so pairs held out before could be trained on, or scored as unseen. (The
    held-out splits may be cut shorter, as `demo --eval-size` does.) A run of a version
    that kept no digest is not checked; a record that cannot be read is refused (train
    would write it anew from the corpus given, and the check would be lost unseen)."""
    path = directory / "data.json"
    try:
        record = files.json_object(path)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        raise RunError(f"{path} is not the run's data record ({type(e).__name__}: {e}). It holds the digest that "
                       "tells whether the corpus is the one the run started with: restore it from a copy of the run "
                       "directory, or remove it to go on without that check.") from None
    saved = record.get("train_digest")
    if saved is not None and saved != corpus.digest(["train"]):
        raise RunError(
            f"The corpus ({corpus.description}) is not the one the run in {directory} started with: its training "
            "pairs differ, so held-out pairs could be trained on or scored as unseen. Restore the corpus file, or "
            "train a new run on it in another --output-dir."
        )


def check_mixed_precision(precision: str | None) -> None:
    """Refuse a mixed precision the running backend cannot compute, naming the reason."""
    import keras

    if precision == "float16" and keras.backend.backend() == "jax":
        import jax

        if jax.default_backend() == "cpu":
            # XLA's CPU dot_general has no float16 x float16 -> float32 kernel, which Keras'
            # JAX matmul asks for ("The precision 'F16_F16_F32' is not supported").
            raise RunError(
                "--mixed-precision float16 cannot run on JAX on a CPU (XLA has no float16 matrix product "
                "with float32 accumulation there); use --mixed-precision bfloat16, or a GPU."
            )


def prepare(config, output_dir, corpus, resuming):
    """The chief's share before training: `(tokenizer, data statistics)`, printed."""
    from keras_transformer.tools.text.tokenizer import Tokenizer

    print(corpus.summary(), flush=True)
    if resuming:
        check_corpus_unchanged(output_dir, corpus)
    tokenizer_dir = output_dir / "tokenizer"
    if resuming and tokenizer_dir.is_dir():
        tokenizer = files.load_run_tokenizer(tokenizer_dir)
    else:
        texts = [s for s, _ in corpus.train] + [t for _, t in corpus.train]
        try:
            tokenizer = Tokenizer.build(
                texts, config.vocab_size, kind=config.tokenizer, lower_case=config.lower_case,
                min_frequency=config.min_frequency,
            )
        except ValueError as e:  # e.g. a vocabulary too small for the corpus's characters
            raise RunError(f"--vocab-size {config.vocab_size}: {e}") from None
    print(f"vocabulary: {tokenizer.vocab_size} {tokenizer.kind} tokens (asked for at most {config.vocab_size})",
          flush=True)
    data = data_statistics(corpus, tokenizer, config.max_length, "holdout" in CORPORA[config.corpus].reads)
    print(data["summary"], flush=True)
    return tokenizer, data


def finished_metrics(config: TrainConfig, output_dir) -> dict | None:
    """The test metrics of a run in `output_dir` that has nothing left to do, else None.

    A run is finished when its saved state has done every epoch (or was stopped by a
    callback) and `metrics.json` is there: it is written last, after `model.keras`, so a
    run killed while finishing is not finished and resumes to write the rest.
    """
    from keras_transformer.tools import checkpoints

    output_dir = pathlib.Path(output_dir)
    epochs = config.epochs()
    try:
        done, stopped = checkpoints.TrainingState.progress(output_dir / "state")
    except ValueError:
        return None  # a state file that is not one: resuming reports it
    if (done < epochs and not stopped) or not (output_dir / "model.keras").is_file():
        return None
    try:
        metrics = files.json_object(output_dir / "metrics.json")
    except (OSError, ValueError):  # missing, not UTF-8, JSON or an object: the run writes it again
        return None
    return metrics if isinstance(metrics.get("steps"), int) else None


def data_statistics(corpus, tokenizer, max_length: int, holdout_flag: bool = False) -> dict:
    """What the input pipeline will keep and drop, and how much of the text is `[UNK]`.

    Raises `RunError` when fewer than `MIN_TRAIN_PAIRS` training pairs fit `max_length`;
    with `holdout_flag` (a corpus that reads `--holdout`) its message offers that flag too.
    """
    import numpy as np

    counts = {"empty_skipped": corpus.skipped_empty, "duplicates_dropped": corpus.duplicates_dropped,
              "split": corpus.description, "train_digest": corpus.digest(["train"])}
    for split in ("train", "validation", "test"):
        pairs = getattr(corpus, split)
        if not pairs:
            counts[f"{split}_pairs"] = counts[f"{split}_too_long"] = 0
            continue
        source = tokenizer.tokenize_dense([s for s, _ in pairs]).numpy()
        target = tokenizer.tokenize_dense([t for _, t in pairs]).numpy()
        source_length = (source != tokenizer.pad_id).sum(1)
        target_length = (target != tokenizer.pad_id).sum(1)
        # The pipeline's rule: source <= max_length, target + [END] <= max_length.
        longest = np.maximum(source_length, target_length + 1)
        too_long = int(np.sum(longest > max_length))
        counts[f"{split}_pairs"] = len(pairs) - too_long
        counts[f"{split}_too_long"] = too_long
        if split == "train":
            train_longest = longest
            tokens = int(source_length.sum() + target_length.sum())
            unknown = int((source == tokenizer.unk_id).sum() + (target == tokenizer.unk_id).sum())
            counts["train_unk_rate"] = round(unknown / max(tokens, 1), 5)
            byte_ids = _byte_pieces(tokenizer)
            spelled = int(np.isin(source, byte_ids).sum() + np.isin(target, byte_ids).sum())
            counts["train_byte_rate"] = round(spelled / max(tokens, 1), 5)
    kept, dropped = counts["train_pairs"], counts["train_too_long"]
    summary = (
        f"training pairs: {kept} kept, {dropped} longer than --max-length {max_length} dropped, "
        f"{corpus.skipped_empty} with an empty side skipped; "
        f"[UNK] is {counts['train_unk_rate']:.2%} of the training tokens"
    )
    if counts["train_unk_rate"] > UNK_WARNING:
        summary += (
            f"\nwarning: {counts['train_unk_rate']:.1%} of the training tokens are [UNK]; a larger "
            "--vocab-size or a smaller --min-frequency covers more of the text"
        )
    if counts.get("train_byte_rate", 0) > UNK_WARNING:
        summary += "\n" + _bytes_warning(counts["train_byte_rate"], corpus, tokenizer)
    if dropped > TOO_LONG_WARNING * len(corpus.train):
        summary += "\n" + _too_long_warning(dropped / len(corpus.train), max_length, train_longest)
    if kept < MIN_TRAIN_PAIRS:
        held_out = f"{len(corpus.validation)} and {len(corpus.test)} held out for validation and test, "
        fixes = "Raise --max-length, hold out fewer pairs (--holdout N)," if holdout_flag else "Raise --max-length"
        raise RunError(
            f"only {kept} training pairs are left ({held_out if holdout_flag else ''}{dropped} longer than "
            f"--max-length {max_length} dropped, {corpus.skipped_empty} with an empty side skipped); at least "
            f"{MIN_TRAIN_PAIRS} are needed. {fixes} or give a larger corpus."
        )
    return {**counts, "summary": summary}


def _byte_pieces(tokenizer) -> list[int]:
    """The ids of a SentencePiece vocabulary's byte pieces (`<0x00>` to `<0xFF>`), which spell
    a character that has no piece of its own."""
    if tokenizer.kind != "sentencepiece":
        return []
    return [i for i, piece in enumerate(tokenizer.vocabulary) if re.fullmatch(r"<0x[0-9A-F]{2}>", piece)]


def _bytes_warning(rate: float, corpus, tokenizer) -> str:
    """The line that reports a vocabulary too small for the text's characters, whose rarest
    are spelled as bytes (`vocabulary.without_rare_characters`), with the size that fits them."""
    from keras_transformer.tools.text.vocabulary import vocabulary_for_characters

    characters = set()
    for pair in corpus.train:
        characters.update(*(text.lower() if tokenizer.lower_case else text for text in pair))
    pieces = set(tokenizer.vocabulary)
    spelled = sum(not c.isspace() and c not in pieces for c in characters)
    return (f"warning: {rate:.1%} of the training tokens are UTF-8 bytes, which spell the {spelled:,} rarest of the "
            f"text's {len(characters):,} distinct characters (they have no piece of their own); a --vocab-size of at "
            f"least {vocabulary_for_characters(len(characters)):,} gives each character a piece")


def _too_long_warning(share: float, max_length: int, lengths) -> str:
    """The line that reports a --max-length that leaves out `share` of the training pairs,
    with the setting that keeps 99% of them (`lengths`: each pair's longer side, with `[END]`)."""
    import numpy as np

    fits = -(-int(np.percentile(lengths, 99, method="higher")) // 8) * 8  # up to a multiple of 8
    return (f"warning: {share:.1%} of the training pairs are longer than --max-length {max_length} and are not "
            f"trained on (the longest is {int(np.max(lengths))} tokens); --max-length {fits} keeps 99% of them")
