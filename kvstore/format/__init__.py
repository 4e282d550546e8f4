"""The formats docs/wire-format.md specifies: layouts and their registry, chunk keys, the chunk
codec (one chunk, its section plan, a run of chunks), the window blob, resume hints, the error
table and the limits both sides enforce.

A leaf: it imports nothing else from kvstore, and it is the only part of the store that
the client (kvtier), the replay workers and the model may import. Importing it loads no
torch: the calls that make or read tensors do."""
