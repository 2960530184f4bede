"""The front-end-neutral gateway both fronts call (gateway.py), the gRPC servicer over it, wire conversions
(wire.py), keys, limits, health, startup and drain."""
