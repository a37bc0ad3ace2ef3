# Quick start: `make demo` then `make test`. Both bootstrap .venv on first use (a few minutes).
PY := .venv/bin/python
HV := $(PY) -m hybrid_vla_ros
MODEL := out/models/tiny
BAG := data/dgp_scene02_6cam_mcap
LOOPS ?= 5
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
export ROS_AUTOMATIC_DISCOVERY_RANGE ?= LOCALHOST
export AMENT_PREFIX_PATH ?= $(CURDIR)/.venv

.PHONY: venv demo test bench clean
venv:
	@bash scripts/bootstrap_venv.sh

$(MODEL)/config.json: | venv
	$(HV) init-model --preset tiny $(MODEL)

demo: venv $(MODEL)/config.json
	$(HV) replay --model-path $(MODEL) --bag $(BAG) --loops $(LOOPS) --output out/demo --plots out/demo/plots

test: venv
	$(PY) -m pytest -q test

bench: venv $(MODEL)/config.json
	$(HV) bench --plots out/benchmark/plots
	$(HV) replay --model-path $(MODEL) --bag $(BAG) --loops 10 --output out/bench --quiet

clean:
	rm -rf out .pytest_cache
