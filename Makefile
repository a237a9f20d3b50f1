# Two set-up commands: `make demo` and `make test`. Everything installs into .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-containers install proto lint bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --no-compile -c constraints.txt -e '.[dev]'
	@# Byte-compiled on every core, where pip compiles on one (half its install time here). As with
	@# pip, a file that does not compile is skipped (torch ships some for newer Pythons only).
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib > /dev/null || true
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/hetpipe run examples/quickstart.yaml

# Two pytest-xdist workers: most e2e tests wait on their processes, so two at once finish the
# suite in about three quarters of the time on 2 cores. TEST_WORKERS=0 runs it in one process.
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE): each of
# the suite's pytest processes would otherwise rewrite every test module's asserts (10 s of CPU)
# and each service process it starts compile the project's modules again.
TEST_WORKERS ?= 2
test: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -p no:cacheprovider --durations=25 -n $(TEST_WORKERS) --dist worksteal tests

# The compose cluster and the `hetpipe k8s` manifests brought up for real with podman, trained and
# torn down (tests/containers/bringup.py; minutes, so not part of `make test`). Prints "SKIPPED: ..."
# and exits 0 where podman cannot run containers. One phase: make test-containers BRINGUP="--phase compose"
test-containers: $(STAMP)
	$(BIN)/python tests/containers/bringup.py $(BRINGUP)

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
