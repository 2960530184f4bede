"""The OpenAI-compatible HTTP front (``--http-port``), served in the same process as gRPC.

    schemas   request bodies (pydantic, strict, unknown fields refused)
    convert   body -> gRPC GenerateRequest, GenerateResponse -> OpenAI objects, error field names
    context   an HTTP request as the ServicerContext the gRPC servicer takes
    errors    OpenAI's error shape and the HTTP status of each gRPC status
    app       the routes (FastAPI)
    serve     uvicorn inside the server's asyncio loop

Every generation goes through the gRPC servicer's own Generate: same engine, batching, limits, keys and
metrics as gRPC. docs/http.md (and the README) show it from the outside.
"""
