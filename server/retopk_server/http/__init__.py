"""The OpenAI-compatible HTTP front (``--http-port``), served in the same process as gRPC.

    schemas        request bodies (pydantic, strict, unknown fields refused)
    openai_bodies  body -> gRPC GenerateRequest, GenerateResponse -> OpenAI objects, error field names
    errors         OpenAI's error shape of the gateway's CallError
    app            the routes (FastAPI)
    serve          uvicorn inside the server's asyncio loop

Every generation goes through the same gateway (service/gateway.py) as a gRPC Generate: same engine,
batching, limits, keys and metrics. docs/http.md (and the README) show it from the outside.
"""
