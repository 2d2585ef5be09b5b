"""The OpenAI-compatible HTTP server that ``python -m milestones.serve`` starts, for any milestone.

Its modules, each importing only those above it:

- ``errors``: the refusals (``BadRequest``, ...) and their answers in OpenAI's error shape
- ``chat``, ``request``: a request body checked and parsed into a ``Job`` and ``SamplingParams``
- ``answer``: the engine's outputs shaped as OpenAI's answer, whole or as chunks
- ``limits``: what one request may cost, bounded before it reaches the engine
- ``tokenizing``, ``streaming``: prompts tokenized off the engine's thread; outputs to the client
- ``app``: the FastAPI app and its routes; ``listen``: the app on a socket, with uvicorn

Not ``milestones.serving``, which every milestone's ``LLM`` shares; this server drives one
through ``milestones.engine_loop``.
"""
