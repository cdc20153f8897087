"""The engine's pure core: what a step decides, with no model and no I/O. Requests and their limits
(request.py, admission.py), the scheduler and its block manager (paged KV cache, prefix reuse), fair shares
between tenants, draft proposals and the update of requests from a step's sampled tokens."""
