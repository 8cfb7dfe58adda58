"""The paper's settings and the default special token ids, written once.

Imports nothing (no Keras, no backend), so that the command line can show them in
`--help` without loading a backend. `keras_transformer.decoding` and
`keras_transformer.models` re-export what they use.
"""

# Special token ids: a model (`Transformer(pad_id=..., start_id=..., end_id=...)`) and
# its tokenizer carry their own, which must agree; these are what both use by default.
PAD_ID, UNK_ID, START_ID, END_ID = 0, 1, 2, 3

# Decoding (section 6.1): "beam search with a beam size of 4 and length penalty
# alpha = 0.6 ... maximum output length during inference to input length + 50".
BEAM_SIZE = 4
LENGTH_PENALTY = 0.6
MAX_EXTRA_LENGTH = 50
# The largest length penalty alpha where the longest output is not known in advance (the
# command line, an exported SavedModel): ((5 + n) / 6)^alpha stays finite in float32 for
# outputs of up to 42,000 tokens. Past float32, every long hypothesis would score 0 and
# the search would choose among them at random. `Transformer.translate` and
# `decoding.beam_search` check alpha against their own longest output instead.
MAX_LENGTH_PENALTY = 10.0
# The largest size, length or count the library and the command line take: the engines
# hold them in int32 tensors and C ints (a larger one failed inside TensorFlow's data
# pipeline, a SavedModel's constants or JAX's search, with their own errors).
MAX_INT = 2**31 - 1
# The longest input `translate` and `evaluate` decode (not in the paper; CTranslate2's
# default `max_input_length`): a longer one is cut to its first this many tokens, with a
# warning. Self-attention's memory grows with the square of the length: one line of 12,000
# tokens took 9 GB to translate with the tiny preset, and one of 24,000 would take ~36 GB.
MAX_INPUT_LENGTH = 1024
# Translations checked during training (not in the paper): greedy, for speed.
VALIDATION_BEAM_SIZE = 1
# Pairs held out from a corpus file for validation and again for test (not in the paper),
# when `--holdout` is not given: this many, or a tenth of a corpus of fewer than ten times
# as many distinct pairs (120 each of 1,200 pairs, which 500 each would leave 200 to train).
HOLDOUT = 500
# Sentences decoded together, by default (not in the paper): as many as keep
# rows x beam x longest output within this many tokens, at most 256 rows (on 2 CPU cores,
# 1,000 short sentences with beam 4 decode in half the time of batches of 64). A batch
# decodes until its last row ends: one row of a half-trained model that never emits
# [END] made greedy decoding of 1,000 numbers in one batch of 992 take 4.0 s, in
# batches of 256 1.6 s (0.5 and 0.4 s with a trained model).
DECODE_BATCH_TOKENS = 65536
DECODE_MAX_BATCH = 256

# What `--quantize` and `evaluation.quantize_model` accept: the Keras `model.quantize`
# modes measured with this model (docs/guides/export.md).
QUANTIZE_MODES = ("int8",)

# Model sizes.
PRESETS = {
    # Table 3 of the paper, "base": N=6, d_model=512, d_ff=2048, h=8, P_drop=0.1.
    "base": dict(num_layers=6, d_model=512, num_heads=8, d_ff=2048, dropout=0.1),
    # Table 3, "big": N=6, d_model=1024, d_ff=4096, h=16, P_drop=0.3 (EN-DE).
    "big": dict(num_layers=6, d_model=1024, num_heads=16, d_ff=4096, dropout=0.3),
    # Real corpora of 10k-500k pairs on a CPU or a small GPU (not in the paper): half
    # of base in depth and width.
    "small": dict(num_layers=3, d_model=256, num_heads=4, d_ff=1024, dropout=0.1),
    # Small enough to train in minutes on a laptop CPU: tests and demos.
    "tiny": dict(num_layers=2, d_model=128, num_heads=4, d_ff=512, dropout=0.1),
}
