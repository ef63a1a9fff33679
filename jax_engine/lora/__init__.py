"""Multi-LoRA serving: PEFT adapters (adapter.py), the device slot bank (bank.py), the name -> slot table (table.py)."""
