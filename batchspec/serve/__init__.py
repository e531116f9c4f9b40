"""`batchspec serve`: an OpenAI-compatible server whose every output is token-identical to plain
decoding of that request alone.

  protocol.py  request bodies (strict) and OpenAI-shaped errors
  text.py      chat conversations to ids; incremental detokenization and stop strings
  loop.py      the engine loop thread: the only code that touches the Engine
  metrics.py   Prometheus metrics under vLLM's names, one registry per app
  app.py       the FastAPI app: endpoints, streaming, abort on disconnect, auth
  bench.py     the load generator behind `batchspec bench-serve`
"""

from .app import ServeOptions, create_app

__all__ = ["ServeOptions", "create_app"]
