"""The intercept proxy: records every model call an agent makes as a validated turn.

Modules, one job each:
  server          the proxy process: its state, the aiohttp app, errors, `start_proxy`
  config          ProxyConfig, every setting of one proxy (the `[proxy]` section of a run)
  control_routes  the control API (sessions, traces, weight-sync pause, policy version, health)
  control_api     the control API's request and reply Structs, shared with `client`
  client          ProxyClient, the one typed client of the control API
  agent_routes    the routes agents call; keys, keep-alives, answers in each dialect
  chat            the dialect-neutral call (`ChatCall`) and answer (`Answer`)
  openai_chat     OpenAI Chat Completions in (typed) and out (JSON and SSE)
  anthropic       Anthropic Messages translated to a ChatCall and back (JSON and its SSE events)
  openai_responses  OpenAI Responses translated to a ChatCall and back (JSON and its typed events)
  gemini          Google Gemini generateContent translated to a ChatCall and back (JSON and SSE chunks)
  opaque_reasoning  reasoning handed to agents as an opaque string and read back from their echoes
  pipeline        one call from admission to a durably recorded turn (and the weight-sync gate)
  sampling        the sampling policy (pinned temperature, truncating knobs neutralised or refused)
  upstream        the engine client: capture fields, retries, timeouts, reply checks
  engines         several engines as one client: a session stays on its engine, dead or stale engines out
  engine_wire     the engine's reply as msgspec Structs
  session         capture sessions, their registry and trace building
  capture         the capture graph: parents by longest exact token prefix, roles
  store           the durable append-only session logs (turn lines are harness_rl.trace.StoredTurn)
  recovery        reading a store back: damaged lines quarantined, lost turns counted, nothing truncated
  limits          connection limits per client and in all, header and body read timeouts
  errors          ProxyError and each dialect's error shape
"""
