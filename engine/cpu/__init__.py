"""CPU kernels in C (`*.c` here), compiled on first use for this machine and loaded with ctypes
(`library.py`). The engine's callers are `engine/model/decode_attention.py` (the decode
attention) and `engine/model/native_step.py` (the whole decode step); each keeps a PyTorch twin
and uses it wherever the library cannot be built or cannot run the model."""
