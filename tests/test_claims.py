"""Table 1 and the design notes: the measurements, kept small enough for CI.

The full measurement (`python -m claims`, from a checkout: research code beside the
library, not installed with it) runs on demand; these tests check that what it measures
is right at small sizes.
"""

import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from claims import measure, notes, table1
from tests.conftest import BACKEND, only_on

JAX_ONLY = pytest.mark.skipif(
    BACKEND != "jax", reason="read from XLA's compiled program / jaxpr, which only the JAX backend exposes")
# The measurements are research code about the paper's claims, not the library: each runs
# in one suite. The layers they build are checked on every backend by the library's tests.
ONCE = only_on("torch", "a measurement of the paper's claims, run once (eager PyTorch is quickest for it)")


@ONCE
@pytest.mark.parametrize("n", [6, 17])
def test_self_attention_connects_every_pair_in_one_layer(n):
    assert table1.path_length("self-attention", n)["path"] == 1


@ONCE
@pytest.mark.parametrize("n,window", [(9, 4), (13, 3)])
def test_restricted_attention_path_length_is_n_over_r(n, window):
    # Each layer extends the reach by r positions: ceil((n - 1) / r) layers from 1 to n.
    assert table1.path_length("restricted self-attention", n, window=window)["path"] == math.ceil((n - 1) / window)
@ONCE
def test_recurrent_path_is_one_cell_step_per_position():
    result = table1.path_length("recurrent", 10)
    assert result["layers"] == 1 and result["path"] == 10 and result["first_position_gradient"] > 0


@ONCE
@pytest.mark.parametrize("n", [9, 10])
def test_convolution_path_lengths(n):
    # Causal, kernel 3: a contiguous layer reaches back 2 positions, so ceil((n - 1) / 2)
    # layers; dilations 1, 3, 9, ... reach back 3^L - 1, so ceil(log_3(n)) layers.
    assert table1.path_length("convolution", n, kernel_size=3)["path"] == math.ceil((n - 1) / 2)
    assert table1.path_length("dilated convolution", n, kernel_size=3)["path"] == math.ceil(math.log(n, 3) - 1e-9)
@ONCE
def test_unknown_layer_kind_is_refused():
    with pytest.raises(ValueError, match="Unknown layer kind"):
        table1.make_layer("transformer-xl", 8)


@JAX_ONLY
def test_sequential_operations_constant_for_attention_linear_for_recurrence():
    for kind in ("self-attention", "restricted self-attention", "convolution"):
        assert table1.sequential_operations(kind, 8) == table1.sequential_operations(kind, 16)
    short, long = table1.sequential_operations("recurrent", 8), table1.sequential_operations("recurrent", 16)
    assert 1.8 < long / short < 2.2


@JAX_ONLY
def test_attention_memory_grows_as_n_squared_restricted_as_n():
    config = table1.Table1Config(repeats=1, window=8)
    full = [table1.layer_cost("self-attention", n, 32, config)["temp_bytes"] for n in (128, 256)]
    restricted = [table1.layer_cost("restricted self-attention", n, 32, config)["temp_bytes"] for n in (128, 256)]
    assert 3.5 < full[1] / full[0] < 4.5
    assert 1.8 < restricted[1] / restricted[0] < 2.2
@ONCE
def test_input_gradient_matches_the_analytic_gradient():
    x = np.array([[0.5, -1.0, 2.0]], "float32")
    grad = measure.input_gradient(lambda v: v * v * v, x)
    np.testing.assert_allclose(grad, 3 * x**2, rtol=1e-6)


@only_on("jax", "a measurement run, once: on JAX it also draws the plot read from XLA's compiled program")
def test_full_run_writes_tables_json_and_plots(tmp_path):
    config = table1.Table1Config(lengths=(16, 32), widths=(8, 16), width=8, length=16, heads=2, window=4,
                                 path_lengths=(9,), depth_length=8, fit_points=2, repeats=1)
    results = table1.run(config, progress=lambda s: None)
    markdown = table1.to_markdown(results)
    measure.write_outputs(tmp_path, "table1", results, markdown)
    pngs = table1.plots(results, tmp_path)
    saved = json.loads((tmp_path / "table1.json").read_text())
    assert saved["layers"]["restricted self-attention"]["path_length"]["9"]["path"] == 2
    assert saved["layers"]["recurrent"]["path_length"]["9"]["path"] == 9
    assert "| self-attention | O(n^2 * d) |" in markdown  # the paper's column, labelled
    assert len(pngs) == 3 and all(p.stat().st_size > 1000 for p in pngs)
@ONCE
def test_dot_product_variance_grows_with_d_k_and_scaling_keeps_it_at_one():
    rows = notes.dot_product_scaling((16, 256), samples=4096, keys=64)
    for r in rows:
        assert r["variance"] == pytest.approx(r["d_k"], rel=0.1)
        assert r["scaled_variance"] == pytest.approx(1.0, rel=0.1)
    big = rows[-1]
    # Unscaled logits at d_k = 256 push the softmax towards one-hot and starve the gradient.
    assert big["unscaled_max_weight"] > 0.6 > big["scaled_max_weight"]
    assert big["unscaled_gradient"] < big["scaled_gradient"] / 3
@ONCE
def test_copy_batch_pads_source_and_decoder_input_consistently():
    x, y = notes.copy_batch(np.random.default_rng(0), 50, 7, 1, 7)
    lengths = (y != 0).sum(1)
    assert lengths.min() >= 1 and lengths.max() <= 7
    assert ((x["target_ids"] != 0).sum(1) == lengths).all()  # [START] + n - 1 symbols
    assert (x["target_ids"][:, 0] == notes.START).all()
    shifted = x["target_ids"][:, 1:] != 0
    np.testing.assert_array_equal(x["target_ids"][:, 1:][shifted], y[:, :-1][shifted])
@ONCE
def test_copy_model_refuses_unknown_positions():
    with pytest.raises(ValueError, match="sinusoidal' or 'learned"):
        notes.CopyModel(16, 8, "rotary", max_positions=8)


@only_on("tensorflow", "`--help` of the measurement scripts and where they write, which no backend's code decides "
                       "(each script imports Keras, and so its backend, before it reads its arguments)")
def test_the_measurements_run_from_a_checkout_and_write_beside_the_benchmarks():
    root = pathlib.Path(__file__).parent.parent
    for module in ("claims.table1", "claims.notes"):
        result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=root,
                                timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.startswith(f"usage: python -m {module}") and "--quick" in result.stdout
    assert measure.RESULTS == root / "benchmarks" / "results" / "claims"
