# Two commands matter: `make quickstart` (the main job) and `make test`. Both create the CPU
# virtual environment in .venv on first use; nothing else needs to be installed beforehand.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: quickstart test lint install clean mlflow-ui

$(STAMP): requirements/cpu.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned, so no dependency can pull a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -r requirements/cpu.txt
	# torchrec's metadata pulls the CUDA fbgemm-gpu; its real CPU deps are in requirements/cpu.txt.
	$(BIN)/pip install --quiet --no-deps torchrec==1.8.0
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

# One thread per process: a little slower on an idle 2-core machine, several times faster when anything else
# runs beside it (docs/benchmarks.md, "README commands").
quickstart: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/gem quickstart
	@echo "Runs are in ./mlflow.db. Browse them with: $(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow.db"

test: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

mlflow-ui: $(STAMP)
	$(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow.db

clean:
	rm -rf runs data/synth-* mlflow.db mlruns
