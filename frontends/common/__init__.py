"""What both fronts share: access policy, error mapping, metrics and the version string.

`frontends.grpc` and `frontends.http` import from here and from the engine's contract
(`jax_engine.api`, `.types`, `.errors`), never from each other.
"""
