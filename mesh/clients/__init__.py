"""Clients of the mesh for users, tests and benchmarks.

    router_client.py  RouterClient: the router's gRPC Generate as plain Python values
    values.py         the plain values both take and give (GenerateSpec, Sampling, Delta, ...)
    router_pool.py    RouterPool: the edge's way to every router (RouterClient's interface), resuming streams
    http3.py          H3Client: HTTP/3 (QUIC) to the edge, with 0-RTT resumption
    tickets.py        TicketStore: TLS session tickets kept in memory or a file, for that resumption

Nothing is imported here, so `import mesh.clients.tickets` does not pull in the QUIC stack's client.
"""
