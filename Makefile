# keras-transformer: the commands the README shows.
#   make test   create .venv, install the project with its dev extra, run the tests on
#               TensorFlow, JAX and PyTorch (one pytest run per backend)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BACKENDS ?= tensorflow jax torch
PYTEST_ARGS ?=
# constraints.txt pins torch to the CPU wheel (an unpinned torch pulls a multi-GB CUDA build).
PIP_INSTALL := $(PY) -m pip install --disable-pip-version-check -c constraints.txt

.PHONY: install test clean

$(VENV)/.installed-dev: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) -e '.[dev]'
	touch $@

install: $(VENV)/.installed-dev

test: install
	@status=0; \
	for backend in $(BACKENDS); do \
		echo "=== pytest on KERAS_BACKEND=$$backend ==="; \
		start=$$(date +%s); \
		KERAS_BACKEND=$$backend $(PY) -m pytest $(PYTEST_ARGS) || status=1; \
		echo "=== $$backend: $$(( $$(date +%s) - start )) s ==="; \
	done; \
	exit $$status

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache site
