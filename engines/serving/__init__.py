"""Serving OpenAI requests on the engines, apart from HTTP (as vLLM keeps ``serving_chat.py``
apart from ``api_server.py``): the views parse, call this, and shape its answer into a reply.

``request_mapping`` (validate a body, find the engine, tokenize, map the parameters onto a
``GenerationRequest``), ``generation`` (run it: the whole reply or its SSE events; streaming
semantics are decided there), ``shapers`` (the engine's outputs as OpenAI's objects). No Django.
"""
