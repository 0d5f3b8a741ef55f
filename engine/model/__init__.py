"""The model side: loading a checkpoint and computing with it.

Loading and its checks (`loader`, `families`, `linear`, `encode_dtype`, `selfcheck`), the
per-row layer steps and attention (`layers`, `attention`, `decode_attention`, `ops`), running a
plan layer by layer (`runner`, `encoder`), decoding (`decode`) and the meter of all model work
(`work`). Nothing here decides what a request is served with: that is `engine/serving/` and the
planners.
"""
