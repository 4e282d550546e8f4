"""What every kvtier gRPC server shares (the store server and the replay worker):
authentication, the audit log, TLS, and the process lifecycle."""
