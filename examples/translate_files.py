"""Translation end to end on your own parallel files: train, evaluate, translate.

Give one sentence per line in two aligned files (`--source-file`, `--target-file`).
Without them, the script writes English and Spanish number words from the built-in
numbers corpus to two files first, so it runs anywhere. The recipe is the paper's
(shared SentencePiece vocabulary, token-budget batches, label smoothing, warm-up, checkpoint
averaging) through `kt.training.train`, the library's `keras-transformer train`; the
run directory can be resumed, evaluated and exported with the same CLI:

    KERAS_BACKEND=jax python examples/translate_files.py [--steps 400] [--run-dir runs/example]
"""

import argparse
import pathlib
import tempfile

from keras_transformer.tools.evaluation import load_run, score, translate_texts
from keras_transformer.tools.text import corpora
from keras_transformer.tools.training import TrainConfig, train


def write_example_files(directory, size):
    """Two aligned files of English and Spanish number words."""
    corpus = corpora.numbers_corpus(train_size=size, validation_size=0, test_size=0, target_lang="es")
    directory.mkdir(parents=True, exist_ok=True)
    source, target = directory / "train.en", directory / "train.es"
    source.write_text("".join(s + "\n" for s, _ in corpus.train), encoding="utf-8")
    target.write_text("".join(t + "\n" for _, t in corpus.train), encoding="utf-8")
    return source, target


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source-file", type=pathlib.Path)
    parser.add_argument("--target-file", type=pathlib.Path)
    parser.add_argument("--run-dir", type=pathlib.Path, help="Where the run goes. Default: a temporary folder.")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--size", type=int, default=20000, help="Pairs to generate when no files are given.")
    parser.add_argument("--holdout", type=int, help="Pairs held out for validation and for test (default: train's, "
                                                    "500 or a tenth of a corpus of fewer than 5,000 pairs).")
    parser.add_argument("--eval-size", type=int, default=100)
    args = parser.parse_args(argv)
    run_dir = args.run_dir or pathlib.Path(tempfile.mkdtemp(prefix="kt-translate-")) / "run"
    if args.source_file is None:
        args.source_file, args.target_file = write_example_files(run_dir.parent / "data", args.size)
        print(f"wrote example files {args.source_file} and {args.target_file}")

    config = TrainConfig(corpus="files", source_file=str(args.source_file), target_file=str(args.target_file),
                         holdout=args.holdout, preset="tiny", steps=args.steps,
                         steps_per_epoch=min(100, args.steps), batch_tokens=2048, vocab_size=1000)
    metrics = train(config, run_dir, verbose=2)
    print(f"teacher-forced test token accuracy: {metrics['test_accuracy']:.3f}")

    model, tokenizer = load_run(run_dir)
    pairs = corpora.corpus_from_files(args.source_file, args.target_file, holdout=args.holdout).test
    pairs = pairs[: args.eval_size]
    translations = translate_texts(model, tokenizer, [s for s, _ in pairs], beam_size=4)
    scores = score(translations, [t for _, t in pairs], tokenizer)
    print(f"beam 4 on {len(pairs)} held-out pairs: " + ", ".join(
        f"{k} {v:.2f}" for k, v in scores.items() if isinstance(v, float)))
    for (source, reference), translation in list(zip(pairs, translations))[:3]:
        print(f"  {source}  ->  {translation}   (reference: {reference})")
    print(f"run directory: {run_dir} (keras-transformer evaluate / translate / export --run-dir {run_dir})")
    return scores


if __name__ == "__main__":
    main()
