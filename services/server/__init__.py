"""The gRPC server: servicer, restore stream, request validation, metrics, store wiring, config."""
