"""The encoder path: one EmbedWorker per served encoder (worker.py), TEI-style token-budget
batches over static (batch, seq_len) buckets.
"""
