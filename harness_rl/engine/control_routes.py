"""Weight and engine control routes, named and shaped like vLLM's dev-mode routes.

`POST /pause?mode=wait|keep|abort[&clear_cache=true]` (default `wait`): new requests queue until
`POST /resume`.
`wait` returns once running generations have finished; `keep` freezes them between two steps
(they resume, possibly under new weights: each token records the version that sampled it, which
`/inference/v1/generate` reports as `weight_versions` spans, while the `x-policy-version` header
keeps the version the generation started under); `abort` ends them at once with
`finish_reason: "abort"`. Weight updates apply between decode steps:
`POST /update_weights_from_disk {"path", "version"}` reads a safetensors file or a directory of
them, `POST /update_weights_from_bytes?version=N` takes a raw safetensors body.
"""

import asyncio
from pathlib import Path
from typing import cast

from aiohttp import web

from harness_rl.engine.engine import PAUSE_MODES, PauseMode
from harness_rl.engine.errors import ApiError
from harness_rl.engine.protocol import UpdateWeightsFromDisk, decode_body
from harness_rl.engine.server_context import CONTEXT
from harness_rl.engine.weights import read_safetensors_bytes, read_safetensors_path


async def pause(request: web.Request) -> web.Response:
    mode = request.query.get("mode", "wait")
    if mode not in PAUSE_MODES:
        raise ApiError(400, f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}.", param="mode")
    engine = request.app[CONTEXT].engine
    await engine.pause(cast(PauseMode, mode))
    if request.query.get("clear_cache", "false").lower() in ("1", "true"):
        engine.reset_prefix_cache()
    return web.json_response({"status": "paused"})


async def resume(request: web.Request) -> web.Response:
    request.app[CONTEXT].engine.resume()
    return web.json_response({"status": "resumed"})


async def is_paused(request: web.Request) -> web.Response:
    return web.json_response({"is_paused": request.app[CONTEXT].engine.is_paused})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    return web.json_response({"success": request.app[CONTEXT].engine.reset_prefix_cache()})


async def weight_info(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": str(request.app[CONTEXT].engine.policy_version)})


async def _load(request: web.Request, read, version: int) -> web.Response:
    engine = request.app[CONTEXT].engine
    try:
        state = await asyncio.to_thread(read)
        await asyncio.to_thread(engine.load_weights, state, version)
    except Exception as error:  # unreadable files or bytes, unknown names, wrong shapes
        raise ApiError(400, f"Weight update failed: {error}") from None
    return web.json_response({"status": "ok", "weight_version": str(version), "num_tensors": len(state)})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    body = decode_body(await request.read(), UpdateWeightsFromDisk)
    return await _load(request, lambda: read_safetensors_path(Path(body.path)), body.version)


async def update_weights_from_bytes(request: web.Request) -> web.Response:
    try:
        version = int(request.query["version"])
    except (KeyError, ValueError):
        raise ApiError(400, "query parameter `version` (an integer) is required.", param="version") from None
    payload = await request.read()
    return await _load(request, lambda: read_safetensors_bytes(payload), version)


def add_control_routes(app: web.Application) -> None:
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    app.router.add_get("/is_paused", is_paused)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/weight_info", weight_info)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/update_weights_from_bytes", update_weights_from_bytes)
