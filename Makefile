# Quick start: `make demo` then `make test`. Both bootstrap .venv on first use (a few minutes).
# bash with pipefail: a failing command piped into `tail` fails the recipe
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PY := .venv/bin/python
HV := $(PY) -m hybrid_vla_ros
MODEL := out/models/tiny
DEMO_MODEL := out/models/smol
BAG := data/dgp_scene02_6cam_mcap
# The demo plays the bag (about 1 frame/s as recorded) 3x faster, 10 times: frames then arrive faster than one
# frame's prefix + suffix time on a 2-core machine, so the prefix of frame t+1 runs while the suffix finishes t.
LOOPS ?= 10
RATE ?= 3
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
export ROS_AUTOMATIC_DISCOVERY_RANGE ?= LOCALHOST
export AMENT_PREFIX_PATH ?= $(CURDIR)/.venv

.PHONY: venv demo test bench clean
venv:
	@bash scripts/bootstrap_venv.sh

$(MODEL)/config.json: | venv
	$(HV) init-model --preset tiny $(MODEL)

$(DEMO_MODEL)/config.json: | venv
	$(HV) init-model --preset smol $(DEMO_MODEL)

# The demo: the split's memory / latency trade-off (measured on this machine's last core, and Orion's memory at
# full size on a 12 GB GPU share), then the main job at the planned K: both nodes on the embedded bag with the
# pretrained SmolLM2-135M blocks.
demo: venv $(DEMO_MODEL)/config.json
	@mkdir -p out/demo/plots
	$(HV) profile --model $(DEMO_MODEL) --cores $(lastword $(shell $(PY) -c "import os; print(*sorted(os.sched_getaffinity(0)))")) --threads 1 --quiet --out out/demo/profile.json
	$(HV) plan --model $(DEMO_MODEL) --dtype fp32 --profile out/demo/profile.json --plot out/demo/plots/plan_smol.png --json out/demo/plan_smol.json | tail -n 3
	$(HV) plan --preset orion --dtype fp16 --gpu-budget-gb 12 --plot out/demo/plots/plan_orion.png | tail -n 2
	$(HV) replay --model-path $(DEMO_MODEL) --bag $(BAG) --loops $(LOOPS) --rate $(RATE) --output out/demo --plots out/demo/plots --split-layer $$($(PY) -c "import json; print(json.load(open('out/demo/plan_smol.json'))['chosen_k'])")

test: venv
	$(PY) -m pytest -q --durations=15 test

bench: venv $(MODEL)/config.json
	$(HV) bench --plots out/benchmark/plots
	$(HV) replay --model-path $(MODEL) --bag $(BAG) --loops 10 --output out/bench --quiet

clean:
	rm -rf out .pytest_cache
