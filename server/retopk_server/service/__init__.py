"""The gRPC front end: servicer (validation, auth, error mapping), conversions, startup and drain."""
