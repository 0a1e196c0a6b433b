"""What test modules share: helpers, constants, fixtures and small classes that more than one test module uses.

A test module imports from here, never from another test module. Each module is named for what it holds:

* `nodes`: whole nodes as processes (`mesh-actor run`) and the CLI against them; `cli`: the CLI in-process.
* `frontdoor`: the front door from outside (catalog, keys, client); `doors`: front doors over a live bus.
* `generate`: generations through real nodes; `images`: image content parts; `rpc_split`: llama.cpp RPC splits.
* `runner`, `upkeep`: the runner actor under test; `placement`: the placement actor on a live bus;
  `router`: a ready instance for the router; `handoff`, `l3`, `l3_identity`: prompt-state handoff and the L3 store.
* `nats_roles`: roles on a real nats-server; `permissions`: matching a role's subject patterns.
* `admission`, `reservations`, `metrics`: records built for pure cores' tests.
* `geometry`, `gguf`, `memory_model`, `memory_exact`, `quantized`: GGUF headers, model geometries, memory-model
  inputs and their checks against a real llama-server.

Its modules' asserts are rewritten by pytest as a test module's are (`tests/conftest.py` registers them).
"""
