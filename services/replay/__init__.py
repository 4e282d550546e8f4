"""The replay service: the worker's gRPC server, its remote client, Redis Streams fan-out and
the server-side hook that picks one of them."""
