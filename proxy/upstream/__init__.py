"""The engine side: the client of vLLM's token-in routes (`client`), their wire Structs (`wire`), the checks every
sample passes (`checks`), the engine's streamed sampling (`stream`) and several engines behind one client (`pool`).
It imports only the proxy's base."""
