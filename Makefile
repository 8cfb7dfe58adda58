# keras-transformer: the commands the README shows.
#   make demo   create .venv, install what the demo needs (the text extra and the chosen
#               backend), and run the main job: train the tiny preset on the numbers
#               corpus, report BLEU and exact match with beam search, export a SavedModel
#               to artifacts/ and translate with it
#               (KERAS_BACKEND=jax|torch|tensorflow picks the backend; TensorFlow if unset)
#   make test   create .venv, install the project with its dev extra, run the tests on
#               TensorFlow, JAX and PyTorch (one pytest run per backend)
#   make docs   build the documentation site into site/ (mkdocs build --strict)
#   make bench  the side-by-side benchmarks (JSON in benchmarks/results/)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BACKENDS ?= tensorflow jax torch
# Two workers by default (CI has 2 cores); --dist loadfile keeps a file's module fixtures on one worker;
# the ten slowest tests are listed after each backend's run.
PYTEST_ARGS ?= -n auto --dist loadfile --durations=10
DEMO_BACKEND := $(or $(KERAS_BACKEND),tensorflow)
# constraints.txt pins torch to the CPU wheel (an unpinned torch pulls a multi-GB CUDA build).
PIP_INSTALL := $(PY) -m pip install --disable-pip-version-check -c constraints.txt

.PHONY: install demo docs test bench clean

$(VENV)/.installed-dev: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) -e '.[dev]'
	touch $@

$(VENV)/.installed-demo-$(DEMO_BACKEND): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) -e '.[text,$(DEMO_BACKEND)]'
	touch $@

install: $(VENV)/.installed-dev

demo: $(VENV)/.installed-demo-$(DEMO_BACKEND)
	KERAS_BACKEND=$(DEMO_BACKEND) $(VENV)/bin/keras-transformer demo --output-dir artifacts

docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

test: install docs
	@status=0; \
	for backend in $(BACKENDS); do \
		echo "=== pytest on KERAS_BACKEND=$$backend ==="; \
		start=$$(date +%s); \
		KERAS_BACKEND=$$backend $(PY) -m pytest $(PYTEST_ARGS) || status=1; \
		echo "=== $$backend: $$(( $$(date +%s) - start )) s ==="; \
	done; \
	exit $$status

bench: install
	$(PIP_INSTALL) -e '.[bench]'
	$(PY) benchmarks/decode.py
	$(PY) benchmarks/products.py
	$(PY) benchmarks/train_throughput.py
	$(PY) -m claims

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache site
