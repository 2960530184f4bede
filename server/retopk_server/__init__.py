"""retopk_server: the gRPC decoding server (engine, sessions, sampling, metrics) around the ReTopK core."""
