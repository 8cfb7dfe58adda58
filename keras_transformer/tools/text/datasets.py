"""tf.data input pipeline: sentence pairs -> batches of token ids for `model.fit`.

Each example becomes `({"source_ids": x, "target_ids": [START] y}, y [END])` (teacher
forcing: the decoder reads the target shifted right and predicts the next token).
Batches are made by a token budget with length bucketing, as in the paper (section 5.1:
"Sentence pairs were batched together by approximate sequence length. Each training
batch contained a set of sentence pairs containing approximately 25000 source tokens
and 25000 target tokens"). Keras feeds a `tf.data.Dataset` to `model.fit` on every
backend, so the same pipeline serves TensorFlow, JAX and PyTorch.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from keras_transformer.tools.text.tokenizer import Tokenizer


def bucket_lengths(max_length: int) -> list[int]:
    """Padded lengths of the buckets: multiples of 8 up to 32, then of 16, up to `max_length`.

    A few fixed shapes keep XLA (JAX, TensorFlow) from compiling one program per length.
    """
    lengths, n = [], 8
    while n < max_length:
        lengths.append(n)
        n += 8 if n < 32 else 16
    lengths.append(max_length)
    return lengths


def make_dataset(
    pairs: Sequence[tuple[str, str]],
    tokenizer: Tokenizer,
    batch_tokens: int = 4096,
    max_length: int = 64,
    shuffle: bool = True,
    repeat: bool = False,
    drop_remainder: bool = False,
    seed: int = 0,
    num_shards: int = 1,
    shard_index: int = 0,
    devices_per_shard: int = 1,
) -> tf.data.Dataset:
    """Batches of `({"source_ids": (B, S), "target_ids": (B, T)}, labels (B, T))`, int32.

    Pairs are grouped by their longer side into buckets of `bucket_lengths(max_length)`;
    in a batch, each side is padded to the shortest bucket length that holds its longest
    sequence, so `S` and `T` are bucket lengths and may differ.

    Args:
        pairs: `(source, target)` sentence pairs.
        tokenizer: A `Tokenizer` shared by both sides.
        batch_tokens: Token budget per batch and side: a bucket of length L makes
            batches of `batch_tokens // L` pairs (at most as many as `pairs` holds), and
            neither side is padded beyond L. Defaults to `4096`.
        max_length: Pairs whose source, or target plus one special token, is longer
            are dropped. Defaults to `64`.
        shuffle: Shuffle the pairs (again at every pass). Defaults to `True`.
        repeat: Repeat forever (train by steps). Defaults to `False`.
        drop_remainder: Drop each bucket's last incomplete batch, so every batch of a
            bucket has the same number of pairs. Defaults to `False`.
        seed: Shuffle seed. Defaults to `0`.
        num_shards: Processes that share each batch (data-parallel training). Every
            process makes the same batches (the same seed) and keeps its slice of the
            rows: `batch_tokens` is the budget of the global batch, each bucket's batch
            size is rounded down to a multiple of `num_shards * devices_per_shard`
            (at least that), and a last incomplete batch is filled with rows of padding
            (masked out of the loss and the metrics) so that every process's slice has
            the same shape. Defaults to `1`.
        shard_index: This process's slice, `0 <= shard_index < num_shards`: rows
            `[shard_index * b, (shard_index + 1) * b)` of a batch of `num_shards * b`
            rows, the order in which `keras.distribution` assembles a global batch.
            Defaults to `0`.
        devices_per_shard: The devices each process splits its slice over (its rows
            are a multiple of it). Defaults to `1`.
    """
    lengths = bucket_lengths(max_length)
    _check_dataset_settings(pairs, batch_tokens, lengths, num_shards, shard_index)
    multiple = num_shards * devices_per_shard  # the rows of every batch
    ds = _examples(pairs, tokenizer, max_length, shuffle, seed)
    if repeat:  # after the filter: no pair that fits means no batch, not an endless search
        ds = ds.repeat()
    ds = _bucketed(ds, lengths, _batch_sizes(batch_tokens, lengths, len(pairs), multiple), tokenizer.pad_id,
                   drop_remainder)
    if multiple > 1:
        ds = ds.map(_plain(lambda x, y: _shard(x, y, num_shards, shard_index, devices_per_shard, tokenizer.pad_id)))
    if not repeat:  # bucketing hides the number of batches: counted once, for Keras' progress bar
        ds = ds.apply(tf.data.experimental.assert_cardinality(int(ds.reduce(0, _plain(lambda count, _: count + 1)))))
    return _without_autotune_thread(ds.prefetch(tf.data.AUTOTUNE))


def _without_autotune_thread(ds: tf.data.Dataset) -> tf.data.Dataset:
    """tf.data's autotuner (`Options.autotune`) runs a thread per iterator whose deletion
    waits out the thread's current optimization period, which grows to a minute: an
    iterator `model.fit` leaves behind, collected later by Python's garbage collector,
    froze its process for up to 52 s (TensorFlow 2.21; a training iterator 12 s old: deleted in
    8-9.5 s with the autotuner, 0.01 s without). Without it, `AUTOTUNE` still means one
    parallel call per core for the maps, and the prefetch buffer still grows while the
    model waits for batches (the prefetch's own tuner): on 2 CPU cores the pipeline made
    37-45 batches/s without the autotuner against 32-37 with it."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return ds.with_options(options)


def _batch_sizes(batch_tokens: int, lengths: list[int], pairs: int, multiple: int) -> list[int]:
    """Each bucket's pairs per batch: `batch_tokens // length`, a multiple of `multiple`, and
    at most the pairs there are (a budget larger than the data, a typo's extra zeros, would
    fill one batch with the same pairs, pass after pass, without end)."""
    return [max(multiple, min(batch_tokens // n, pairs) // multiple * multiple) for n in lengths]


def _plain(fn):
    """`fn` traced as written: tf.data converts the functions it is given with AutoGraph,
    which these do not need (no Python control flow on tensors), and the conversion took
    most of a second at the start of every process that makes a dataset."""
    return tf.autograph.experimental.do_not_convert(fn)


def _check_dataset_settings(pairs, batch_tokens: int, lengths, num_shards: int, shard_index: int) -> None:
    if not pairs:
        raise ValueError("Cannot make a dataset from an empty list of pairs. Received: 0 pairs")
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"`shard_index` must be in [0, num_shards). Received: shard_index={shard_index}, "
                         f"num_shards={num_shards}")
    if batch_tokens < lengths[-1]:
        raise ValueError(
            f"`batch_tokens` must be at least `max_length` so that a longest pair fits "
            f"in a batch. Received: batch_tokens={batch_tokens}, max_length={lengths[-1]}"
        )


def _examples(pairs, tokenizer, max_length: int, shuffle: bool, seed: int) -> tf.data.Dataset:
    """`(source, decoder input, labels)` id vectors of the pairs that fit in `max_length`:
    the decoder input starts with `[START]`, the labels end with `[END]`."""
    sources = tf.constant([s for s, _ in pairs], tf.string)
    targets = tf.constant([t for _, t in pairs], tf.string)
    ds = tf.data.Dataset.from_tensor_slices((sources, targets))
    if shuffle:
        ds = ds.shuffle(len(pairs), seed=seed, reshuffle_each_iteration=True)
    start_id, end_id = tokenizer.start_id, tokenizer.end_id

    def tokenize(src, tgt):
        return tokenizer.tokenize(src), tokenizer.tokenize(tgt)

    def to_example(src, tgt):
        src = tf.cast(src, tf.int32)
        tgt = tf.cast(tgt, tf.int32)
        return src, tf.concat([[start_id], tgt], axis=0), tf.concat([tgt, [end_id]], axis=0)

    def short_enough(src, decoder_input, labels):
        return tf.logical_and(tf.size(src) <= max_length, tf.size(labels) <= max_length)

    return (
        ds.batch(512)
        .map(_plain(tokenize), num_parallel_calls=tf.data.AUTOTUNE)
        .unbatch()
        .map(_plain(to_example), num_parallel_calls=tf.data.AUTOTUNE)
        .filter(_plain(short_enough))
    )


def _bucketed(ds, lengths: list[int], batch_sizes: list[int], pad_id: int, drop_remainder: bool) -> tf.data.Dataset:
    """Examples batched by length bucket (`batch_sizes[i]` pairs in bucket `lengths[i]`),
    as `({"source_ids", "target_ids"}, labels)` with each side padded to a bucket length."""
    ds = ds.bucket_by_sequence_length(
        element_length_func=_plain(lambda s, d, l: tf.maximum(tf.size(s), tf.size(l))),
        # A pair of length n goes to the first bucket whose padded length is >= n.
        bucket_boundaries=[n + 1 for n in lengths[:-1]],
        bucket_batch_sizes=batch_sizes,
        padded_shapes=([None], [None], [None]),
        padding_values=(pad_id, pad_id, pad_id),
        pad_to_bucket_boundary=False,
        drop_remainder=drop_remainder,
    )

    def pad_to_bucket(src, decoder_input, labels):
        # Each side to the shortest bucket length that holds its longest sequence: a
        # source and a target of different lengths (numbers: about 11 and 4 tokens) are
        # not both padded to the longer one, which would make the decoder, the larger
        # half of the model, run mostly on padding. A few shapes per batch size.
        def pad(x, length):
            bucket = tf.gather(tf.constant(lengths), tf.reduce_min(tf.where(tf.constant(lengths) >= length)))
            return tf.pad(x, [[0, 0], [0, bucket - tf.shape(x)[1]]], constant_values=pad_id)

        target_length = tf.shape(labels)[1]
        return ({"source_ids": pad(src, tf.shape(src)[1]), "target_ids": pad(decoder_input, target_length)},
                pad(labels, target_length))

    return ds.map(_plain(pad_to_bucket), num_parallel_calls=tf.data.AUTOTUNE)


def _shard(inputs, labels, num_shards: int, shard_index: int, devices_per_shard: int, pad_id: int):
    """Rows `[shard_index * b, (shard_index + 1) * b)` of a batch padded to `num_shards * b` rows,
    `b` a multiple of `devices_per_shard`."""
    rows = tf.shape(labels)[0]
    per_shard = (rows + num_shards * devices_per_shard - 1) // (num_shards * devices_per_shard) * devices_per_shard

    def rows_of(x):
        x = tf.pad(x, [[0, per_shard * num_shards - rows], [0, 0]], constant_values=pad_id)
        return x[shard_index * per_shard:(shard_index + 1) * per_shard]

    return {k: rows_of(v) for k, v in inputs.items()}, rows_of(labels)
