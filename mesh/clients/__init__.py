"""Clients of the mesh for users, tests and benchmarks.

    router.py   RouterClient: the router's gRPC Generate as plain Python values (the edge's client)
    http3.py    H3Client: HTTP/3 (QUIC) to the edge, with 0-RTT resumption
    tickets.py  TicketStore: TLS session tickets kept in memory or a file, for that resumption

Nothing is imported here, so `import mesh.clients.tickets` does not pull in the QUIC stack's client.
"""
