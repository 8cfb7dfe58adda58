"""How often `detokenize(tokenize(text))` gives the text back, per language and tokenizer.

Learns a shared vocabulary on both sides of a parallel corpus (as `train` does) with each
tokenizer kind, then counts the sentences that come back equal to the original after
the normalisation a SentencePiece round trip applies (NFC, runs of spaces as one space,
no space at either end). Prints a table and writes JSON.

    python benchmarks/round_trip.py --tsv ../shared/data/tatoeba-deu-eng/pairs.tsv.gz
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tsv", required=True, help="Tab-separated pairs (plain or .gz).")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--languages", nargs=2, default=["en", "de"], help="Names of the two columns.")
    p.add_argument("--output", default="benchmarks/results/round_trip.json")
    args = p.parse_args(argv)

    from keras_transformer.tools.text import Tokenizer, corpora
    from keras_transformer.tools.text.tokenizer import normalise

    pairs, _ = corpora.read_tsv(args.tsv)
    sides = {args.languages[0]: [s for s, _ in pairs], args.languages[1]: [t for _, t in pairs]}
    report = {"corpus": args.tsv, "pairs": len(pairs), "vocab_size": args.vocab_size, "results": {}}
    for kind in ("sentencepiece", "wordpiece"):
        t = time.time()
        tokenizer = Tokenizer.build(sides[args.languages[0]] + sides[args.languages[1]], args.vocab_size, kind=kind)
        seconds = round(time.time() - t, 1)
        for language, texts in sides.items():
            back = []
            for start in range(0, len(texts), 10_000):
                chunk = texts[start : start + 10_000]
                back += tokenizer.detokenize_dense(tokenizer.tokenize(chunk))
            misses = [(a, b) for a, b in zip(texts, back) if normalise(a) != b]
            report["results"][f"{kind} {language}"] = {
                "sentences": len(texts), "round_trip": round(1 - len(misses) / len(texts), 5),
                "vocabulary": tokenizer.vocab_size, "build_seconds": seconds,
                "examples_of_misses": misses[:3],
            }
            print(f"{kind:14s} {language}: {1 - len(misses) / len(texts):.2%} of {len(texts):,} sentences come back "
                  f"unchanged ({tokenizer.vocab_size} pieces, built in {seconds} s)", flush=True)
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return report


if __name__ == "__main__":
    main()
