"""Tools for tests and benchmarks, shipped with the mesh so both can use them. Nothing here is an
inference engine: a deterministic OpenAI-compatible server (:mod:`mesh.testing.openai_server`)
and fault-test parts (:mod:`mesh.testing.chaos`)."""
