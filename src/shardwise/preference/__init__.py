"""Preference tuning (DPO): paired batches, the loss from masked log-probs, the reference model.

``batches``: pairs -> rows (chosen and rejected in one forward, concatenated or packed);
``objective``: per-answer log-probs and the DPO/IPO loss; ``reference``: the reference model
(adapters off, a frozen sharded copy, or log-probs scored once); ``step``: the trainer's DPO step,
evaluation and metrics on the Session API. See docs/preference.md.
"""
