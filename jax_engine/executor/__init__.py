"""Where programs run: the platform and device defaults (backend.py), the persistent compile
cache and compile counting (compilation.py), and the multi-host step channel (multihost.py).
"""
