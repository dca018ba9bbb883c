"""The intercept proxy: records every model call an agent makes as a validated turn.

Sub-packages, each importing only those listed before it (and the base):
  dialects/   each wire format agents speak and its stream: OpenAI Chat and Responses, Anthropic, Gemini
  upstream/   the engine side: the token-in client, its wire Structs, streamed sampling, several engines
  capture/    sessions, prompt ids (splice or render), the capture graph, the durable store and its recovery
  server/     the aiohttp app, agent and control routes, the capture pipeline, delivery, connection limits

The base, which every sub-package may import:
  errors       ProxyError and each dialect's error shape
  chat         the dialect-neutral call (`ChatCall`) and answer (`Answer`)
  live         a streamed answer, dialect-neutral
  tokens       token ids as comma-separated text, as the engine sent them
  sampling     the sampling policy (pinned temperature, truncating knobs neutralised or refused)
  config       ProxyConfig, every setting of one proxy (the `[proxy]` section of a run)
  control_api  the control API's request and reply Structs, shared by the server and `client`
  client       ProxyClient, the one typed client of the control API
"""
