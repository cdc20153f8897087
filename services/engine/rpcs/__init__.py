"""The engine's gRPC door: the servicer (server.py) and its adapter and lifecycle RPCs, the protobuf
conversions (convert.py) and the shared KV cache's client."""
