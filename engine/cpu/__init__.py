"""CPU kernels in C (`*.c` here), compiled on first use for this machine and loaded with ctypes
(`library.py`). The engine's only caller is `engine/model/decode_attention.py`, which keeps a
PyTorch
twin of every kernel and uses it wherever the library cannot be built."""
