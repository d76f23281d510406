# `make run`: set up and run the demo (pd: asap prefill -> afd decode, vs dep, over HTTP on the embedded model). `make test`: set up and pass the tests.
# `make verify`: model-check the one-sided protocol (verify/protocol.pml) with spin; `make test` runs it too.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-slow verify spin lint bench soak seed-tables clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first and alone, exactly pinned: it resolves to the local CPU build on these machines
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# the demo: moeflow serve as pd (asap prefill -> afd decode), then the dep baseline, each driven over HTTP by
# bench serve --base-url; prints both result tables side by side, writes demo-out/ttft_vs_rate.png
run: $(STAMP)
	$(VENV)/bin/moeflow demo --out-dir demo-out

# spin, the model checker, is a system package (Debian/Ubuntu: spin): installed here when missing
SUDO := $(if $(filter 0,$(shell id -u)),,sudo -n)
spin:
	@command -v spin >/dev/null 2>&1 || { echo "installing spin (the model checker of verify/protocol.pml)"; \
	  $(SUDO) apt-get install -y -q spin || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q spin; }; } \
	  || { echo "error: could not install spin; install it by hand: sudo apt-get install -y spin" >&2; exit 1; }

verify: spin
	python3 verify/check.py

# make test: a representative case of every code path, within ~15 minutes on 2 cores; the full
# matrices (every mode x model x option, every signal x command) carry the `slow` marker and run
# with make test-slow, before an issue that adds to them is resolved
# the GPU tests run twice: skipped in the first run without CUDA, then on the CPU as their rehearsal
# (tests/gpu/cuda_support.py: cuda-ipc replaced by deferred, decode attention on the GPU's gather path)
REHEARSE := MOEFLOW_GPU_REHEARSAL=1 $(PY) -m pytest -q -p no:cacheprovider tests/gpu
test: $(STAMP) spin
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -m "not slow" tests
	$(REHEARSE) -m "gpu and not slow"

test-slow: $(STAMP) spin
	$(PY) -m pytest -q -m slow tests
	$(REHEARSE) -m "gpu and slow"

bench: $(STAMP)
	$(VENV)/bin/moeflow bench prefill --json docs/results/prefill.json

# ten minutes of HTTP load on a real server with disconnects, bad requests and a worker kill
# (not part of make test): docs/results/soak.{json,png,md}
soak: $(STAMP)
	$(VENV)/bin/moeflow bench soak --duration-s 600 --out docs/results/soak

# every seed result, paper against the simulator (~3 minutes here): the three configs' simulations, then
# the tables in docs/results/sim/seed_tables.md, and the production anchor (docs/results/sim/anchors.md)
SIMULATE := $(VENV)/bin/moeflow simulate
seed-tables: $(STAMP)
	$(SIMULATE) --config configs/asap-cm384.yaml --find-slo-rps --slo-metric all --json docs/results/sim/asap_cm384.json \
	    --plot docs/results/sim/asap_cm384.png --trace docs/results/sim/asap_cm384_trace.json --trace-rps 4 \
	    --trace-window-s 1 > docs/results/sim/asap_cm384.txt
	$(SIMULATE) --config configs/dwdp-gb200.yaml --json docs/results/sim/dwdp_gb200.json > docs/results/sim/dwdp_gb200.txt
	$(SIMULATE) --config configs/afd-gb200.yaml --json docs/results/sim/afd_gb200.json > docs/results/sim/afd_gb200.txt
	$(SIMULATE) --config configs/afd-minimax-gb200.yaml --json docs/results/sim/afd_minimax_gb200.json \
	    > docs/results/sim/afd_minimax_gb200.txt
	$(SIMULATE) --config configs/dwdp-e2e-gb200.yaml --json docs/results/dwdp/e2e_gb200.json \
	    --plot docs/results/dwdp/e2e_gb200.png > docs/results/dwdp/e2e_gb200.txt
	$(PY) docs/results/sim/seed_tables.py docs/results/sim/seed_tables.md
	$(PY) docs/results/plan/accuracy.py  # what moeflow plan prints beside its pick
	$(PY) docs/results/sim/anchors.py docs/results/sim/anchors.md

clean:
	rm -rf $(VENV) build *.egg-info
