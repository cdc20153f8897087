"""The mesh spread over several hosts: network namespaces joined by a bridge (needs root and `ip netns`)."""
