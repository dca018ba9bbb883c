"""The wire formats agents speak: each decodes its requests into a `ChatCall` and renders an `Answer` (whole or
streamed) in its own shape. Dialects know nothing of the engine, the capture or the server; they import only the
proxy's base (`chat`, `live`, `errors`)."""
