"""The Harbor agent bridge: Harbor's own agent classes, run in a Python >= 3.12 process, over our sandboxes.

Harbor (`harbor` on PyPI) knows how to point each of its 49 agents at a model endpoint, run it and
turn its logs into an ATIF trajectory, but supports no Python older than 3.12, and this project runs
on 3.11. So a rollout with `--harness harbor:<name>` starts `runner.py` in the 3.12 virtualenv
`<tools>/harbor-venv`; the runner builds Harbor's agent for `<name>`, gives it a `BaseEnvironment`
(`environment.py`) whose `exec`, uploads and downloads travel back over a Unix socket
(`protocol.py`) to the rollout's own sandbox (`host.py`), and reports how the run ended and where the
trajectory is. The agent's CLI is installed once per machine from the package registries
(`install.py`, following `catalog.py`), the way a prebuilt image carries it, so Harbor runs it with
`skip_install`.

Nothing here imports torch; `environment.py` and `runner.py` import Harbor and run only under 3.12.
"""

RUNNER_MODULES = ("adapters.harbor_bridge.environment", "adapters.harbor_bridge.runner")
"""The modules that import Harbor, and so run only in Harbor's Python (>= 3.12), never in this one."""
