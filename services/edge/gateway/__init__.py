"""The gateway's policies, which every surface's request passes in one pipeline (pipeline.py): admission and
fair share, tenants and budgets, API keys and JWTs, input/output rules, the response cache."""
