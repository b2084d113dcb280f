"""`moerun serve`: an OpenAI-compatible HTTP server over the batching engine. `scheduler` (one thread
stepping a moerun.batching.Batch: continuous batching, prefix reuse), `protocol` (OpenAI's request
fields and response shapes), `app` (the Starlette routes). Needs the `serve` extra (starlette,
uvicorn)."""
