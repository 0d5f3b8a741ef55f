"""The serving policy around the model: the fidelity guard (`guard`), blending or not under load
(`busy`) and continuous batching on one compute thread (`scheduler`, `threads`). It computes
nothing itself; `engine/model/` does.
"""
