"""What the client SDK and the server both follow beyond the generated messages (retopk_proto), so that
neither imports the other: the metadata names (``metadata``), the service's name (``service_names``), the checked
setting of a wire field and the reading of an attention method (``fields``), and the NAME=VALUE grammar of
command lines (``name_value``).

Needs only protobuf and the generated stubs (no grpcio, no torch); the client distribution ships it and the
server's depends on that.
"""
