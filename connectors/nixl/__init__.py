"""NIXL: kvconnect's own NIXL worker over committed regions (registration, JSON handshake,
READs with deadlines, re-registration after sleep/wake) and the ``nixl`` transport.

Installs as ``kvconnect.connectors.nixl`` (the folder ``connectors/nixl/``).
"""
