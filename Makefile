# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
CODE := dataloader_exporter core exporter diagnosis instrument dashboards
# A second venv without torch (the dashboards and dev extras alone), where the tests of
# the exporter, the doctor and the dashboards run: the test modules not marked torch.
NOTORCH ?= .venv-notorch
NOTORCH_STAMP := $(NOTORCH)/.installed

.PHONY: demo test lint typecheck unit notorch purepython quick prometheus bench clean docs

$(STAMP): pyproject.toml setup.py instrument/hotpath/_hotpath.c
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet --disable-pip-version-check "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[torch,dashboards,dev,frameworks]"
	# The frameworks must not have replaced it.
	$(PY) -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_VERSION)' and 'torch was replaced: ' + torch.__version__)"
	touch $(STAMP)

$(NOTORCH_STAMP): pyproject.toml setup.py instrument/hotpath/_hotpath.c
	$(PYTHON) -m venv $(NOTORCH)
	$(NOTORCH)/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dashboards,dev]"
	# Nothing installed there brought torch along.
	$(NOTORCH)/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') and 'torch is installed in $(NOTORCH)')"
	touch $(NOTORCH_STAMP)

# Debian's Prometheus server and promtool, for the tests that run them (root only).
prometheus:
	@if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends prometheus >/dev/null; \
	  else echo "prometheus/promtool missing: install Debian's prometheus package"; fi; \
	fi

demo: $(STAMP)
	$(VENV)/bin/dataloader-exporter demo $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check $(CODE) tests bench examples tools

typecheck: $(STAMP)
	$(PY) tools/typecheck.py

# Each test runs once: those marked torch here, the others without torch (notorch).
unit: $(STAMP) prometheus
	$(VENV)/bin/pytest -m torch

# The torch-free tests where torch cannot be imported: a module not marked torch (or a helper it
# uses) that imports torch fails its collection.
notorch: $(NOTORCH_STAMP) prometheus
	$(NOTORCH)/bin/pytest -m "not torch"

# The per-batch path's Python build (what runs where the C extension could not be built),
# through the same hot-path and loader tests as the C build.
PURE_TESTS := tests/test_hotpath_base.py tests/test_kept_plan.py tests/test_loader_counts.py \
	tests/test_loader_metrics.py tests/test_loader_transparent.py tests/test_loader_loop_cpu.py \
	tests/test_worker_liveness.py
purepython: $(STAMP)
	DATALOADER_EXPORTER_PURE_PYTHON=1 $(VENV)/bin/pytest $(PURE_TESTS)

test: lint typecheck notorch unit purepython

# The quick loop while editing, about a minute on 2 cores: every test but those marked slow
# (real Prometheus servers, torchrun, frameworks, packaging venvs, many processes), with
# torch. `make test` runs them all.
quick: $(STAMP)
	$(VENV)/bin/pytest -m "not slow"

bench: $(STAMP)
	$(PY) bench/overhead.py

clean:
	rm -rf $(VENV) $(NOTORCH) .mypy_cache .ruff_cache .pytest_cache

# Regenerate the committed Grafana dashboards, provisioning and Prometheus rules.
.PHONY: dashboards
dashboards: $(STAMP)
	$(PY) -m dataloader_exporter dashboards --out deploy

# The docs site (mkdocs.yml, docs/) into site/; --strict fails on a broken link or anchor.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

# Redraw docs/pictures/ from a real run (Prometheus, the demo, a fake-NVML exporter), about
# 2.5 minutes; tests/test_pictures.py fails when a panel changed and they were not redrawn.
.PHONY: pictures
pictures: $(STAMP) prometheus
	$(PY) tools/draw_dashboards.py
