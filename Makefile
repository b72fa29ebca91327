# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
CODE := dataloader_exporter core exporter diagnosis instrument dashboards

.PHONY: demo test lint typecheck unit prometheus bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet --disable-pip-version-check "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[torch,dashboards,dev,frameworks]"
	# The frameworks must not have replaced it.
	$(PY) -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_VERSION)' and 'torch was replaced: ' + torch.__version__)"
	touch $(STAMP)

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
	$(VENV)/bin/ruff check $(CODE) tests bench examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy dataloader_exporter

unit: $(STAMP) prometheus
	$(VENV)/bin/pytest

test: lint typecheck unit

bench: $(STAMP)
	$(PY) bench/overhead.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

# Regenerate the committed Grafana dashboards, provisioning and Prometheus rules.
.PHONY: dashboards
dashboards: $(STAMP)
	$(PY) -m dataloader_exporter dashboards --out deploy
