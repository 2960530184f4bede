"""The gRPC metadata names (HTTP headers on the OpenAI front) both ends agree on (docs/deploy.md)."""

AUTHORIZATION = "authorization"  # "Bearer <key>": the caller's API key
# The session a call acts on: the affinity key routers hash to keep a session on the replica holding its caches.
# Sent on every rpc that names a session, on no other; when present it must equal the session the body names.
SESSION_METADATA = "x-session-id"
