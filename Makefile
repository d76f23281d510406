# `make run`: set up and run the demo (asap vs dep over HTTP on the embedded model). `make test`: set up and pass the tests.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first and alone, exactly pinned: it resolves to the local CPU build on these machines
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# the demo: moeflow serve in asap mode, then the dep baseline, each driven over HTTP by
# bench serve --base-url; prints both result tables side by side, writes demo-out/ttft_vs_rate.png
run: $(STAMP)
	$(VENV)/bin/moeflow demo --out-dir demo-out

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(VENV)/bin/moeflow bench prefill --json docs/results/prefill.json

clean:
	rm -rf $(VENV) build *.egg-info
