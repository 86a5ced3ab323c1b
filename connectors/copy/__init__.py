"""The block-copy engine: one launch per transfer over every layer, region and block (a
Triton kernel replayed as a CUDA graph, a copy-engine batch, or host memmoves).

Installs as ``kvconnect.connectors.copy`` (the folder ``connectors/copy/``).
"""
