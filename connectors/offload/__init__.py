"""CPU offload: a pool sized from committed per-block bytes, batched save/load with LRU slots.

Installs as ``kvconnect.connectors.offload`` (the folder ``connectors/offload/``).
"""
