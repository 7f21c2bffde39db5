"""Mesh runtime shared by every node and client: config, NATS, backends, SDK, CLI."""

__version__ = "0.1.0"
