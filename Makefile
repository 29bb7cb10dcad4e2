# The two set-up commands of README.md:
#   make demo   the main job on the embedded default (tiny Qwen3 + sample chats, 2 CPU workers without a GPU)
#   make test   the test suite's default tier (make test-slow: the multi-process training runs; CI runs both)
# Both create .venv and install what they need first.

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hypersloth-installed

.PHONY: install install-gpu demo test test-slow test-all clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# Without a GPU take the CPU build of torch (on this kind of machine pip finds it on local disk);
	@# with one, pip's default (CUDA) build. `make install-gpu` adds unsloth and bitsandbytes.
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
	  $(PY) -m pip install -q "torch>=2.4,<2.15"; else $(PY) -m pip install -q "torch==2.13.0"; fi
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $@
	@echo "installed: the hypersloth-* commands are in $(VENV)/bin; in your shell run: source $(VENV)/bin/activate"

install-gpu: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e ".[gpu]"

demo: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash scripts/demo.sh

# One pytest worker per core (pytest-xdist); --dist loadscope keeps each module on one worker, so a module's
# shared runs (tests/integration/training_fixtures.py) start once. TEST_WORKERS=0 runs in this process.
# make test: every test but the `slow` tier (the multi-process training runs, marked in their modules);
# make test-slow: that tier; CI (.ci/run) runs both; make test-all: everything in one pytest run.
TEST_WORKERS ?= auto
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope
test: $(STAMP)
	$(PYTEST) -m "not slow"

test-slow: $(STAMP)
	$(PYTEST) -m slow

test-all: $(STAMP)
	$(PYTEST)

clean:
	rm -rf $(VENV) build outputs data/built_dataset data/data_config.json data/data_config.json.lock
