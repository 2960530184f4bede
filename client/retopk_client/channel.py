"""Channel settings shared by the sync and asyncio clients: target, credentials, metadata, options."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import grpc

from retopk_client.addresses import DEFAULT_ADDRESS
from retopk_client.errors import RetopkError
from retopk_client.retry import RetryPolicy
from retopk_shared.metadata import AUTHORIZATION, SESSION_METADATA

# gRPC metadata naming the shared start of a sessionless request's prompt (a document, a system prompt): routers
# hash it so that such requests reach the replica whose prefix cache holds that start (docs/deploy.md).
PREFIX_METADATA = "x-prefix-key"

# The statuses a draining server's handoff notice comes with (errors.HANDOFF_METADATA).
HANDOFF_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND})

# Step statistics of long generations can be large; the gRPC default receive limit is 4 MiB.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ClientConfig:
    """How a client reaches the server.

    address      gRPC target ("host:port", "unix:/path", ...)
    api_key      sent as ``authorization: Bearer <key>`` on every call when set
    timeout      default deadline of each call in seconds (None = no deadline); each call can override it
    retry        retries of UNAVAILABLE for idempotent calls
    tls          connect over TLS, trusting ``ca`` (a PEM file) or else the system's roots
    ca           PEM file of the CA(s) that signed the server's certificate (implies tls)
    cert, key    PEM files of the client's certificate chain and private key, for a server that asks for
                 mutual TLS (set both; they imply tls)
    server_name  the name the server's certificate must carry when it is not the address's host
    credentials  explicit ``grpc.ChannelCredentials`` (overrides tls, ca, cert, key)
    options      extra channel options as (name, value) pairs
    handoff_addresses  the other replicas this client may move to: a draining server's handoff notice
                 (UNAVAILABLE or NOT_FOUND on a session call, naming the session's new home) naming one of them
                 moves the client there, and the call goes on with the same session id, without replay
    follow_any_handoff  follow a notice to any address (only against servers you trust: a notice decides
                 where the client's key and prompts go next)
    """

    address: str = DEFAULT_ADDRESS
    api_key: str | None = None
    timeout: float | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    tls: bool = False
    ca: str | os.PathLike | None = None
    cert: str | os.PathLike | None = None
    key: str | os.PathLike | None = None
    server_name: str | None = None
    credentials: grpc.ChannelCredentials | None = None
    options: tuple[tuple[str, object], ...] = ()
    handoff_addresses: tuple[str, ...] = ()
    follow_any_handoff: bool = False

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("address must not be empty")
        if (self.cert is None) != (self.key is None):
            raise ValueError("cert and key: a client certificate needs its private key (set both or neither)")
        if self.ca is not None or self.cert is not None:
            object.__setattr__(self, "tls", True)
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {self.timeout!r}")
        if isinstance(self.handoff_addresses, str):
            raise ValueError("handoff_addresses must be a sequence of addresses, not one string")
        object.__setattr__(self, "handoff_addresses", tuple(self.handoff_addresses))

    def handoff_target(self, err: RetopkError) -> str | None:
        """Where ``err``'s handoff notice says to continue, when this client may follow it (an address of
        ``handoff_addresses``, or any with ``follow_any_handoff``, and not the one it calls now), else None."""
        target = err.handoff
        if target is None or err.code not in HANDOFF_CODES or target == self.address:
            return None
        return target if self.follow_any_handoff or target in self.handoff_addresses else None

    @classmethod
    def of(cls, address: str | None = None, *, api_key: str | None = None, timeout: float | None = None,
           retry: RetryPolicy | None = None, tls: bool = False, ca=None, cert=None, key=None,
           handoff_addresses=(), follow_any_handoff: bool = False) -> ClientConfig:
        """A config from the clients' keyword arguments (None: the default)."""
        return cls(
            address=address or DEFAULT_ADDRESS, api_key=api_key, timeout=timeout, retry=retry or RetryPolicy(),
            tls=tls, ca=ca, cert=cert, key=key, handoff_addresses=tuple(handoff_addresses),
            follow_any_handoff=follow_any_handoff,
        )

    def metadata(self, session_id: str | None = None, prefix_key: str | None = None) -> tuple[tuple[str, str], ...]:
        """The call's metadata: the API key when set, and ``x-session-id`` when the call names a session, else
        ``x-prefix-key`` when it names a shared prompt start (a session routes by its id alone)."""
        auth = ((AUTHORIZATION, f"Bearer {self.api_key}"),) if self.api_key else ()
        if session_id:
            return (*auth, (SESSION_METADATA, session_id))
        return (*auth, (PREFIX_METADATA, prefix_key)) if prefix_key else auth

    def channel_options(self) -> list[tuple[str, object]]:
        return [
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            *((("grpc.ssl_target_name_override", self.server_name),) if self.server_name else ()),
            *self.options,
        ]

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """The channel's TLS credentials (reading the PEM files now), or None for plain text."""
        if self.credentials is not None:
            return self.credentials
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca), private_key=_read(self.key),
                                            certificate_chain=_read(self.cert))

    def open_channel(self, api):
        """A channel to ``address`` from ``api``: the ``grpc`` module (sync) or ``grpc.aio`` (asyncio)."""
        creds = self.channel_credentials()
        options = self.channel_options()
        if creds is not None:
            return api.secure_channel(self.address, creds, options)
        return api.insecure_channel(self.address, options)

    def call_timeout(self, timeout: float | None | object) -> float | None:
        """The per-call override when given, else the client's default."""
        return self.timeout if timeout is DEFAULT else timeout  # type: ignore[return-value]


def _read(path) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


DEFAULT = object()  # sentinel of a call's timeout: "the client's default" (None means no deadline)
