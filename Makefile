# Two set-up commands: `make demo` and `make test`. Everything installs into .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install proto lint bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/hetpipe run examples/quickstart.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy hetpipe stage_worker ps_server coordinator baselines launch

proto: $(STAMP)
	$(BIN)/python -m hetpipe.protogen

bench: $(STAMP)
	$(BIN)/python bench/transport.py
	$(BIN)/python bench/pipeline.py

clean:
	rm -rf $(VENV) runs
