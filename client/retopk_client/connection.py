"""The client's channel and stubs, which a followed handoff notice moves to a session's new home.

A draining server that handed a session over answers a call on it (for its owner only) UNAVAILABLE with a
trailer naming the replica where it continues (errors.HANDOFF_METADATA). ``Connection.follow`` takes that
address when the config allows it (``ClientConfig.handoff_target``: one of ``handoff_addresses``, or any with
``follow_any_handoff``): from then on every call goes there, with the same session ids; nothing is replayed.
The channel left behind is closed with the client, so that calls still under way on it can finish.
"""

from __future__ import annotations

import dataclasses
import threading

from retopk_client.channel import ClientConfig
from retopk_client.errors import RetopkError
from retopk_client.health import check_method
from retopk_proto.retopk.v1 import retopk_pb2_grpc as pb_grpc

HEALTH = "Health"  # ``rpc``'s name of the standard health check


class Connection:
    """``config`` (its address the current one), ``channel``, and ``rpc(name)``: the current channel's method."""

    def __init__(self, config: ClientConfig, api, channel=None) -> None:
        self.config = config
        self._api = api  # ``grpc`` (sync) or ``grpc.aio``
        self._lock = threading.Lock()
        self.owned: list = []  # the channels this connection opened, to close with the client
        self._use(channel if channel is not None else self._open())

    def _open(self):
        channel = self.config.open_channel(self._api)
        self.owned.append(channel)
        return channel

    def _use(self, channel) -> None:
        self.channel = channel
        self._stub = pb_grpc.ReTopKServiceStub(channel)
        self._health = check_method(channel)

    def rpc(self, name: str):
        """The multi-callable of ReTopKService's rpc ``name`` (or HEALTH) on the current channel."""
        return self._health if name == HEALTH else getattr(self._stub, name)

    def follow(self, err: RetopkError) -> bool:
        """Move to the new home ``err``'s handoff notice names, when the config allows it -> whether it did (also
        when another call already moved there)."""
        target = self.config.handoff_target(err)
        if target is None:
            return False
        with self._lock:
            if self.config.address != target:
                self.config = dataclasses.replace(self.config, address=target)
                self._use(self._open())
        return True
