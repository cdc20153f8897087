"""Test doubles shared by several test modules, so that none imports its fakes from another test module.

- router_mesh.py: fake engines, tokenizer and cache as real grpc.aio servers on loopback, and `running()`,
  the router's real servicer over them (with request builders: `chat`, `collect`, `ids_of`, `words`;
  `until` waits for a condition, `serve` starts one more fake service).
- edge_router.py: `FakeRouter`, a router double for the edge's ASGI app (canned deltas, or blocked until
  released), `edge_app` to build the edge over it, `asgi` for one request, and the `CHAT` requests.
- scripted_router.py: `ScriptedRouter`, a router double answering scripted deltas with logprobs and
  model versions, with `app`, `request`, `tokens` and `events` (the security tests of the edge's output).
- model.py: `FakeModel`, the scheduler's fake model over a simulated paged KV cache.
"""
