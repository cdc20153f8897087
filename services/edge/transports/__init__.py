"""The transports the edge serves on: HTTP/1.1 and HTTP/3 (QUIC, 0-RTT) in front of one ASGI app, TLS."""
