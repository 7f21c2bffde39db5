"""Helpers for tests and benchmarks that ship with the mesh: a deterministic OpenAI-compatible
server. Nothing here is an inference engine."""
