"""Weight updates of SGLang servers, one updater per `rollout.sglang.weight_sync` mode
(docs/SGLANG.md, "Weight sync"): `tensor.py` (colocated: CUDA-IPC payloads), `distributed.py`
(a broadcast over a process group with the servers, which `group.py` builds and tears down),
`disk.py` (HF safetensors the servers read); `adapter.py`: a LoRA policy's adapters alone, a PEFT
directory per version loaded through SGLang's LoRA API (`rollout.sglang.lora_sync=adapter`).
`session.py` holds what they share: one request per server, a failed answer moving its server
out of the update, and SGLang's weight-update session (/begin_weight_update ...
/end_weight_update). `base.py`: the updater's interface.

The engine (engine.py) picks the mode's updater, chooses the servers, keeps their memory
resident and pauses generation around an update; an updater only moves the weights.
"""
