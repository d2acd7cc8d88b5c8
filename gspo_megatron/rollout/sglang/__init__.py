"""The SGLang rollout engine: its config section (config.py, plain), launcher, async HTTP
client, server pool, weight sync (tensor / distributed / disk) and the engine (engine.py).

A real SGLang server needs a GPU; see docs/SGLANG.md. Nothing here imports sglang itself, and
importing this package imports none of its modules (the config layer reads config.py alone).
"""
