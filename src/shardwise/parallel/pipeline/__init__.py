"""Pipeline parallel: the stage split per family (built-in GPT, Llama-like HF, GPT-2), the schedule,
ties across stages, and the MoE router sums carried through stages."""
