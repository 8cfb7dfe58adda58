"""Translation quality on real text: train with a fixed split and seed, then score.

Trains one run with `keras-transformer train`'s code on a real parallel corpus (a
Tatoeba/Anki TSV, or two aligned files), then translates its test split greedily and
with beam 4 and scores both with sacreBLEU (BLEU and chrF, signatures included). Writes
`real_text.json` and `real_text.md` beside the run: the split (sizes, seed, dropped
pairs), the whole wall time (vocabulary, compilation and evaluation included), the
training time, steps, tokens per second, the validation-BLEU curve, the scores, and
how many test translations have a space before `.`, `,`, `!` or `?`.

    KERAS_BACKEND=tensorflow python benchmarks/real_text.py \\
        --tsv ../shared/data/tatoeba-deu-eng/pairs.tsv.gz --reverse --steps 1500 \\
        --output-dir runs/tatoeba-de-en

`--engines keras keras-int8 ctranslate2 ctranslate2-int8` adds beam 4 rows after Keras'
`model.quantize("int8")` and with CTranslate2 (float32 and int8) on the run's export, each
timed on the same sentences; run again on a finished `--output-dir`, it only evaluates.

The Tatoeba copy is `English<TAB>German`: `--reverse` translates German to English.
Its data is CC-BY 2.0 (France), "www.manythings.org/anki and tatoeba.org".
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import re
import time

# What the benchmark changes from `train`'s defaults, for real text on a CPU.
# A short run: the peak learning rate (at warm-up's end) is 0.5 x 256^-0.5 x 500^-0.5 = 1.4e-3.
RECIPE = dict(
    preset="small", vocab_size=8000, max_length=64, batch_tokens=4096, warmup_steps=500,
    learning_rate_scale=0.5, steps_per_epoch=150, validate_translations=500, average_checkpoints=2,
    average_from="last",
)


ENGINES = ("keras", "keras-int8", "ctranslate2", "ctranslate2-int8")
# Pairs in each held-out split, the published runs' (a 2,001-pair test split of Tatoeba).
HOLDOUT = 2000


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tsv", help="Tab-separated pairs, source first (plain or .gz).")
    p.add_argument("--source-file")
    p.add_argument("--target-file")
    p.add_argument("--reverse", action="store_true", help="Translate the second column into the first.")
    p.add_argument("--holdout", type=int, help=f"Pairs in each of validation and test (default: {HOLDOUT}, or a tenth "
                                               f"of a corpus of fewer than {10 * HOLDOUT:,} distinct pairs).")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--minutes", type=float,
                   help="Stop training (at the end of the step running then) once the whole run has taken this "
                        "long, leaving the evaluation to run: for runs of a fixed wall time on each backend.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batch-size", type=int, default=64)
    p.add_argument("--passes", type=int, default=1,
                   help="Translate the test split this many times; the time reported is the last pass's (the "
                        "first compiles our search for each batch shape).")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=["keras"],
                   help="Who translates the test split: keras (our greedy and beam 4), keras-int8 (beam 4 after "
                        "Keras' model.quantize('int8')), ctranslate2 / ctranslate2-int8 (beam 4 with CTranslate2 "
                        "float32 / int8 on the run's export; needs the ctranslate2 extra). A finished run in "
                        "--output-dir is not trained again, so engines can be added to it later.")
    p.add_argument("--ctranslate2-threads", type=int, default=os.cpu_count() or 1,
                   help="CTranslate2's intra_threads (default: every core; on a small machine one thread "
                        "can be the faster).")
    p.add_argument("--output-dir", default="runs/real-text")
    for key, value in RECIPE.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    args = p.parse_args(argv)
    if not args.tsv and not (args.source_file and args.target_file):
        p.error("give --tsv FILE, or --source-file and --target-file")
    return args


def holdout(args) -> int:
    """`--holdout`, or `HOLDOUT` where the corpus has ten times as many distinct pairs and
    a tenth of it where fewer, as `train` does with its own default."""
    if args.holdout is not None:
        return args.holdout
    from keras_transformer.tools.text import corpora

    if args.tsv:
        pairs, _ = corpora.read_tsv(args.tsv)
    else:
        pairs, _ = corpora.read_parallel_files(args.source_file, args.target_file)
    return corpora.default_holdout(len(set(pairs)), most=HOLDOUT)


def time_limit(deadline: float):
    """A Keras callback that stops training once `time.time()` passes `deadline`."""
    import keras

    class TimeLimit(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if time.time() >= deadline:
                self.model.stop_training = True

    return TimeLimit()


def space_before_punctuation(lines) -> int:
    return sum(bool(re.search(r" [.,!?]", line)) for line in lines)


def tokens_per_step(corpus, tokenizer, config, batches: int = 50) -> float:
    """Mean non-padding tokens (source + target) in the training batches."""
    import numpy as np

    from keras_transformer.tools.text.datasets import make_dataset

    data = make_dataset(corpus.train, tokenizer, config.batch_tokens, config.max_length, shuffle=True,
                        repeat=True, drop_remainder=True, seed=config.seed)
    counts = []
    for inputs, labels in data.take(batches):
        counts.append(int(np.sum(inputs["source_ids"].numpy() != tokenizer.pad_id))
                      + int(np.sum(labels.numpy() != tokenizer.pad_id)))
    return float(np.mean(counts)) * config.accumulate_steps


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.time()
    import keras

    from keras_transformer.tools import evaluation
    from keras_transformer.tools.config import TrainConfig
    from keras_transformer.tools.run_setup import load_corpus
    from keras_transformer.tools.training import train

    config = TrainConfig(
        corpus="tsv" if args.tsv else "files", tsv=args.tsv, source_file=args.source_file,
        target_file=args.target_file, reverse=args.reverse, holdout=holdout(args), steps=args.steps,
        seed=args.seed, **{key: getattr(args, key) for key in RECIPE},
    )
    out = pathlib.Path(args.output_dir)
    corpus = load_corpus(config)
    extra = [time_limit(start + args.minutes * 60)] if args.minutes else []
    metrics = train(config, out, verbose=2, corpus=corpus, callbacks=extra)
    train_done = time.time()

    model, tokenizer = evaluation.load_run(out)
    sources, references = [s for s, _ in corpus.test], [t for _, t in corpus.test]
    previous = json.loads((out / "real_text.json").read_text(encoding="utf-8")) if (out / "real_text.json").is_file() else {}
    results = dict(previous.get("test", {}))
    for name, translate in decoders(args, out, model, tokenizer):
        seconds = []
        for _ in range(args.passes):
            t = time.time()
            hypotheses = translate(sources)
            seconds.append(round(time.time() - t, 1))
        scores = evaluation.score(hypotheses, references, tokenizer)
        # The first pass compiles our search for each batch shape; a later one does not.
        scores["seconds"], scores["first_pass_seconds"] = seconds[-1], seconds[0]
        scores["space_before_punctuation"] = space_before_punctuation(hypotheses)
        evaluation.write_lines(out / f"hypotheses.test.{name.replace(' ', '.')}.txt", hypotheses)
        results[name] = scores
        print(f"{name}: BLEU {scores['bleu']:.2f} chrF {scores['chrf']:.2f} ({scores['seconds']} s)", flush=True)
    with open(out / "log.csv", newline="") as f:
        # The last epoch may have been cut short by --minutes.
        curve = [{"step": min((int(r["epoch"]) + 1) * config.steps_per_epoch, metrics["steps"]),
                  "val_bleu": float(r["val_bleu"]),
                  "val_chrf": float(r["val_chrf"])} for r in csv.DictReader(f) if r.get("val_bleu")]
    data = json.loads((out / "data.json").read_text(encoding="utf-8"))
    per_step = tokens_per_step(corpus, tokenizer, config)
    train_seconds = metrics.get("train_seconds_this_session", 0.0)
    trained = "wall_seconds" not in previous or previous.get("train_seconds") != train_seconds
    report = {
        "backend": keras.backend.backend(),
        "corpus": corpus.description,
        "direction": "second column -> first" if args.reverse else "first column -> second",
        "split": {"train": len(corpus.train), "validation": len(corpus.validation), "test": len(corpus.test),
                  "seed": args.seed, "duplicates_dropped": corpus.duplicates_dropped,
                  "empty_skipped": corpus.skipped_empty, "train_too_long": data["train_too_long"]},
        "config": {k: getattr(config, k) for k in ("preset", "vocab_size", "batch_tokens", "warmup_steps",
                                                   "learning_rate_scale", "steps", "average_checkpoints",
                                                   "average_from", "max_length", "holdout",
                                                   "validate_translations")},
        "minutes_limit": args.minutes,
        "vocabulary": tokenizer.vocab_size,
        "steps": metrics["steps"],
        "train_seconds": train_seconds,
        "tokens_per_step": round(per_step, 1),
        "tokens_per_second": round(per_step * metrics["steps"] / train_seconds, 1) if train_seconds else None,
        # A finished run evaluated again keeps the wall times of the session that trained it.
        "wall_seconds": round(time.time() - start, 1) if trained else previous["wall_seconds"],
        "train_wall_seconds": round(train_done - start, 1) if trained else previous["train_wall_seconds"],
        "evaluation_seconds": round(time.time() - train_done, 1),
        "validation_curve": curve,
        "best_epoch_val_bleu": metrics.get("best_val_bleu"),
        "last_epoch_val_bleu": curve[-1]["val_bleu"] if curve else None,
        "test": results,
        "cpu_count": os.cpu_count(),
    }
    (out / "real_text.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "real_text.md").write_text(markdown(report), encoding="utf-8")
    print(markdown(report), flush=True)
    return report


def decoders(args, out: pathlib.Path, model, tokenizer):
    """`(name, translate)` for each engine asked for; `translate(sources)` returns strings."""
    from keras_transformer.tools import evaluation

    def ours(search_model, beam_size):
        return lambda sources: evaluation.translate_texts(search_model, tokenizer, sources, beam_size=beam_size,
                                                          batch_size=args.eval_batch_size)

    if "keras" in args.engines:
        yield "greedy", ours(model, 1)
        yield "beam4", ours(model, 4)
    if "keras-int8" in args.engines:
        quantized, _ = evaluation.load_run(out, quantize="int8")
        yield "beam4 keras int8", ours(quantized, 4)
    for engine in ("ctranslate2", "ctranslate2-int8"):
        if engine in args.engines:
            quantization = "int8" if engine.endswith("int8") else None
            name = f"beam4 {engine.replace('-', ' ')} ({args.ctranslate2_threads} thread"
            name += "s)" if args.ctranslate2_threads > 1 else ")"
            yield name, ctranslate2_translator(out, model, tokenizer, quantization, args.eval_batch_size,
                                               args.ctranslate2_threads)


def ctranslate2_translator(out: pathlib.Path, model, tokenizer, quantization, batch_size: int, threads: int):
    """Translate with CTranslate2 and SentencePiece alone (the export's README lines), beam 4.

    CTranslate2 normalizes by `length ** length_penalty`; `length_penalty=1` is the setting
    closest to our GNMT penalty with alpha 0.6. The output limit is ours: source + 50 tokens.
    """
    import ctranslate2
    import sentencepiece

    from keras_transformer.defaults import MAX_EXTRA_LENGTH
    from keras_transformer.tools.ctranslate2_export import export_ctranslate2

    directory = out / f"ctranslate2-{quantization or 'float32'}"
    if not directory.is_dir():
        export_ctranslate2(model, tokenizer, directory, quantization=quantization)
    translator = ctranslate2.Translator(str(directory), device="cpu", intra_threads=threads)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(directory / "sentencepiece.model"))

    def translate(sources):
        pieces = [sp.encode(s.lower() if tokenizer.lower_case else s, out_type=str) for s in sources]
        order = sorted(range(len(pieces)), key=lambda i: len(pieces[i]))
        results = [""] * len(pieces)
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            longest = max(len(pieces[i]) for i in chunk)
            outputs = translator.translate_batch([pieces[i] for i in chunk], beam_size=4, length_penalty=1.0,
                                                 max_decoding_length=longest + MAX_EXTRA_LENGTH)
            for i, result in zip(chunk, outputs):
                results[i] = sp.decode(result.hypotheses[0])
        return results

    return translate


def markdown(r: dict) -> str:
    split = r["split"]
    lines = [
        f"**{r['corpus']}**, {r['direction']}; backend {r['backend']}, {r['cpu_count']} CPU cores.",
        "",
        f"Split (seed {split['seed']}, grouped by source sentence): {split['train']:,} train / "
        f"{split['validation']:,} validation / {split['test']:,} test pairs; {split['duplicates_dropped']} "
        f"repeated and {split['empty_skipped']} empty pairs dropped, {split['train_too_long']} too long.",
        f"Model `{r['config']['preset']}`, {r['vocabulary']:,} SentencePiece pieces, {r['steps']:,} steps of "
        f"~{r['tokens_per_step']:,.0f} tokens ({r['tokens_per_second']:,.0f} tokens/s): training "
        f"{r['train_seconds'] / 60:.1f} min, whole run {r['wall_seconds'] / 60:.1f} min.",
        "",
        "| decoding | BLEU | chrF | space before . , ! ? | seconds (first pass) |",
        "|---|---|---|---|---|",
    ]
    for name, s in r["test"].items():
        lines.append(f"| {name} | {s['bleu']:.2f} | {s['chrf']:.2f} | {s['space_before_punctuation']} "
                     f"of {s['sentences']} | {s['seconds']} ({s.get('first_pass_seconds', s['seconds'])}) |")
    signature = next(iter(r["test"].values()))
    lines += ["", f"sacreBLEU `{signature['bleu_signature']}`, `{signature['chrf_signature']}`", "",
              f"Validation BLEU (greedy, {min(r['config']['validate_translations'], split['validation']):,} "
              "sentences) by step: "
              + ", ".join(f"{c['step']}: {c['val_bleu']:.1f}" for c in r["validation_curve"]), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
