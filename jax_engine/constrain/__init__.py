"""Structured generation: a request's `Constraint` -> an llguidance grammar -> a packed token
bitmask per sampled row, applied inside the step program (jax_engine/decode/runner.py).

- grammar.py   the constraint kinds -> llguidance grammar text (refusals name the field)
- compiler.py  compiles grammars off the scheduler thread, cached by grammar text per tokenizer
- state.py     one sequence's matcher: masks for the next step, consume the drawn token

Why llguidance (benchmarks/grammar_mask.py measures it against xgrammar): it has no Python
dependencies (xgrammar 0.2.9 requires torch, triton and transformers), its parser has fuel limits
on grammar size, lexer states and per-token work (so a hostile schema costs bounded time), and it
computes a batch of masks on its own thread pool without the GIL.
"""
