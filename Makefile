# Two entry points (see README): `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: demo test install clean

$(BIN)/kvgen: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(BIN)/kvgen

install: $(BIN)/kvgen

# build the shipped specs, then write a paged cache and attend over it with one generated format
demo: install
	$(BIN)/kvgen build specs/
	$(BIN)/kvgen demo

# the whole test suite (CPU, Triton interpreter), including `kvgen build specs/ --check`; one worker per core, an idle
# worker takes tests queued on the other (worksteal: no long tail on one core)
test: install
	$(BIN)/python -m pytest tests -q -p no:cacheprovider -n auto --dist worksteal

clean:
	rm -rf $(VENV) build *.egg-info .hypothesis
