"""L3: a durable, content-addressed store of saved llama-server slot states (KV and recurrent state).

Pure cores (no I/O, no clock): `identity` (which states are interchangeable), `layout` (digests, segment
plan, manifest format, where things live), `commit` (the rules a manifest must satisfy before it exists),
`budget` (which entries and segments one eviction pass removes), `prefix` (the longest stored prefix of a
prompt, by hashing the prompt's own tokens at the recorded lengths). The shell `store` moves the bytes with
blocking file I/O and is meant to run in a worker thread; the actor that wires it to the bus comes later.
"""
