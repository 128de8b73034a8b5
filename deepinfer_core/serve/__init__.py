"""``deepinfer serve``: the HTTP transport in front of one engine.

* :mod:`.front` runs the engine's step loop in its own thread and hands each request's outputs
  to that request alone (the event loop never waits on a step);
* :mod:`.conversation` turns a protocol-neutral conversation into token ids and sampling
  parameters and the generated text back into reasoning / content / tool calls;
* :mod:`.grammar` constrains a request's tokens with xgrammar (structured output);
* :mod:`.tool_calls` gives chat-template models tool calls (Hermes syntax: prompt, parser and
  the structural tag that constrains a call once it starts);
* :mod:`.app` mounts the protocol codecs that plugins register, plus ``/v1/completions``,
  ``/v1/models``, ``/v1/plugins``, ``/health`` and ``/metrics`` (:mod:`.metrics`);
* :mod:`.inspect` answers ``POST /v1/inspect`` (rendered prompt, tokens, cached blocks, parser);
* :mod:`.web` serves the web page at ``/`` (files in ``web/``), ``/docs`` and ``/openapi.json``
  (request bodies described in :mod:`.api_schema`);
* :mod:`.cli` is the ``serve`` subcommand.

Importing this package is cheap: FastAPI, uvicorn and xgrammar load only when a server is built.
"""
