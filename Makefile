# `make run` and `make test` work on a fresh machine: they build .venv from nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
CHECKPOINT := checkpoints/tiny

STOCK := .venv-stock
STOCK_PIP := $(STOCK)/bin/python -m pip --disable-pip-version-check -q

# --no-compile on every install: byte-compiling every installed module (torch's alone take half
# a minute) is left to the first import, which compiles only what is used.
# The two environments build side by side (each pip is one process; CI has two cores).
MAKEFLAGS += --jobs=2

.PHONY: run test install clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --no-compile 'setuptools<82' wheel
	# The CPU build of torch 2.13 (a bare `torch` would pull several GB of CUDA wheels).
	$(PIP) install --no-compile torch==2.13.0
	$(PIP) install --no-compile -e '.[test]'
	# Upstream, for the parity tests only: no dependencies, see tests/parity/standins.
	$(PIP) install --no-compile --no-deps fish-speech==0.1.0 descript-audio-codec==1.0.0
	touch $@

install: $(VENV)/.installed

$(CHECKPOINT)/config.json: | $(VENV)/.installed
	$(VENV)/bin/fish-sm make-checkpoint $(CHECKPOINT) --preset tiny --seed 0

run: $(VENV)/.installed $(CHECKPOINT)/config.json
	$(VENV)/bin/fish-sm synthesize $(CHECKPOINT) "Hello from fish-sm. This sentence was synthesized on a tiny random checkpoint." -o out/hello.wav --seed 0

# The stock SageMaker PyTorch container's serving stack, for tests/serving/test_stock_container.py.
# It ships its own copy of sagemaker_inference, so it cannot share .venv.
$(STOCK)/.installed: code/requirements.txt
	test -x $(STOCK)/bin/python || $(PYTHON) -m venv $(STOCK)
	$(STOCK_PIP) install --no-compile 'setuptools<81' wheel pyyaml
	$(STOCK_PIP) install --no-compile torch==2.13.0
	$(STOCK_PIP) install --no-compile torchserve==0.12.0 sagemaker-pytorch-inference==2.0.25 'setuptools<81' -r code/requirements.txt
	touch $@

test: $(VENV)/.installed $(STOCK)/.installed
	$(PY) -m pytest -q -n 2 --dist loadfile

clean:
	rm -rf $(VENV) $(STOCK) checkpoints out
