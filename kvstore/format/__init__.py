"""The formats docs/wire-format.md specifies: layouts, chunk keys, the chunk codec, the window blob.

A leaf: it imports nothing else from kvstore, and it is the only part of the store that
the client (kvtier), the replay workers and the model may import."""
