"""Names our processes agree on across HTTP and the environment, each defined once.

The embedded engine stamps every reply with the weight version behind it, which the proxy records and the
doctor and a run's first contact look for; every engine, vLLM's and ours, answers one model-list route;
`harness-rl serve proxy` and the clients of a running proxy read its control token from one variable.
Plain constants: the proxy, the adapters and the engine import this without importing anything else.
"""

POLICY_VERSION_HEADER = "x-policy-version"  # the weight version behind an engine's reply (ours sends it; vLLM not)
MODELS_ROUTE = "/v1/models"  # what every engine answers (vLLM's and ours) and nothing else does
ADMIN_TOKEN_ENV = "HARNESS_RL_ADMIN_TOKEN"  # a running proxy's control-API token
