"""The decoder path: one GenerateWorker per served generator (worker.py) runs replicas of a
continuous-batching Scheduler (scheduler.py) over a paged KV cache (page_pool.py), each driving a
ModelRunner (runner.py) that owns the compiled step programs, with on-device sampling
(sampling.py) and incremental detokenization (detokenizer.py).
"""
