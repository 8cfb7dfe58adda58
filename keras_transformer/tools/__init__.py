"""Tools around the library: what the command line needs to train, evaluate, export and
serve a translation model.

* `config`: the run's settings and their validation (no backend import);
* `training`, `callbacks`: the paper's training recipe, resumable;
* `evaluation`: translate text with a trained run and score it (sacreBLEU);
* `export`: the SavedModel that translates strings;
* `text`: tokenizer, corpora and the `tf.data` pipeline (TensorFlow Text);
* `cli`: `keras-transformer train | evaluate | translate | export | demo`.

The library (`keras_transformer.layers`, `models`, `decoding`, ...) never imports from here.
"""
