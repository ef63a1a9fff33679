"""Generated protobuf / gRPC code for the three services (see regen.py)."""
