"""The SGLang rollout engine, one concern per module: its config section (config.py, plain),
launcher, async HTTP client and protocol, server pool (servers.py), first contact (startup.py),
server memory (memory.py), generation (generation.py), weight updaters, one per mode
(updates/), their wire formats (weight_sync.py), and the engine that ties them (engine.py).

A real SGLang server needs a GPU; see docs/SGLANG.md. Nothing here imports sglang itself, and
importing this package imports none of its modules (the config layer reads config.py alone).
"""
