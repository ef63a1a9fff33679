"""The fronts: `grpc` (Arctic, SGLang, AllSpark, health, reflection), `http` (OpenAI routes, the
JSON mirror, probes, metrics), `common` (what both share) and `cli` (the composition root).

A front talks to the engine only through `jax_engine.api.EngineAPI`.
"""
